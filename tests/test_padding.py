"""A gated MLP whose d_ff is not a multiple of 8 keeps its parameters in zero-padded storage and runs at
the padded width (autofuse/padding.py): correct in every dtype, invisible to state_dict, kept through
`.to()`, given up (not wrong) when a parameter is replaced."""

import pytest
import torch
from _helpers import DTYPES, check_mlp

import autofuse
from autofuse import ops
from autofuse.padding import PAD_TO, run_width
from autofuse.reference import eager_mlp
from autofuse.shapes import MLPShape


def _is_padded(module) -> bool:
    wd = module.down_proj.weight
    return wd.stride() == (run_width(module.d_ff), 1) and not wd.is_contiguous()


def test_run_width():
    assert run_width(72) == 72 and run_width(16384) == 16384  # aligned rows: unchanged
    assert run_width(75) == 128 and run_width(10485) == 10496 and run_width(68) == 128
    assert all(run_width(f) % PAD_TO == 0 for f in (1, 7, 63, 65, 4097))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("M", [1, 37])
def test_odd_d_ff_runs_padded_and_correct(dtype, bias, M, device):
    module = autofuse.get_mlp(40, 75, activation="silu", bias=bias, dtype=dtype, device=device)
    assert _is_padded(module) and module.d_ff_run == 128
    assert [tuple(p.shape) for p in module.parameters()] == (
        [(75, 40), (75,), (75, 40), (75,), (40, 75), (40,)] if bias else [(75, 40), (75, 40), (40, 75)])
    check_mlp(module, torch.randn(M, 40, dtype=dtype, device=device))
    # The padding stays zero: the padded width's extra gate/up rows and down columns.
    wd = module.down_proj.weight
    assert wd.as_strided((40, 128), (128, 1))[:, 75:].abs().max() == 0


def test_aligned_d_ff_keeps_plain_parameters(device):
    module = autofuse.get_mlp(40, 72, dtype=torch.float16, device=device)
    assert module.d_ff_run == 72 and all(p.is_contiguous() for p in module.parameters())


def test_state_dict_is_plain_and_round_trips(device):
    module = autofuse.get_mlp(24, 37, bias=True, dtype=torch.float32, device=device)
    state = module.state_dict()
    assert list(state) == ["gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias",
                           "down_proj.weight", "down_proj.bias"]
    assert all(t.is_contiguous() for t in state.values())  # what safetensors needs
    torch.testing.assert_close(state["down_proj.weight"], module.down_proj.weight, rtol=0, atol=0)
    other = autofuse.get_mlp(24, 37, bias=True, dtype=torch.float32, device=device)
    other.load_state_dict(state)
    assert _is_padded(other)  # load_state_dict copies into the padded views
    x = torch.randn(5, 24, device=device)
    with torch.no_grad():
        torch.testing.assert_close(other(x), module(x), rtol=0, atol=0)


def test_padding_kept_through_to(device):
    module = autofuse.get_mlp(32, 45, activation="gelu_tanh", dtype=torch.float32, device=device)
    module = module.to(torch.bfloat16)
    assert module.down_proj.weight.dtype == torch.bfloat16 and _is_padded(module)
    check_mlp(module, torch.randn(9, 32, dtype=torch.bfloat16, device=device))


def test_replaced_or_edited_parameters_are_seen(device):
    module = autofuse.get_mlp(32, 45, dtype=torch.float32, device=device)
    x = torch.randn(6, 32, device=device)
    with torch.no_grad():
        module.down_proj.weight.mul_(2)  # an in-place edit of the view: still padded
        assert _is_padded(module)
        check_mlp(module, x)
        # A replaced parameter is a plain tensor: the module runs at d_ff on it, not on the old storage.
        module.down_proj.weight.data = torch.randn(32, 45, device=device) / 45**0.5
        check_mlp(module, x)
        assert module.d_ff_run == 45


def test_training_on_padded_parameters(device):
    module = autofuse.get_mlp(32, 45, activation="silu", dtype=torch.float32, device=device)
    x = torch.randn(7, 32, device=device, requires_grad=True)
    module(x).square().sum().backward()
    grads = [p.grad.clone() for p in module.parameters()] + [x.grad.clone()]
    x_ref = x.detach().clone().requires_grad_()
    params = [p.detach().clone().requires_grad_() for p in module.parameters()]
    eager_mlp(x_ref, *params, activation="silu").square().sum().backward()
    for got, want in zip(grads, [p.grad for p in params] + [x_ref.grad]):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_tuning_keys_use_the_width_that_runs():
    shape = MLPShape("odd", 512, 1001, "silu")
    assert ops.get("gated_up").dims(shape)[0] == 1024
    assert ops.get("down").dims(shape)[1] == 1024
    assert ops.get("mlp").dims(shape)[0] == 1024
