"""The gated up-projection with fp8 weights (weight-only): H = act(X @ (Wg sg)^T + bg) * (X @ (Wu su)^T + bu), Wg and
Wu stored as float8_e4m3fn with a float32 scale per output channel (ops/linear_fp8.py says how they are quantized),
on the gated_up templates with `fp8_weights`: the weight tiles loaded in fp8 and widened to X's type for the dots,
the scales applied in the epilogue. Keyed apart from the dense op and checked against the float64 product of the
dequantized weights; the dense library paths never stand in for it."""

from __future__ import annotations

import dataclasses

import torch

from .. import launch as L
from ..configs import KernelConfig
from ..layout import stack_padded, stacked_padded
from ..opspec import Operand
from ..reference import eager_gated, gated_reference
from .gated_act import gated_activation
from .gated_up import GATED_UP
from .linear_fp8 import check_weights, dequantize_fp8, quantize_fp8
from .linear_w8a8 import dequantized_rows, scaled_mm_quantized, scaled_mm_width, unit_scaled_mm
from .quantize_rows import launch_quantize_rows
from .scaled_act import scaled_gated_activation

OPERANDS = (
    Operand("x", "[M, K]", "mk"),
    Operand("wg", "[N, K] float8_e4m3fn, gate projection weight", "nk"),
    Operand("wu", "[N, K] float8_e4m3fn, up projection weight", "nk"),
    Operand("sg", "[N] float32, the scale of each row of wg"),
    Operand("su", "[N] float32, the scale of each row of wu"),
    Operand("bg", "[N]", when="has_bias"),
    Operand("bu", "[N]", when="has_bias"),
    Operand("h", "[M, N]", "mn"),
)


