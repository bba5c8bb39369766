"""The pointwise pass Y = act(Y + b) [+ R] over a GEMM's output, in place (templates/bias_act.py.jinja): op
`bias_act`, the second half of the Linear's library path cublas_bias_act (cuBLAS without an epilogue, then this
one pass: what torch.compile generates for a Linear followed by pointwise work). A pass over memory: one fixed
tile shape serves every size, so nothing is tuned."""

from __future__ import annotations

import torch

from .. import launch as L
from ..activations import LINEAR_ACTIVATIONS, TORCH_ACTIVATIONS
from ..configs import KernelConfig
from ..opspec import POINTWISE, Operand, OpSpec

OPERANDS = (
    Operand("y", "[M, N]: the GEMM's output, overwritten with the result", "mn"),
    Operand("b", "[N]", when="has_bias"),
    Operand("r", "[M, N], added after the activation", "mn", when="has_residual"),
)


def bias_activation(y: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                    activation: str) -> torch.Tensor:
    """Y = act(Y + bias) + residual over y ([M, N], any strides) in place; returns y."""
    L.require(y.dim() == 2, lambda: f"bias_act: y must be [M, N], got {tuple(y.shape)}")
    M, N = y.shape
    L.require(bias is None or (bias.dim() == 1 and bias.shape[0] == N and bias.dtype == y.dtype),
              lambda: f"bias_act: the bias must be [{N}] in {y.dtype}")
    L.require(residual is None or (tuple(residual.shape) == (M, N) and residual.dtype == y.dtype),
              lambda: f"bias_act: the residual must be [{M}, {N}] in {y.dtype}")
    if M and N and (bias is not None or residual is not None or activation != "none"):
        tensors = {"y": y, "b": None if bias is None else bias.contiguous(), "r": residual}
        L.pointwise_launch(BIAS_ACT, activation, y.dtype, M, N, tensors, has_bias=bias is not None,
                           has_residual=residual is not None)
    return y


def _run(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    y = ops["y"] if out is None else out.copy_(ops["y"])
    return bias_activation(y, ops.get("b"), ops.get("r"), activation)


def _eager(ops: dict, activation: str) -> torch.Tensor:
    y = ops["y"] if ops.get("b") is None else ops["y"] + ops["b"]
    y = TORCH_ACTIVATIONS[activation](y)
    return y if ops.get("r") is None else y + ops["r"]


BIAS_ACT = OpSpec(
    name="bias_act",
    template="bias_act",
    doc="a Linear's act(Y + b) [+ R] over cuBLAS's output, in place (nothing to tune)",
    operands=OPERANDS,
    activations=LINEAR_ACTIVATIONS,
    run=_run,
    residual=True,
    **POINTWISE,
    library={"eager": _eager},
)
