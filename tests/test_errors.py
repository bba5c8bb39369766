"""User mistakes get an AutofuseError that names the problem, not a traceback from Triton."""

import pytest
import torch

import autofuse
from autofuse import AutofuseError


@pytest.fixture
def mlp(device):
    return autofuse.get_mlp(32, 48, dtype=torch.float16, device=device)


def test_wrong_last_dimension(mlp, device):
    with pytest.raises(AutofuseError, match=r"\(\.\.\., 32\).*\(4, 31\)"):
        mlp(torch.randn(4, 31, dtype=torch.float16, device=device))


def test_dtype_mismatch(mlp, device):
    with pytest.raises(AutofuseError, match="float32 does not match.*float16"):
        mlp(torch.randn(4, 32, device=device))


def test_not_a_tensor(mlp):
    with pytest.raises(AutofuseError, match="expects a torch.Tensor"):
        mlp([[1.0] * 32])


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn, "bf16"], ids=str)
def test_unsupported_dtype(dtype, device):
    with pytest.raises(AutofuseError, match="unsupported dtype"):
        autofuse.get_linear(8, 8, dtype=dtype, device=device)


def test_unknown_activation(device):
    with pytest.raises(AutofuseError, match="unknown activation 'gleu'.*gelu_tanh"):
        autofuse.get_mlp(8, 8, activation="gleu", device=device)
    with pytest.raises(AutofuseError, match="unknown activation 'none'"):
        autofuse.get_mlp(8, 8, activation="none", device=device)  # a gate needs a real activation


def test_hugging_face_activation_names_are_accepted(device):
    assert autofuse.get_mlp(8, 16, activation="gelu_pytorch_tanh", device=device).activation == "gelu_tanh"
    assert autofuse.get_mlp(8, 16, activation="swish", device=device).activation == "silu"


@pytest.mark.parametrize("size", [0, -3, 2.5, True, "8"])
def test_bad_sizes(size, device):
    with pytest.raises(AutofuseError, match="must be a positive integer"):
        autofuse.get_linear(size, 8, device=device)


def test_bad_device_strings():
    with pytest.raises(AutofuseError, match="invalid device"):
        autofuse.get_mlp(8, 8, device="gpu0")
    with pytest.raises(AutofuseError, match="not on 'meta'"):
        autofuse.get_mlp(8, 8, device="meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given on a machine without a GPU")
def test_cuda_without_gpu_says_how_to_interpret():
    with pytest.raises(AutofuseError, match="no CUDA GPU is visible.*TRITON_INTERPRET=1"):
        autofuse.get_mlp(8, 8, device="cuda")


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(AutofuseError, match="only under Triton's interpreter"):
        autofuse.get_linear(8, 8, device="cpu")


def test_input_on_another_device(mlp, device):
    other = "meta"
    with pytest.raises(AutofuseError, match="input is on meta"):
        mlp(torch.randn(4, 32, dtype=torch.float16, device=other))


def test_residual_shape_and_dtype(device):
    lin = autofuse.get_linear(16, 24, dtype=torch.float32, device=device)
    x = torch.randn(5, 16, device=device)
    with pytest.raises(AutofuseError, match=r"residual must have the output's shape \(5, 24\), got \(5, 16\)"):
        lin(x, residual=x)
    with pytest.raises(AutofuseError, match="residual must match the input's dtype"):
        lin(x, residual=torch.randn(5, 24, dtype=torch.float16, device=device))


def test_mixed_parameter_dtypes(mlp, device):
    mlp.down_proj.to(torch.float32)
    with pytest.raises(AutofuseError, match="share one dtype"):
        mlp(torch.randn(4, 32, dtype=torch.float16, device=device))


def test_autofuse_error_is_a_value_error():
    assert issubclass(AutofuseError, ValueError)