def gated_up_fp8(x: torch.Tensor, w_gate: tuple[torch.Tensor, torch.Tensor], w_up: tuple[torch.Tensor, torch.Tensor],
                 b_gate: torch.Tensor | None, b_up: torch.Tensor | None, activation: str, config: KernelConfig,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """H = act(x @ (wg8 sg)^T + b_gate) * (x @ (wu8 su)^T + b_up); w_gate = (wg8, sg), w_up = (wu8, su): [N, K]
    float8_e4m3fn weights and their [N] float32 scales. Written into `out` ([M, N], x's dtype) when given."""
    return _launch(GATED_UP_FP8, x, (w_gate, w_up), (b_gate, b_up), activation, config, out)


def gated_up_w8a8(x: torch.Tensor, w_gate: tuple[torch.Tensor, torch.Tensor], w_up: tuple[torch.Tensor, torch.Tensor],
                  b_gate: torch.Tensor | None, b_up: torch.Tensor | None, activation: str, config: KernelConfig,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """gated_up_fp8 with x quantized per row inside the kernel (linear_w8a8.quantize_rows) for fp8 x fp8 dots."""
    return _launch(GATED_UP_W8A8, x, (w_gate, w_up), (b_gate, b_up), activation, config, out)


def _launch(spec, x: torch.Tensor, weights: tuple, biases: tuple, activation: str, config: KernelConfig,
            out: torch.Tensor | None) -> torch.Tensor:
    (b_gate, b_up), ((wg, sg), (wu, su)) = biases, weights
    L.check_operands(x, b_gate, b_up)
    M, K = x.shape
    N = wg.shape[0]
    for w, s in weights:
        check_weights(spec.name, x, w, s, N)
    L.require((b_gate is None) == (b_up is None), lambda: f"{spec.name}: gate and up biases come together")
    h = L.output(out, (M, N), x)
    if M == 0:
        return h
    kernel = L.kernel_for(spec, activation, K, x.dtype, config, b_gate is not None, device=x.device)
    tensors = {"x": x, "wg": wg, "wu": wu, "sg": sg.contiguous(), "su": su.contiguous(), "h": h}
    if b_gate is not None:
        tensors.update(bg=b_gate.contiguous(), bu=b_up.contiguous())
    L.launch_gemm(kernel, (M, N, K), config, x.device, tensors, accumulators=2)
    return h


def _run(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    return gated_up_fp8(ops["x"], (ops["wg"], ops["sg"]), (ops["wu"], ops["su"]), ops.get("bg"), ops.get("bu"),
                        activation, config, out=out)


def _eager(ops: dict, activation: str) -> torch.Tensor:
    """The weights dequantized to the activations' dtype, then the dense op's eager ops."""
    x = ops["x"]
    wg, wu = (dequantize_fp8(ops[w], ops[s], x.dtype) for w, s in (("wg", "sg"), ("wu", "su")))
    return eager_gated(x, wg, wu, ops.get("bg"), ops.get("bu"), activation)


def _reference(ops: dict, activation: str, dtype: torch.dtype) -> torch.Tensor:
    wg, wu = (dequantize_fp8(ops[w], ops[s], torch.float64) for w, s in (("wg", "sg"), ("wu", "su")))
    return gated_reference(ops["x"], wg, wu, ops.get("bg"), ops.get("bu"), activation)


def _original_reference(ops: dict, activation: str) -> torch.Tensor:
    """float64, from the weights before quantization (make_operands keeps them as "wg_original", "wu_original")."""
    return gated_reference(ops["x"], ops["wg_original"], ops["wu_original"], ops.get("bg"), ops.get("bu"), activation)


def _make_operands(n: int, k: int, M: int, bias: bool, residual: bool, rand) -> dict:
    """The weights held as FusedMLPFp8 holds them: the halves of one padded storage (layout.stack_padded)."""
    wg_original, wu_original = rand(n, k) * k**-0.5, rand(n, k) * k**-0.5
    (wg, sg), (wu, su) = quantize_fp8(wg_original), quantize_fp8(wu_original)
    wg, wu = stack_padded(wg, wu)
    return {"x": rand(M, k), "wg": wg, "wu": wu, "sg": sg, "su": su, "bg": rand(n) if bias else None,
            "bu": rand(n) if bias else None, "wg_original": wg_original, "wu_original": wu_original}


# The dense gated up-projection's op with fp8 weights: the same template, activations, search spaces and tile
# estimates; its own operands (Wg8, Wu8 and their scales), launcher, checks, library path and keys' dimensions.
GATED_UP_FP8 = dataclasses.replace(
    GATED_UP,
    name="gated_up_fp8",
    doc="a gated MLP's act(x (Wg sg)^T + bg) * (x (Wu su)^T + bu) in one kernel, Wg and Wu in fp8",
    operands=OPERANDS,
    run=_run,
    weights="fp8",
    variants=("tile", "split_k"),  # and gemv (variants.GEMV names it); no TMA descriptors of fp8
    library={"eager": _eager},
    reference=_reference,
    original_reference=_original_reference,
    make_operands=_make_operands,
    dims=lambda s, M: (s.d_ff, s.d_model, s.activation),  # FusedMLPFp8 runs the sizes as they are (no padding)
)


# W8A8: the activations quantized per row inside the kernel, as linear_w8a8 quantizes them.

def _run_w8a8(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    return gated_up_w8a8(ops["x"], (ops["wg"], ops["sg"]), (ops["wu"], ops["su"]), ops.get("bg"), ops.get("bu"),
                         activation, config, out=out)


def _eager_w8a8(ops: dict, activation: str) -> torch.Tensor:
    """The same quantized values in PyTorch's ops: x and the weights dequantized to x's dtype, then eager's."""
    x = ops["x"]
    return _eager({**ops, "x": dequantized_rows(x, x.dtype)}, activation)


def _scaled_mm_w8a8(ops: dict, activation: str) -> torch.Tensor:
    """torch._scaled_mm for G and U (fp8 tensor cores, rowwise scales), then one pointwise pass act(G) * U (op
    gated_act); off CUDA, the same values through eager's ops. ValueError where the sizes are not multiples of
    16 (linear_w8a8.scaled_mm)."""
    x = ops["x"]
    if not x.is_cuda:
        return _eager_w8a8(ops, activation)
    x8, sx = launch_quantize_rows(x, scaled_mm_width(ops["wg"]))  # once, for both products
    gate, up = (scaled_mm_quantized(x8, sx, ops[w], ops[s], x.dtype) for w, s in (("wg", "sg"), ("wu", "su")))
    if ops.get("bg") is not None:
        gate, up = gate + ops["bg"], up + ops["bu"]
    return gated_activation(gate, up, activation)


def _scaled_mm_unit_w8a8(ops: dict, activation: str, stacked: bool = False) -> torch.Tensor:
    """torch._scaled_mm with unit scales for G and U (unit_products), then one pass applying the rows' and the
    weights' scales, the biases and act(G) * U (op scaled_gated_act); off CUDA, the same values through eager's
    ops."""
    x = ops["x"]
    if not x.is_cuda:
        return _eager_w8a8(ops, activation)
    gate, up, scales, biases = unit_products(ops, stacked)
    return scaled_gated_activation(gate, up, scales, biases, activation, x.dtype)


def _scaled_mm_unit_stacked_w8a8(ops: dict, activation: str) -> torch.Tensor:
    """_scaled_mm_unit_w8a8 with G and U from one torch._scaled_mm over the stacked weights, where the gate and up
    weights are the halves of one padded storage (layout.stacked_padded, as FusedMLPFp8 holds them); else from two.
    One GEMM twice as wide: 711.9 against 800.4 us at 1024 x 6480 by 2 x 27648, 208.2 against 219.2 at 1024 x 3456
    by 2 x 17344, but 338.0 against 314.4 at 16384 x 2176 by 2 x 2560 (H100): a candidate beside the two, raced."""
    return _scaled_mm_unit_w8a8(ops, activation, stacked=True)


def unit_products(ops: dict, stacked: bool) -> tuple:
    """(G, U, (sx, sg, su), (bg, bu) or None): x quantized per row once for both products, G and U its unscaled
    products with the gate and up weights (linear_w8a8.unit_scaled_mm): by one GEMM over their joint storage where
    `stacked` and they are so held (layout.stacked_padded), G and U then views of its output; else by two."""
    x = ops["x"]
    x8, sx = launch_quantize_rows(x, scaled_mm_width(ops["wg"]))
    joint = stacked_padded(ops["wg"], ops["wu"]) if stacked else None
    if joint is None:
        gate, up = (unit_scaled_mm(x8, ops[w], x.dtype) for w in ("wg", "wu"))
    else:
        both = unit_scaled_mm(x8, joint, x.dtype)
        F, rows = ops["wg"].shape[0], joint.shape[0] // 2
        gate, up = both[:, :F], both[:, rows:rows + F]
    return gate, up, (sx, ops["sg"], ops["su"]), None if ops.get("bg") is None else (ops["bg"], ops["bu"])


def _reference_w8a8(ops: dict, activation: str, dtype: torch.dtype) -> torch.Tensor:
    """float64, from the quantized activations and weights: the function the kernel computes."""
    return _reference({**ops, "x": dequantized_rows(ops["x"], torch.float64)}, activation, dtype)


GATED_UP_W8A8 = dataclasses.replace(
    GATED_UP_FP8,
    name="gated_up_w8a8",
    doc="a gated MLP's gated up-projection with x quantized to fp8 per row inside it and Wg, Wu in fp8",
    run=_run_w8a8,
    weights="w8a8",
    library={"eager": _eager_w8a8, "scaled_mm": _scaled_mm_w8a8, "scaled_mm_unit": _scaled_mm_unit_w8a8,
             "scaled_mm_unit_stacked": _scaled_mm_unit_stacked_w8a8},
    reference=_reference_w8a8,
)
