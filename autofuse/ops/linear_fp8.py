"""The Linear with fp8 weights (weight-only): Y = act(X @ (W * s)^T + b) [+ R], W stored as float8_e4m3fn with a
float32 scale s per output channel, X, b, R and Y in the model's dtype. The linear kernel (templates/linear*.py.jinja
with `fp8_weights`) loads W's tiles in fp8, half the bytes of bf16 (what decode streams), widens them to X's type
for the dot (every e4m3 value is exact in bf16, fp16 and float32) and applies s in the epilogue, before the bias.

A different function of the original weights than the dense Linear (W is rounded to fp8): it is keyed apart
(op `linear_fp8`), checked against the float64 product of the dequantized weights, and the dense library paths
never stand in for it.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from .. import launch as L
from ..configs import KernelConfig
from ..errors import AutofuseError
from ..layout import aligned_rows, padded_rows
from ..opspec import Operand
from ..reference import eager_linear, linear_reference
from .linear import LINEAR

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn

OPERANDS = (
    Operand("x", "[M, K]", "mk"),
    Operand("w", "[N, K] float8_e4m3fn, nn.Linear layout", "nk"),
    Operand("s", "[N] float32, the scale of each row of w"),
    Operand("b", "[N]", when="has_bias"),
    Operand("r", "[M, N], added after the activation", "mn", when="has_residual"),
    Operand("y", "[M, N]", "mn"),
)


class Fp8Weight(NamedTuple):
    """fp8 weights as the modules pass them to dispatch: W8, its scales, and the op that multiplies them (a Linear's
    linear_fp8, or linear_w8a8 where the activations are quantized too; an MLP's gated_up_fp8 and down_fp8)."""

    w8: torch.Tensor
    scale: torch.Tensor
    op: str


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W8, s): `weight` ([N, K]) as float8_e4m3fn with a float32 scale per row, each row's largest magnitude
    mapped to e4m3's largest finite value (448); a row of zeros gets scale 1. W8 * s[:, None] approximates
    `weight` to e4m3's 3 mantissa bits (a relative error of at most 2^-4 per element, rounding to nearest)."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8 of a weight [N, K], W8 a view of zero-filled storage whose rows start whole 128-byte lines
    apart and whose row count is a multiple of 16 (layout.padded_rows): how modules and tuning hold fp8 weights.
    Triton specialises a kernel on integer arguments divisible by 16, and only then vectorises the loads along a
    row: rows of d_ff = 27640 fp8 bytes (8-byte aligned) streamed at 27-31% of the read ceiling at M = 4 and 16
    (H100, the best tile configs) and at 69% at M = 1 (the GEMV; 95% for the same MLP's 16-byte aligned
    up-projection); rows a whole number of lines apart read faster still (layout.LINE_BYTES). The whole storage,
    [16 k, 128 k'], is what torch._scaled_mm reads (linear_w8a8.scaled_mm_quantized)."""
    w8, scale = quantize_fp8(weight)
    return padded_rows(w8), scale


def dequantize_fp8(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W8 * s[:, None] in `dtype`: exact in float64 (what references take), else rounded once from float32."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return (w8.to(wide) * scale.to(wide)[:, None]).to(dtype)


def linear_fp8(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor | None, activation: str, config: KernelConfig,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Y = act(x @ (w8 * scale[:, None]).T + bias) + residual; x: [M, K] (float32, float16 or bfloat16), w8: [N, K]
    float8_e4m3fn, scale: [N] float32, bias: [N] and residual: [M, N] in x's dtype. Written into `out` when given."""
    return launch_linear(LINEAR_FP8, x, (w8, scale), bias, residual, activation, config, out)


def launch_linear(spec, x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor], bias: torch.Tensor | None,
                  residual: torch.Tensor | None, activation: str, config: KernelConfig,
                  out: torch.Tensor | None) -> torch.Tensor:
    """The kernel of `spec` (an fp8 linear op: linear_fp8, linear_w8a8) on x and weight = (W8, s): checked,
    allocated, launched."""
    w8, scale = weight
    L.check_operands(x, bias, residual)
    M, K = x.shape
    N = w8.shape[0]
    check_weights(spec.name, x, w8, scale, N)
    L.require(residual is None or tuple(residual.shape) == (M, N),
              lambda: f"{spec.name}: residual {tuple(residual.shape) if residual is not None else ()} does not fit "
                      f"{(M, N)}")
    y = L.output(out, (M, N), x)
    if M == 0:
        return y
    kernel = L.kernel_for(spec, activation, K, x.dtype, config, bias is not None, residual is not None,
                           device=x.device)
    tensors = {"x": x, "w": w8, "s": scale.contiguous(), "b": None if bias is None else bias.contiguous(),
               "r": residual, "y": y}
    L.launch_gemm(kernel, (M, N, K), config, x.device, tensors, accumulators=1)
    return y


def check_weights(op: str, x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, N: int) -> None:
    """LaunchError (one line) unless w8 is [N, K] float8_e4m3fn and scale [N] float32, both on x's device."""
    L.require(w8.dtype == FP8 and scale.dtype == torch.float32 and w8.device == x.device == scale.device,
              lambda: f"{op}: weights must be float8_e4m3fn with float32 scales on {x.device}, got {w8.dtype} and "
              f"{scale.dtype}")
    L.require(w8.dim() == 2 and tuple(w8.shape) == (N, x.shape[1]) and tuple(scale.shape) == (N,),
              lambda: f"{op}: x {tuple(x.shape)}, weight {tuple(w8.shape)} and scale {tuple(scale.shape)} do not fit")


def _run(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    return linear_fp8(ops["x"], ops["w"], ops["s"], ops.get("b"), ops.get("r"), activation, config, out=out)


def _eager(ops: dict, activation: str) -> torch.Tensor:
    """What a PyTorch model holding fp8 weights runs: the weights dequantized to the activations' dtype, then the
    dense Linear's eager ops."""
    x = ops["x"]
    return eager_linear(x, dequantize_fp8(ops["w"], ops["s"], x.dtype), ops.get("b"), ops.get("r"), activation)


def _reference(ops: dict, activation: str, dtype: torch.dtype) -> torch.Tensor:
    """float64, from the dequantized weights: the function the kernel computes (its error against the original
    weights is the quantization's, reported apart)."""
    return linear_reference(ops["x"], dequantize_fp8(ops["w"], ops["s"], torch.float64), ops.get("b"), ops.get("r"),
                            activation)


def _original_reference(ops: dict, activation: str) -> torch.Tensor:
    """float64, from the weights before quantization (make_operands keeps them as "w_original")."""
    return linear_reference(ops["x"], ops["w_original"], ops.get("b"), ops.get("r"), activation)


def _make_operands(n: int, k: int, M: int, bias: bool, residual: bool, rand) -> dict:
    # nn.Linear-like scale, then quantized as get_linear(weights="fp8") quantizes; the original kept beside.
    original = rand(n, k) * k**-0.5
    w8, scale = quantize_weight(original)
    return {"x": rand(M, k), "w": w8, "s": scale, "b": rand(n) if bias else None,
            "r": rand(M, n) if residual else None, "w_original": original}


# The dense Linear's op with fp8 weights: the same template, activations, residual and search spaces; its keys'
# dimensions the sizes unpadded (FusedLinearFp8 holds its weights in padded storage of its own); its own
# operands (W8 and its scales s), launcher, checks and library path.
LINEAR_FP8 = dataclasses.replace(
    LINEAR,
    name="linear_fp8",
    doc="act(x (W s)^T + b) [+ residual] in one kernel, W in fp8 with a scale per output channel",
    dims=lambda s, M: (s.out_features, s.in_features, s.activation),  # FusedLinearFp8 runs the sizes as they are
    operands=OPERANDS,
    run=_run,
    weights="fp8",
    # The persistent TMA variant reads W through descriptors of the activations' type: not for fp8 weights.
    variants=("tile", "split_k"),
    library={"eager": _eager},
    reference=_reference,
    original_reference=_original_reference,
    make_operands=_make_operands,
)

def _make_down_operands(n: int, k: int, M: int, bias: bool, residual: bool, rand) -> dict:
    """_make_operands with x laid out as the MLP holds H: rows 16 elements apart (dispatch.new_hidden)."""
    operands = _make_operands(n, k, M, bias, residual, rand)
    operands["x"] = aligned_rows(operands["x"])
    return operands


# What makes a gated MLP's down projection of an fp8 linear op: no activation, no residual, keyed for the shapes
# file's MLPs at the sizes FusedMLPFp8 runs (d_ff unpadded), timed on H as the MLP lays it out.
DOWN_FIELDS = dict(activations=("none",), residual=False, serves="mlp", dims=lambda s, M: (s.d_model, s.d_ff, "none"),
                   make_operands=_make_down_operands)

DOWN_FP8 = dataclasses.replace(
    LINEAR_FP8,
    name="down_fp8",
    doc="a gated MLP's down projection with fp8 weights: the fp8 linear kernel without activation",
    **DOWN_FIELDS,
)


def check_fp8_device(device: torch.device) -> None:
    """AutofuseError where `device` cannot run float8_e4m3fn kernels: a CUDA GPU below compute capability 8.9
    (Triton has no e4m3 type there). The CPU runs them under Triton's interpreter."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(index)
    if capability < (8, 9):
        raise AutofuseError(f"fp8 weights need a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                            f"{torch.cuda.get_device_name(index)} is {capability[0]}.{capability[1]}")

