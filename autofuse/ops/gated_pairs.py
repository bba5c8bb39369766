"""The gated up-projection as ONE GEMM, op `gated_pairs` (templates/gated_pairs*.py.jinja): the
gate and up weights interleaved row by row, W = [wg_0; wu_0; wg_1; wu_1; ...] ([2F, K]), so that every
accumulator tile holds the gate and up columns of the same hidden units side by side. The mainloop is
then a plain GEMM — one weight tile and one accumulator per K step, where op gated_up keeps two — and the
epilogue splits the pairs and writes H = act(G) * U ([M, F]). Keyed with n = F (H's width), k = d_model.

The interleaved weight is what an interleaved module keeps its two parameters in (each a strided view
of it, one copy of the weights; layout.py, get_mlp's default): `interleave` builds one,
`gate_and_up` gives the two views, `pairs_of` the buffer behind them. Such a module (the default) checks
or tunes this op beside gated_up and runs the faster (dispatch.mlp_choices)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .. import launch as L
from ..activations import GATED_ACTIVATIONS
from ..configs import Device, KernelConfig, Shape, gemm_heuristic
from ..layout import input_width, line_rows, run_width
from ..opspec import GEMM_VARIANTS, Operand, OpSpec
from ..reference import eager_gated, gated_reference
from .gated_act import pairs_activation

OPERANDS = (
    Operand("x", "[M, K]", "mk", tma_block=("BLOCK_M", "BLOCK_K")),
    Operand("w", "[N, K]: gate and up rows interleaved (N = 2 d_ff)", "nk", tma_block=("BLOCK_N", "BLOCK_K")),
    Operand("b", "[N]: gate and up biases interleaved", when="has_bias"),
    Operand("h", "[M, N / 2]", "mn", tma_block=("BLOCK_M", "BLOCK_H")),
)


def interleave(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """[a_0; b_0; a_1; b_1; ...]: two [F, ...] tensors interleaved along their first axis ([2F, ...])."""
    return torch.stack((first, second), dim=1).reshape(2 * first.shape[0], *first.shape[1:])


def gate_and_up(pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up views of an interleaved tensor (rows 0, 2, 4, ... and 1, 3, 5, ...)."""
    return pairs[0::2], pairs[1::2]


def pairs_of(w_gate: torch.Tensor, b_gate: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The interleaved weight [2F, K] (and bias [2F]) behind the gate views of an interleaved layout
    (layout.lay_out(interleaved=True): w_gate [F, K] with row stride 2S at the buffer's start, the buffer's rows S
    >= K elements apart)."""
    F_, K = w_gate.shape
    rows = w_gate.stride(0) // 2
    L.require(w_gate.stride() == (2 * rows, 1) and rows >= K and w_gate.storage_offset() == 0,
              "pairs_of: the gate weight is not the first view of an interleaved buffer")
    return (w_gate.as_strided((2 * F_, K), (rows, 1), 0),
            None if b_gate is None else b_gate.as_strided((2 * F_,), (1,), 0))


def gated_pairs(x: torch.Tensor, w_pairs: torch.Tensor, b_pairs: torch.Tensor | None, activation: str,
                config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """H = act(x @ wg.T + bg) * (x @ wu.T + bu) for w_pairs = interleave(wg, wu) ([2F, K]) and b_pairs =
    interleave(bg, bu); x: [M, K]. Written into `out` ([M, F], x's dtype) when given."""
    L.check_operands(x, w_pairs, b_pairs)
    M, K = x.shape
    N = w_pairs.shape[0]
    L.require(w_pairs.shape[1] == K and N % 2 == 0 and (b_pairs is None or tuple(b_pairs.shape) == (N,)),
              lambda: f"gated_pairs: x {tuple(x.shape)} and the interleaved weight {tuple(w_pairs.shape)} / bias do "
                      "not fit")
    h = L.output(out, (M, N // 2), x)
    if M == 0:
        return h
    config = L.runnable(config, x, w_pairs, h)
    kernel = L.kernel_for(GATED_PAIRS, activation, K, x.dtype, config, b_pairs is not None, device=x.device)
    tensors = {"x": x, "w": w_pairs, "b": None if b_pairs is None else b_pairs.contiguous(), "h": h}
    L.launch_gemm(kernel, (M, N, K), config, x.device, tensors, accumulators=1, BLOCK_H=config.block_n // 2)
    return h


def _run(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    return gated_pairs(ops["x"], ops["w"], ops.get("b"), activation, config, out=out)


def _views(ops: dict) -> tuple:
    wg, wu = gate_and_up(ops["w"])
    b = ops.get("b")
    bg, bu = (None, None) if b is None else gate_and_up(b)
    return wg, wu, bg, bu


def _eager(ops: dict, activation: str) -> torch.Tensor:
    return eager_gated(ops["x"], *_views(ops), activation)


def _cublas_pairs(ops: dict, activation: str) -> torch.Tensor:
    """One cuBLAS GEMM over the interleaved weight, then ONE pointwise pass act(G) * U over its column
    pairs (op pairs_act). At decode-to-mid M the one GEMM over [2F, K] runs faster than two over [F, K],
    and one pass reading contiguous pairs replaces PyTorch's two passes
    over strided halves."""
    return pairs_activation(F.linear(ops["x"], ops["w"], ops.get("b")), activation)


def _reference(ops: dict, activation: str, dtype: torch.dtype) -> torch.Tensor:
    return gated_reference(ops["x"], *_views(ops), activation)


def _make_operands(n: int, k: int, M: int, bias: bool, residual: bool, rand) -> dict:
    # nn.Linear-like scale: G and U of order one; the rows whole lines apart, as FusedMLP holds them.
    return {"x": rand(M, k), "w": line_rows(rand(2 * n, k) * k**-0.5), "b": rand(2 * n) if bias else None}


def _heuristic(shape: Shape, device: Device, kinds: frozenset[str]) -> KernelConfig:
    # The GEMM is 2N wide and keeps one accumulator: the plain GEMM's default over that width, K never split to fill
    # the SMs (OpSpec.split_k_fill).
    return gemm_heuristic(dataclasses.replace(shape, N=2 * shape.N), device, kinds, operand_tiles=(1, 1),
                          narrow_n=False, split_k_fill=GATED_PAIRS.split_k_fill)


GATED_PAIRS = OpSpec(
    name="gated_pairs",
    template="gated_pairs",
    doc="the gated up-projection as one GEMM over interleaved gate/up weights, act(G) * U in the epilogue",
    operands=OPERANDS,
    activations=GATED_ACTIVATIONS,
    run=_run,
    variant_constexprs={"tma": ("BLOCK_H",)},
    heuristic=_heuristic,
    split_k_fill=False,
    **GEMM_VARIANTS,
    library={"eager": _eager, "cublas_pairs": _cublas_pairs},
    reference=_reference,
    make_operands=_make_operands,
    output_width=lambda n, k: n,
    serves="mlp",
    # What an interleaved FusedMLP runs (layout.py).
    dims=lambda s, M: (run_width(s.d_ff), input_width(s.d_model), s.activation),
)
