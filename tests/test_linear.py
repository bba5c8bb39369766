"""FusedLinear and the linear template against the float64 reference."""

import pytest
import torch
from _helpers import BLOCK_CONFIGS, DTYPES, assert_matches_reference

import autofuse
from autofuse import launch
from autofuse.activations import LINEAR_ACTIVATIONS
from autofuse.configs import KernelConfig
from autofuse.ops.linear import linear
from autofuse.reference import eager_linear, linear_reference


def _check(module, x, residual=None):
    with torch.no_grad():
        out = module(x, residual=residual)
        args = (x, module.weight, module.bias, residual, module.activation)
        assert_matches_reference(out, linear_reference(*args), eager_linear(*args))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", LINEAR_ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("residual", [False, True], ids=["nores", "res"])
def test_every_activation_dtype_bias_residual(dtype, activation, bias, residual, device):
    module = autofuse.get_linear(40, 72, bias=bias, activation=activation, dtype=dtype, device=device)
    x = torch.randn(37, 40, dtype=dtype, device=device)
    r = torch.randn(37, 72, dtype=dtype, device=device) if residual else None
    _check(module, x, r)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M", [1, 7, 37, 129])
def test_odd_shapes(dtype, M, device):
    # 40 and 88 are multiples of no block size >= 16 used here except 8-aligned: both K and N are ragged.
    module = autofuse.get_linear(88, 40, activation="gelu_tanh", dtype=dtype, device=device)
    _check(module, torch.randn(M, 88, dtype=dtype, device=device))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_3d_and_non_contiguous_input(dtype, device):
    module = autofuse.get_linear(24, 40, activation="silu", dtype=dtype, device=device)
    x = torch.randn(3, 5, 24, dtype=dtype, device=device)
    _check(module, x, torch.randn(3, 5, 40, dtype=dtype, device=device))
    wide = torch.randn(5, 3, 48, dtype=dtype, device=device)
    strided = wide.transpose(0, 1)[..., ::2]  # [3, 5, 24], no dimension contiguous
    assert not strided.is_contiguous()
    _check(module, strided)


CONFIGS = BLOCK_CONFIGS


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=KernelConfig.short)
@pytest.mark.parametrize("K", [48, 64], ids=["K48", "K64"])  # 48 is ragged for BLOCK_K 32/64, 64 is even
def test_block_configs(dtype, config, K, device):
    # The launcher with explicit configs: every config the tuner may pick must be correct.
    M, N = 37, 40
    x = torch.randn(M, K, dtype=dtype, device=device)
    w = torch.randn(N, K, dtype=dtype, device=device) / K**0.5
    b = torch.randn(N, dtype=dtype, device=device)
    r = torch.randn(M, N, dtype=dtype, device=device)
    out = linear(x, w, b, r, "gelu", config)
    args = (x, w, b, r, "gelu")
    assert_matches_reference(out, linear_reference(*args), eager_linear(*args))


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Launchers allocate NaN-filled outputs, so an element a kernel fails to write stays NaN."""
    monkeypatch.setattr(
        launch, "allocate", lambda shape, like: torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)
    )


@pytest.mark.parametrize("config", CONFIGS, ids=KernelConfig.short)
def test_every_output_element_is_written(config, poisoned_outputs, device):
    x = torch.randn(37, 40, device=device)
    w = torch.randn(72, 40, device=device)
    out = linear(x, w, None, None, "none", config)
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum().item()} elements left unwritten"
    # The check can fail: a buffer nothing wrote is reported.
    assert not torch.isfinite(launch.allocate((2, 2), x)).any()


def test_state_dict_is_nn_linear_compatible(device):
    reference = torch.nn.Linear(40, 24, dtype=torch.float32, device=device)
    module = autofuse.get_linear(40, 24, dtype=torch.float32, device=device)
    module.load_state_dict(reference.state_dict())
    x = torch.randn(5, 40, device=device)
    with torch.no_grad():
        torch.testing.assert_close(module(x), reference(x), rtol=1e-5, atol=1e-5)


def test_empty_batch(device):
    module = autofuse.get_linear(40, 24, dtype=torch.float32, device=device)
    assert module(torch.randn(0, 40, device=device)).shape == (0, 24)


def test_config_for_reports_a_config_per_bucket(device):
    module = autofuse.get_linear(40, 24, dtype=torch.float16, device=device)
    configs = module.config_for(37)
    assert set(configs) == {"linear"} and isinstance(configs["linear"], KernelConfig)
    assert module.config_for(33) == configs  # 33 and 37 share the bucket 64
