"""The pointwise pass H = act(G) * U after cuBLAS wrote the pre-activations, in their two layouts:
op `gated_act` (templates/gated_act.py.jinja) reads G and U as two [M, F] operands (two buffers: the training
forward, which keeps them for the backward; or the halves of one: gated_up's library path cublas_gated_act); op
`pairs_act` (templates/pairs_act.py.jinja) reads G and U interleaved column by column (ONE GEMM over an
interleaved module's weight buffer: gated_pairs's library path cublas_pairs). A pass over memory: one
fixed tile shape serves every size, so nothing is tuned."""

from __future__ import annotations

import torch

from .. import launch as L
from ..activations import GATED_ACTIVATIONS, TORCH_ACTIVATIONS
from ..configs import KernelConfig
from ..opspec import POINTWISE, Operand, OpSpec

OPERANDS = (
    Operand("g", "[M, N]: the gate pre-activations G", "mn"),
    Operand("u", "[M, N]: the up pre-activations U", "mn"),
    Operand("h", "[M, N]", "mn"),
)
PAIRS_OPERANDS = (
    Operand("gu", "[M, 2 N]: G_j in column 2j, U_j in 2j + 1", "mn"),
    Operand("h", "[M, N]", "mn"),
)


def gated_activation(g: torch.Tensor, u: torch.Tensor, activation: str,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """H = act(G) * U from g and u ([M, F] each, any strides: two buffers or the halves of one [M, 2F]);
    written into `out` ([M, F]) when given."""
    L.require(g.dim() == 2 and g.shape == u.shape and g.dtype == u.dtype and g.device == u.device,
              lambda: f"gated_act: g and u must be [M, F] alike, got {tuple(g.shape)} {g.dtype} and {tuple(u.shape)} "
                      f"{u.dtype}")
    M, F = g.shape
    h = L.output(out, (M, F), g)
    if M and F:
        L.pointwise_launch(GATED_ACT, activation, g.dtype, M, F, {"g": g, "u": u, "h": h})
    return h


def _run(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    return gated_activation(ops["g"], ops["u"], activation, out=out)


def _eager(ops: dict, activation: str) -> torch.Tensor:
    return TORCH_ACTIVATIONS[activation](ops["g"]) * ops["u"]


GATED_ACT = OpSpec(
    name="gated_act",
    template="gated_act",
    doc="the training forward's pointwise act(G) * U (nothing to tune)",
    operands=OPERANDS,
    activations=GATED_ACTIVATIONS,
    run=_run,
    **POINTWISE,
    library={"eager": _eager},
)


def pairs_activation(gu: torch.Tensor, activation: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """H = act(G) * U from gu with G_j in column 2j and U_j in 2j + 1 ([M, 2F]); written into `out`
    ([M, F]) when given."""
    L.require(gu.dim() == 2 and gu.shape[1] % 2 == 0, lambda: f"pairs_act: gu must be [M, 2F], got {tuple(gu.shape)}")
    M, F = gu.shape[0], gu.shape[1] // 2
    h = L.output(out, (M, F), gu)
    if M and F:
        L.pointwise_launch(PAIRS_ACT, activation, gu.dtype, M, F, {"gu": gu, "h": h})
    return h


def _pairs_run(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    return pairs_activation(ops["gu"], activation, out=out)


def _pairs_eager(ops: dict, activation: str) -> torch.Tensor:
    return TORCH_ACTIVATIONS[activation](ops["gu"][:, 0::2]) * ops["gu"][:, 1::2]


PAIRS_ACT = OpSpec(
    name="pairs_act",
    template="pairs_act",
    doc="act(G) * U from interleaved pre-activations (gated_pairs's library path; nothing to tune)",
    operands=PAIRS_OPERANDS,
    activations=GATED_ACTIVATIONS,
    run=_pairs_run,
    **POINTWISE,
    library={"eager": _pairs_eager},
)
