"""Activation names autofuse accepts, their PyTorch definitions (used by references and eager library paths)
and derivatives (the training backward)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .errors import AutofuseError, shown

TORCH_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": lambda x: x,
    "relu": F.relu,
    "gelu": lambda x: F.gelu(x, approximate="none"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}

LINEAR_ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")
# A gated MLP needs a non-trivial gate: GeGLU (gelu, gelu_tanh) and SwiGLU (silu).
GATED_ACTIVATIONS = ("gelu", "gelu_tanh", "silu")

# Names Hugging Face configs use for the same functions.
ALIASES = {
    "identity": "none",
    "linear": "none",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "swish": "silu",
}


def canonical_activation(name: object, allowed: tuple[str, ...]) -> str:
    """Return the canonical name of `name`, or raise AutofuseError listing what is accepted."""
    if not isinstance(name, str):
        raise AutofuseError(f"activation must be a string, got {type(name).__name__}")
    canonical = ALIASES.get(name, name)
    if canonical not in allowed:
        raise AutofuseError(f"unknown activation {shown(name)}; choose one of {', '.join(allowed)}")
    return canonical


def activation_backward(activation: str, grad: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """d act(pre) / d pre * grad, computed as eager autograd computes it."""
    if activation == "none":
        return grad
    if activation == "relu":
        return torch.where(pre > 0, grad, torch.zeros_like(grad))
    if activation in ("gelu", "gelu_tanh"):
        return torch.ops.aten.gelu_backward(grad, pre, approximate="tanh" if activation == "gelu_tanh" else "none")
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, pre)
    raise ValueError(f"no derivative for activation {activation!r}")
