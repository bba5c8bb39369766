"""The passes after torch._scaled_mm with unit scales (ops/scaled_act.py): the rows' and the weights' scales, the
biases, the activation and the residual applied to the unscaled products, against float64."""

import pytest
import torch
from _helpers import DTYPES

from autofuse.activations import GATED_ACTIVATIONS, LINEAR_ACTIVATIONS, TORCH_ACTIVATIONS
from autofuse.ops import get
from autofuse.ops.scaled_act import raw_dtype, scaled_bias_activation, scaled_gated_activation
from autofuse.reference import ERROR_BOUNDS, relative_error

M, N = 37, 75  # ragged: no tile divides either


def _scales(device):
    return torch.rand(M, device=device) + 0.5, torch.rand(N, device=device) + 0.5, torch.rand(N, device=device) + 0.5


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_scaled_gated_act_applies_both_scales_and_the_biases(dtype, activation, bias, device):
    """G and U as the halves of one unscaled [M, 2N] product in the raw dtype (what two _scaled_mm calls would fill),
    H in the module's dtype."""
    raw = torch.randn(M, 2 * N, device=device).to(raw_dtype(dtype)) * 50
    g, u = raw[:, :N], raw[:, N:]
    sx, sg, su = _scales(device)
    bg, bu = (torch.randn(N, device=device).to(dtype), torch.randn(N, device=device).to(dtype)) if bias else (None,
                                                                                                              None)
    h = scaled_gated_activation(g, u, (sx, sg, su), (bg, bu) if bias else None, activation, dtype)
    f64 = {name: None if t is None else t.double() for name, t in dict(g=g, u=u, bg=bg, bu=bu).items()}
    gate = f64["g"] * sx.double()[:, None] * sg.double() + (0 if bg is None else f64["bg"])
    up = f64["u"] * sx.double()[:, None] * su.double() + (0 if bu is None else f64["bu"])
    ref = TORCH_ACTIVATIONS[activation](gate) * up
    assert h.dtype == dtype and h.shape == (M, N)
    assert relative_error(h, ref) <= ERROR_BOUNDS[dtype]  # one rounding of a float32 result to dtype


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", LINEAR_ACTIVATIONS)
@pytest.mark.parametrize("bias, residual", [(False, False), (True, False), (True, True)], ids=["plain", "b", "b-r"])
def test_scaled_bias_act_applies_both_scales_the_bias_and_the_residual(dtype, activation, bias, residual, device):
    """The unscaled products in the raw dtype: over them in place where that is the module's dtype (bfloat16), into
    new storage otherwise; a view of the first N columns of a wider product (padded weights) as well."""
    wide = torch.randn(M, N + 5, device=device).to(raw_dtype(dtype)) * 50
    y = wide[:, :N]
    sx, sw, _ = _scales(device)
    b = torch.randn(N, device=device).to(dtype) if bias else None
    r = torch.randn(M, N, device=device).to(dtype) if residual else None
    ref = y.double() * sx.double()[:, None] * sw.double() + (0 if b is None else b.double())
    ref = TORCH_ACTIVATIONS[activation](ref) + (0 if r is None else r.double())
    out = scaled_bias_activation(y, sx, sw, b, r, activation, dtype)
    assert out.dtype == dtype and out.shape == (M, N)
    assert (out.data_ptr() == y.data_ptr()) == (raw_dtype(dtype) == dtype)
    assert relative_error(out, ref) <= ERROR_BOUNDS[dtype]  # one rounding of a float32 result to dtype


def test_the_passes_refuse_scales_that_do_not_fit_in_one_line(device):
    from autofuse.launch import LaunchError

    g = torch.randn(M, N, device=device)
    sx, sg, su = _scales(device)
    with pytest.raises(LaunchError, match=r"rows' scales must be \[37\] float32"):
        scaled_gated_activation(g, g, (sx[:-1], sg, su), None, "silu", torch.float32)
    with pytest.raises(LaunchError, match=r"sw must be \[75\] float32"):
        scaled_bias_activation(g, sx, sg.double(), None, None, "none", torch.float32)


def test_both_passes_are_registered_ops_with_an_eager_twin(device):
    """Registered like every op (show-kernel, the registry's checks), each with its eager computation of the same
    values."""
    sx, sg, su = _scales(device)
    g, u = torch.randn(M, N, device=device), torch.randn(M, N, device=device)
    gated = get("scaled_gated_act")
    ops_ = {"g": g, "u": u, "sx": sx, "sg": sg, "su": su}
    torch.testing.assert_close(gated.run(ops_, "silu", None), gated.library["eager"](ops_, "silu"))
    linear = get("scaled_bias_act")
    ops_ = {"y": g.clone(), "sx": sx, "sw": sg}
    expected = linear.library["eager"]({**ops_, "y": g.clone()}, "gelu")
    torch.testing.assert_close(linear.run(ops_, "gelu", None), expected)
