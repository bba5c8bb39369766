"""The pointwise passes after torch._scaled_mm with unit scales: the W8A8 library path `scaled_mm_unit` multiplies
the fp8 rows and fp8 weights with unit (tensorwise) scales, the raw products in bfloat16 (float32 for other
dtypes: the raw products reach 448^2 K, past float16's range), and applies the rows' and the weights' scales here,
in float32, in the pointwise pass the path runs anyway: op `scaled_gated_act` (H = act(G s_x s_g + b_g) *
(U s_x s_u + b_u), templates/scaled_gated_act.py.jinja) and op `scaled_bias_act` (act(Y s_x s_w + b) [+ R],
templates/scaled_bias_act.py.jinja). cuBLAS's rowwise-scaled fp8 GEMMs run one 128x128 tile shape, below fp8's
rate at large sizes: 4096 x 27648 x 6480 took 1928 us with rowwise scales and 1297 with unit ones (761 against
1132 TFLOP/s), 16384 x 26624 x 7616 7016 against 5413, 1024 x 7104 x 6272 91.7 against 76.0 (H100; bf16's
cuBLAS 2072, 9446, 139). A pass over memory: nothing to tune."""

from __future__ import annotations

import torch

from .. import launch as L
from ..activations import GATED_ACTIVATIONS, LINEAR_ACTIVATIONS, TORCH_ACTIVATIONS
from ..configs import KernelConfig
from ..opspec import POINTWISE, Operand, OpSpec

GATED_OPERANDS = (
    Operand("g", "[M, N]: the gate's unscaled products", "mn"),
    Operand("u", "[M, N]: the up projection's unscaled products", "mn"),
    Operand("sx", "[M] float32: the rows' scales", "m"),
    Operand("sg", "[N] float32: the gate weight's scales"),
    Operand("su", "[N] float32: the up weight's scales"),
    Operand("bg", "[N]", when="has_bias"),
    Operand("bu", "[N]", when="has_bias"),
    Operand("h", "[M, N]", "mn"),
)
BIAS_OPERANDS = (
    Operand("y", "[M, N]: the unscaled products", "mn"),
    Operand("sx", "[M] float32: the rows' scales", "m"),
    Operand("sw", "[N] float32: the weight's scales"),
    Operand("b", "[N]", when="has_bias"),
    Operand("r", "[M, N], added after the activation", "mn", when="has_residual"),
    Operand("o", "[M, N]: the result (may be y itself)", "mn"),
)


def raw_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype torch._scaled_mm writes a module of `dtype`'s unscaled products in: bfloat16 for bfloat16 (one
    rounding, of the same relative size as the scaled output's), else float32 (float16 cannot hold 448^2 K)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def _require_scales(name: str, sx: torch.Tensor, M: int, columns: dict, N: int) -> None:
    L.require(sx.shape == (M,) and sx.dtype == torch.float32,
              lambda: f"{name}: the rows' scales must be [{M}] float32, got {tuple(sx.shape)} {sx.dtype}")
    for what, s in columns.items():
        L.require(s.shape == (N,) and s.dtype == torch.float32 and s.is_contiguous(),
                  lambda what=what, s=s: f"{name}: {what} must be [{N}] float32 and contiguous, got "
                                         f"{tuple(s.shape)} {s.dtype}")


