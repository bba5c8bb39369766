"""Op gated_pairs: the gated up-projection as one GEMM over interleaved gate/up weights, against
the float64 reference in every dtype and activation, with and without biases, over ragged M, N and K and
every block config the tests prove (split-K and the persistent TMA kernel included)."""

import pytest
import torch
from _helpers import BLOCK_CONFIGS, DTYPES, assert_matches_reference

from autofuse import launch, ops
from autofuse.activations import GATED_ACTIVATIONS
from autofuse.choose.heuristics import heuristic_for
from autofuse.configs import KernelConfig
from autofuse.key import Problem
from autofuse.launch import LaunchError
from autofuse.ops.gated_pairs import gate_and_up, gated_pairs, interleave
from autofuse.reference import ERROR_BOUNDS, eager_gated, gated_reference, relative_error


def _problem(M, F_, K, dtype, device, bias=True):
    x = torch.randn(M, K, dtype=dtype, device=device)
    wg, wu = (torch.randn(F_, K, dtype=dtype, device=device) / K**0.5 for _ in range(2))
    bg, bu = (torch.randn(F_, dtype=dtype, device=device) for _ in range(2)) if bias else (None, None)
    return x, wg, wu, bg, bu


def _check(out, x, wg, wu, bg, bu, activation):
    ref = gated_reference(x, wg, wu, bg, bu, activation)
    assert_matches_reference(out, ref, eager_gated(x, wg, wu, bg, bu, activation))


def test_interleave_and_views():
    a, b = torch.arange(6.0).reshape(3, 2), -torch.arange(6.0).reshape(3, 2)
    pairs = interleave(a, b)
    assert pairs.shape == (6, 2) and torch.equal(pairs[1], b[0]) and torch.equal(pairs[4], a[2])
    g, u = gate_and_up(pairs)
    assert torch.equal(g, a) and torch.equal(u, b) and g.data_ptr() == pairs.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_every_activation_dtype_bias(dtype, activation, bias, device):
    x, wg, wu, bg, bu = _problem(37, 40, 48, dtype, device, bias)
    w = interleave(wg, wu)
    b = None if bg is None else interleave(bg, bu)
    config = heuristic_for(Problem("gated_pairs", 40, 48, 37, dtype, activation, bias, False, x.device))  # the default
    _check(gated_pairs(x, w, b, activation, config), x, wg, wu, bg, bu, activation)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", BLOCK_CONFIGS, ids=KernelConfig.short)
@pytest.mark.parametrize("K", [48, 64], ids=["K48", "K64"])
def test_block_configs(dtype, config, K, device):
    # F = 44: the GEMM's N = 88 is ragged for every BLOCK_N, and H's last tile is partly past its edge.
    x, wg, wu, bg, bu = _problem(37, 44, K, dtype, device)
    out = gated_pairs(x, interleave(wg, wu), interleave(bg, bu), "gelu_tanh", config)
    _check(out, x, wg, wu, bg, bu, "gelu_tanh")


def test_writes_every_element_and_into_out(monkeypatch, device):
    monkeypatch.setattr(
        launch, "allocate", lambda shape, like: torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)
    )
    x, wg, wu, _, _ = _problem(37, 36, 40, torch.float32, device, bias=False)
    out = gated_pairs(x, interleave(wg, wu), None, "silu", KernelConfig(16, 32, 16, group_m=3))
    assert torch.isfinite(out).all()
    into = torch.full((37, 36), float("nan"), device=device)
    assert gated_pairs(x, interleave(wg, wu), None, "silu", KernelConfig(16, 32, 16), out=into) is into
    torch.testing.assert_close(into, out, rtol=0, atol=0)


def test_misfit_operands_are_refused(device):
    x, wg, wu, _, _ = _problem(5, 8, 16, torch.float32, device, bias=False)
    with pytest.raises(LaunchError, match="do not fit"):
        gated_pairs(x, interleave(wg, wu)[:, :8], None, "silu", KernelConfig(16, 16, 16))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_library_candidates_are_correct(dtype, bias, device):
    spec = ops.get("gated_pairs")
    operands = spec.make_operands(40, 48, 5, bias, False, lambda *s: torch.randn(*s, device=device).to(dtype))
    ref = spec.reference(operands, "silu", dtype)
    assert list(spec.library) == ["eager", "cublas_pairs"]
    for name, run in spec.library_for("silu", bias, False).items():
        out = run(operands, "silu")
        assert out.shape == ref.shape and relative_error(out, ref) <= ERROR_BOUNDS[dtype], name
