"""benchmarks/host_cost.py's bare training step: the floor it reports does the step's whole work."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
host_cost = pytest.importorskip("host_cost")


def test_the_bare_step_computes_eager_autograds_output_and_down_gradient_and_every_gradient_shape():
    """Float64 on the CPU, fresh random inputs: the bare Function's output and dW_down are eager autograd's (its
    pointwise backward stands in for the fused pass, so dX, dW_gate and dW_up are gradients of that stand-in, of
    the right shapes and dtypes, not the step's)."""
    torch.manual_seed(0)
    M, d, f = 24, 16, 40
    stacked = torch.randn(2, f, d, dtype=torch.float64)
    w_gate, w_up = torch.nn.Parameter(stacked[0]), torch.nn.Parameter(stacked[1])
    w_gate.data, w_up.data = stacked[0], stacked[1]
    w_down = torch.nn.Parameter(torch.randn(d, f, dtype=torch.float64))
    x = torch.randn(M, d, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(M, d, dtype=torch.float64)
    y = host_cost._BareStep.apply(x, w_gate, w_up, w_down)
    y.backward(dy)
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_gate, w_up, w_down)]
    ref = F.linear(F.silu(F.linear(leaves[0], leaves[1])) * F.linear(leaves[0], leaves[2]), leaves[3])
    ref.backward(dy)
    torch.testing.assert_close(y.detach(), ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w_down.grad, leaves[3].grad, rtol=1e-10, atol=1e-10)
    for t, leaf in zip((x, w_gate, w_up), leaves):
        assert t.grad.shape == leaf.shape and t.grad.dtype == torch.float64 and t.grad.abs().sum() > 0