def scaled_gated_activation(g: torch.Tensor, u: torch.Tensor, scales: tuple, biases: tuple | None, activation: str,
                            dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """H = act(G sx sg + bg) * (U sx su + bu) in `dtype` ([M, F]; into `out` when given), from the unscaled
    products g and u ([M, F] each, any strides), scales = (sx, sg, su): the rows' ([M]) and the weights' ([F]),
    and biases = (bg, bu) or None."""
    sx, sg, su = scales
    bg, bu = (None, None) if biases is None else biases
    L.require(g.dim() == 2 and g.shape == u.shape and g.dtype == u.dtype and g.device == u.device,
              lambda: f"scaled_gated_act: g and u must be [M, F] alike, got {tuple(g.shape)} {g.dtype} and "
                      f"{tuple(u.shape)} {u.dtype}")
    M, F = g.shape
    _require_scales("scaled_gated_act", sx, M, {"sg": sg, "su": su}, F)
    L.require((bg is None) == (bu is None), "scaled_gated_act: both biases or neither")
    h = out if out is not None else torch.empty((M, F), dtype=dtype, device=g.device)
    if M and F:
        tensors = {"g": g, "u": u, "sx": sx, "sg": sg, "su": su, "bg": None if bg is None else bg.contiguous(),
                   "bu": None if bu is None else bu.contiguous(), "h": h}
        L.pointwise_launch(SCALED_GATED_ACT, activation, h.dtype, M, F, tensors, has_bias=bg is not None)
    return h


def scaled_bias_activation(y: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None,
                           residual: torch.Tensor | None, activation: str, dtype: torch.dtype) -> torch.Tensor:
    """act(Y sx sw + bias) + residual in `dtype` ([M, N]), from the unscaled products y ([M, N], any strides), the
    rows' scales sx ([M]) and the weight's sw ([N]): over y in place where it is of `dtype`, else in new storage."""
    L.require(y.dim() == 2, lambda: f"scaled_bias_act: y must be [M, N], got {tuple(y.shape)}")
    M, N = y.shape
    _require_scales("scaled_bias_act", sx, M, {"sw": sw}, N)
    L.require(bias is None or (bias.shape == (N,) and bias.dtype == dtype),
              lambda: f"scaled_bias_act: the bias must be [{N}] in {dtype}")
    L.require(residual is None or (tuple(residual.shape) == (M, N) and residual.dtype == dtype),
              lambda: f"scaled_bias_act: the residual must be [{M}, {N}] in {dtype}")
    o = y if y.dtype == dtype else torch.empty((M, N), dtype=dtype, device=y.device)
    if M and N:
        tensors = {"y": y, "sx": sx, "sw": sw, "b": None if bias is None else bias.contiguous(), "r": residual, "o": o}
        L.pointwise_launch(SCALED_BIAS_ACT, activation, dtype, M, N, tensors, has_bias=bias is not None,
                           has_residual=residual is not None)
    return o


def _gated_run(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    biases = None if ops.get("bg") is None else (ops["bg"], ops["bu"])
    return scaled_gated_activation(ops["g"], ops["u"], (ops["sx"], ops["sg"], ops["su"]), biases, activation,
                                   ops["g"].dtype, out=out)


def _gated_eager(ops: dict, activation: str) -> torch.Tensor:
    sx = ops["sx"][:, None]
    g = ops["g"].float() * sx * ops["sg"]
    u = ops["u"].float() * sx * ops["su"]
    if ops.get("bg") is not None:
        g, u = g + ops["bg"].float(), u + ops["bu"].float()
    return (TORCH_ACTIVATIONS[activation](g) * u).to(ops["g"].dtype)


def _bias_run(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    y = ops["y"] if out is None else out.copy_(ops["y"])
    return scaled_bias_activation(y, ops["sx"], ops["sw"], ops.get("b"), ops.get("r"), activation, y.dtype)


def _bias_eager(ops: dict, activation: str) -> torch.Tensor:
    y = ops["y"].float() * ops["sx"][:, None] * ops["sw"]
    if ops.get("b") is not None:
        y = y + ops["b"].float()
    y = TORCH_ACTIVATIONS[activation](y)
    return (y if ops.get("r") is None else y + ops["r"].float()).to(ops["y"].dtype)


SCALED_GATED_ACT = OpSpec(
    name="scaled_gated_act",
    template="scaled_gated_act",
    doc="act(G sx sg + bg) * (U sx su + bu) after torch._scaled_mm with unit scales (nothing to tune)",
    operands=GATED_OPERANDS,
    activations=GATED_ACTIVATIONS,
    run=_gated_run,
    **POINTWISE,
    library={"eager": _gated_eager},
)

SCALED_BIAS_ACT = OpSpec(
    name="scaled_bias_act",
    template="scaled_bias_act",
    doc="act(Y sx sw + b) [+ R] after torch._scaled_mm with unit scales (nothing to tune)",
    operands=BIAS_OPERANDS,
    activations=LINEAR_ACTIVATIONS,
    run=_bias_run,
    residual=True,
    **POINTWISE,
    library={"eager": _bias_eager},
)
