"""Pure-PyTorch references, shared by tests, the demo and benchmarks.

`*_reference` compute in float64 from the given (already rounded) inputs: the exact answer the
kernels approximate. `eager_*` run in the inputs' dtype the way a PyTorch model would, and are the
baseline autofuse is timed against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .activations import TORCH_ACTIVATIONS


def _f64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.double()


def linear_reference(x, weight, bias=None, residual=None, activation="none") -> torch.Tensor:
    y = TORCH_ACTIVATIONS[activation](F.linear(_f64(x), _f64(weight), _f64(bias)))
    return y if residual is None else y + _f64(residual)


def gated_reference(x, w_gate, w_up, b_gate=None, b_up=None, activation="gelu_tanh") -> torch.Tensor:
    gate = F.linear(_f64(x), _f64(w_gate), _f64(b_gate))
    return TORCH_ACTIVATIONS[activation](gate) * F.linear(_f64(x), _f64(w_up), _f64(b_up))


def mlp_reference(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, activation="gelu_tanh"):
    """down(act(gate(x)) * up(x)) in float64."""
    return F.linear(gated_reference(x, w_gate, w_up, b_gate, b_up, activation), _f64(w_down), _f64(b_down))


def mlp_reference_rounded(x, weights: tuple, activation: str, hidden_dtype: torch.dtype) -> torch.Tensor:
    """mlp_reference of x and weights (w_gate, w_up, w_down[, b_gate, b_up, b_down]) with the hidden
    activation H rounded to `hidden_dtype` first, as every implementation that stores H in the model's dtype
    does."""
    w_gate, w_up, w_down, *biases = weights
    b_gate, b_up, b_down = biases or (None, None, None)
    h = gated_reference(x, w_gate, w_up, b_gate, b_up, activation).to(hidden_dtype).double()
    return F.linear(h, _f64(w_down), _f64(b_down))


def eager_linear(x, weight, bias=None, residual=None, activation="none") -> torch.Tensor:
    y = TORCH_ACTIVATIONS[activation](F.linear(x, weight, bias))
    return y if residual is None else y + residual


def eager_gated(x, w_gate, w_up, b_gate=None, b_up=None, activation="gelu_tanh") -> torch.Tensor:
    """Two nn.Linear calls and the pointwise gate, in the inputs' dtype."""
    return TORCH_ACTIVATIONS[activation](F.linear(x, w_gate, b_gate)) * F.linear(x, w_up, b_up)


def eager_mlp(x, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None, activation="gelu_tanh"):
    """Three nn.Linear calls plus the pointwise gate: what a Hugging Face MLP does."""
    return F.linear(eager_gated(x, w_gate, w_up, b_gate, b_up, activation), w_down, b_down)


# When a result computed in a dtype counts as correct: ||out - ref|| / ||ref|| within a few unit
# roundoffs of the dtype (one rounding of the output; float32 allows for tf32 when PyTorch enables it).
ERROR_BOUNDS = {torch.float32: 2e-3, torch.float16: 4 * 2**-11, torch.bfloat16: 4 * 2**-8}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, computed in float64 (NaN if out holds NaN)."""
    return ((out.double() - ref).norm() / ref.norm()).item()
