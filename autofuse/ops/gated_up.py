"""The gated up-projection: H = act(X @ Wg^T + bg) * (X @ Wu^T + bu) in one kernel
(templates/gated_up*.py.jinja): gate and up projections share each X tile, and the gated product
is the epilogue, so G and U never reach memory."""

from __future__ import annotations

import torch

from .. import launch as L
from ..activations import GATED_ACTIVATIONS
from ..configs import KernelConfig
from ..layout import input_width, line_rows, run_width
from ..opspec import GEMM_VARIANTS, Operand, OpSpec
from ..reference import eager_gated, gated_reference
from .gated_act import gated_activation

OPERANDS = (
    Operand("x", "[M, K]", "mk", tma_block=("BLOCK_M", "BLOCK_K")),
    Operand("wg", "[N, K], gate projection weight", "nk", tma_block=("BLOCK_N", "BLOCK_K")),
    Operand("wu", "[N, K], up projection weight", "nk", tma_block=("BLOCK_N", "BLOCK_K")),
    Operand("bg", "[N]", when="has_bias"),
    Operand("bu", "[N]", when="has_bias"),
    Operand("h", "[M, N]", "mn"),
)


def gated_up(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, b_gate: torch.Tensor | None,
             b_up: torch.Tensor | None, activation: str, config: KernelConfig,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """H = act(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up), x: [M, K], w_*: [N, K].
    Written into `out` ([M, N], x's dtype) when given."""
    L.check_operands(x, w_gate, w_up, b_gate, b_up)
    M, K = x.shape
    N = w_gate.shape[0]
    L.require(tuple(w_gate.shape) == tuple(w_up.shape) == (N, K), "gated_up: gate and up weights must be [N, K]")
    L.require((b_gate is None) == (b_up is None), "gated_up: gate and up biases come together")
    h = L.output(out, (M, N), x)
    if M == 0:
        return h
    config = L.runnable(config, x, w_gate, w_up)
    kernel = L.kernel_for(GATED_UP, activation, K, x.dtype, config, b_gate is not None, device=x.device)
    tensors = {"x": x, "wg": w_gate, "wu": w_up, "h": h}
    if b_gate is not None:
        tensors.update(bg=b_gate.contiguous(), bu=b_up.contiguous())
    L.launch_gemm(kernel, (M, N, K), config, x.device, tensors, accumulators=2)
    return h


def stacked(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """[gate; up] as one dense tensor of twice gate's rows, where the two are the halves of one buffer
    (up right after gate, both dense: the training layout, FusedMLP._lay_out_plain); else None."""
    if (gate.shape != up.shape or gate.dtype != up.dtype or not gate.is_contiguous() or not up.is_contiguous()
            or gate.device != up.device or gate.untyped_storage().data_ptr() != up.untyped_storage().data_ptr()
            or up.storage_offset() != gate.storage_offset() + gate.numel()):
        return None
    return gate.as_strided((2 * gate.shape[0], *gate.shape[1:]), (gate.stride(0), *gate.stride()[1:]))


def project_into(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """out = x w^T (+ b) by cuBLAS, written into `out` ([M, N], rows of any stride)."""
    if b is None:
        return torch.mm(x, w.t(), out=out)
    return torch.addmm(b, x, w.t(), out=out)


def pre_activations(x: torch.Tensor, w_gate: torch.Tensor, b_gate: torch.Tensor | None, w_up: torch.Tensor,
                    b_up: torch.Tensor | None, w_gu: torch.Tensor | None) -> torch.Tensor:
    """[G | U] = [x w_gate^T + b_gate | x w_up^T + b_up] ([M, 2F]): one cuBLAS GEMM where the weights (and
    biases) are the halves of one buffer (w_gu, the caller's stacked(w_gate, w_up)), else (w_gu None) two writing
    the halves of one result (no concatenated weight copy)."""
    F_ = w_gate.shape[0]
    if w_gu is not None:
        if b_gate is None and b_up is None:
            return torch.mm(x, w_gu.t())
        b_gu = None if b_gate is None or b_up is None else stacked(b_gate, b_up)
        if b_gu is not None:
            return torch.addmm(b_gu, x, w_gu.t())
    gu = torch.empty(x.shape[0], 2 * F_, dtype=x.dtype, device=x.device)
    project_into(gu[:, :F_], x, w_gate, b_gate)
    project_into(gu[:, F_:], x, w_up, b_up)
    return gu


def _run(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    return gated_up(ops["x"], ops["wg"], ops["wu"], ops.get("bg"), ops.get("bu"), activation, config, out=out)


def _eager(ops: dict, activation: str) -> torch.Tensor:
    return eager_gated(ops["x"], ops["wg"], ops["wu"], ops.get("bg"), ops.get("bu"), activation)


def _cublas_gated_act(ops: dict, activation: str) -> torch.Tensor:
    """cuBLAS for G and U into one [M, 2N] buffer, then ONE pointwise pass act(G) * U (op gated_act):
    what torch.compile generates for a gated MLP, and the training forward's own first half."""
    gu = pre_activations(ops["x"], ops["wg"], ops.get("bg"), ops["wu"], ops.get("bu"), stacked(ops["wg"], ops["wu"]))
    F_ = ops["wg"].shape[0]
    return gated_activation(gu[:, :F_], gu[:, F_:], activation)


def _reference(ops: dict, activation: str, dtype: torch.dtype) -> torch.Tensor:
    return gated_reference(ops["x"], ops["wg"], ops["wu"], ops.get("bg"), ops.get("bu"), activation)


def _make_operands(n: int, k: int, M: int, bias: bool, residual: bool, rand) -> dict:
    # The weights' rows whole lines apart, as FusedMLP holds them (layout.mlp_strides).
    return {"x": rand(M, k), "wg": line_rows(rand(n, k) * k**-0.5), "wu": line_rows(rand(n, k) * k**-0.5),
            "bg": rand(n) if bias else None, "bu": rand(n) if bias else None}


GATED_UP = OpSpec(
    name="gated_up",
    template="gated_up",
    doc="a gated MLP's act(x Wg^T + bg) * (x Wu^T + bu) in one kernel",
    operands=OPERANDS,
    activations=GATED_ACTIVATIONS,
    run=_run,
    **GEMM_VARIANTS,
    operand_tiles=(1, 2),
    narrow_n=True,
    split_k_fill=False,
    gemv_first=True,
    library={"eager": _eager, "cublas_gated_act": _cublas_gated_act},
    reference=_reference,
    make_operands=_make_operands,
    output_width=lambda n, k: n,
    serves="mlp",
    dims=lambda s, M: (run_width(s.d_ff), input_width(s.d_model), s.activation),  # what FusedMLP runs (layout.py)
)
