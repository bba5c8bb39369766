"""The gated MLP's backward kernel, op `gated_bwd` (templates/gated_bwd*.py.jinja): dH = dY Wd as a
GEMM over d_model whose epilogue reads the forward's saved G, U and writes dG | dU over them and H,
so dH never reaches memory. Keyed with n = d_ff, k = d_model. Used by training.py."""

from __future__ import annotations

import torch

from .. import launch as L
from ..activations import GATED_ACTIVATIONS
from ..configs import INTERPRETER_SPACE, KernelConfig, SearchSpace
from ..layout import row_width
from ..opspec import Operand, OpSpec
from .gated_grad import gated_from_dh, gated_gradient

EPILOGUE = ("BLOCK_M", "EPILOGUE_N")
OPERANDS = (
    Operand("dy", "[M, K], the gradient of the MLP's output (K = d_model)", "mk", tma_block=("BLOCK_M", "BLOCK_K")),
    Operand("wd", "[K, N], the down projection's weight (N = d_ff)", "kn", tma_block=("BLOCK_K", "BLOCK_N")),
    Operand("gu", "[M, 2 N]: the forward's G in columns [0, N), U in [N, 2 N)", "mn", when="!tma"),
    Operand("dgu", "[M, 2 N]: dG in columns [0, N), dU in [N, 2 N); may be gu_ptr", "mn", when="!tma"),
    # The TMA variant reads and writes the halves through descriptors of [M, N] views.
    Operand("g", "G [M, N]", when="tma", tma_block=EPILOGUE),
    Operand("u", "U [M, N]", when="tma", tma_block=EPILOGUE),
    Operand("dg", "dG [M, N] (may be G itself)", when="tma", tma_block=EPILOGUE),
    Operand("du", "dU [M, N] (may be U itself)", when="tma", tma_block=EPILOGUE),
    Operand("h", "H [M, N]", "mn", tma_block=EPILOGUE),
)


def gated_backward(dy: torch.Tensor, gu: torch.Tensor, w_down: torch.Tensor, activation: str, config: KernelConfig,
                   out: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For Y = (act(G) * U) @ w_down.T [+ b], the forward's gu = [G | U] ([M, 2F]) and dY ([M, D]):
    returns dGU = [dG | dU] ([M, 2F], the gradients of the gate and up pre-activations) and H ([M, F]),
    written into `out` = (dGU, H) when given; dGU may be gu itself (the kernel then overwrites the
    saved pre-activations with their gradients). w_down: [D, F]."""
    L.check_operands(dy, gu, w_down)
    M, D = dy.shape
    F = w_down.shape[1]
    L.require(tuple(gu.shape) == (M, 2 * F) and tuple(w_down.shape) == (D, F),
              "gated_backward: gu must be [M, 2F] and w_down [D, F]")
    L.require(not GATED_BWD.refuse_config(config), lambda: f"gated_backward: {GATED_BWD.refuse_config(config)}")
    dgu_out, h_out = out if out is not None else (None, None)
    dgu, h = L.output(dgu_out, (M, 2 * F), dy), L.output(h_out, (M, F), dy)
    if M == 0:
        return dgu, h
    halves = {"g": gu[:, :F], "u": gu[:, F:], "dg": dgu[:, :F], "du": dgu[:, F:]}
    config = L.runnable(config, dy, w_down, *halves.values(), h)
    kernel = L.kernel_for(GATED_BWD, activation, D, dy.dtype, config, False)
    # The TMA kernel's epilogue works in pieces at most 64 columns wide: two 64-wide halves of a 128-wide
    # tile beat the whole, which spills registers.
    L.launch_gemm(kernel, (M, F, D), config, dy.device, {"dy": dy, "wd": w_down, "gu": gu, "dgu": dgu, **halves,
                                                         "h": h}, accumulators=0, EPILOGUE_N=min(config.block_n, 64))
    return dgu, h


def gated_backward_eager(dy: torch.Tensor, gu: torch.Tensor, w_down: torch.Tensor,
                         activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dGU, H) as PyTorch computes them from the saved [G | U]: the kernel's library path and, in
    float64, its reference."""
    F = w_down.shape[1]
    dg, du, h = gated_from_dh(dy @ w_down, gu[:, :F], gu[:, F:], activation)
    return torch.cat([dg, du], dim=1), h


def gated_backward_cublas(dy: torch.Tensor, gu: torch.Tensor, w_down: torch.Tensor, activation: str,
                          out: tuple[torch.Tensor | None, torch.Tensor | None] | None = None):
    """(dGU, H) as cuBLAS dH = dY Wd, then ONE pointwise pass (op gated_grad); dGU may be gu itself, as
    for the fused kernel. Where no H buffer is given, H is written over dH (each element is read before
    the same program writes it), so the step holds one [M, F] buffer here, as the fused kernel does, not two."""
    dh = dy @ w_down
    F = dh.shape[1]
    dgu_out, h_out = out if out is not None else (None, None)
    dgu = L.output(dgu_out, (dh.shape[0], 2 * F), dh)
    _, _, h = gated_gradient(dh, gu[:, :F], gu[:, F:], activation,
                             out=(dgu[:, :F], dgu[:, F:], dh if h_out is None else h_out))
    return dgu, h


# The library candidates, by the name a record stores: the training backward runs the chosen one.
LIBRARY_BACKWARDS = {
    "eager": lambda dy, gu, w_down, activation, out=None: gated_backward_eager(dy, gu, w_down, activation),
    "cublas_gated_grad": gated_backward_cublas,
}


def _run(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """One [M, 3F] result, dG | dU | H, so that the tuner checks all three at once."""
    dy, n = ops["dy"], ops["wd"].shape[1]
    out = L.allocate((dy.shape[0], 3 * n), dy) if out is None else out
    gated_backward(dy, ops["gu"], ops["wd"], activation, config, out=(out[:, :2 * n], out[:, 2 * n:]))
    return out


def _library(name: str):
    def run(ops: dict, activation: str) -> torch.Tensor:
        """dG | dU | H in one [M, 3F] result like _run's, each path writing into its slices where it can: a
        concatenation afterwards would add a copy of 3 M F elements that the training step never makes, and
        the tuner would time the library path slower than it runs there."""
        dy, n = ops["dy"], ops["wd"].shape[1]
        out = L.allocate((dy.shape[0], 3 * n), dy)
        slices = (out[:, :2 * n], out[:, 2 * n:])
        for got, into in zip(LIBRARY_BACKWARDS[name](dy, ops["gu"], ops["wd"], activation, out=slices), slices):
            if got.data_ptr() != into.data_ptr():  # a path that allocates its own results (eager)
                into.copy_(got)
        return out
    return run


def _reference(ops: dict, activation: str, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(gated_backward_eager(ops["dy"].double(), ops["gu"].double(), ops["wd"].double(), activation),
                     dim=1)


def _make_operands(n: int, k: int, M: int, bias: bool, residual: bool, rand) -> dict:
    # dY stands for the activations (drawn fresh per check); the saved [G | U] already hold the biases.
    return {"dy": rand(M, k), "gu": rand(M, 2 * n), "wd": rand(k, n) * n**-0.5}


GATED_BWD = OpSpec(
    name="gated_bwd",
    template="gated_bwd",
    doc="the gated MLP's backward: dH = dY Wd with dG, dU and H formed in the epilogue",
    operands=OPERANDS,
    activations=GATED_ACTIVATIONS,
    run=_run,
    variants=("tile", "tma"),
    variant_constexprs={"tma": ("EPILOGUE_N",)},
    narrow_n=True,  # the epilogue loads G and U tiles
    space=SearchSpace(),
    interpreter_space=INTERPRETER_SPACE,
    library={name: _library(name) for name in LIBRARY_BACKWARDS},
    reference=_reference,
    make_operands=_make_operands,
    output_width=lambda n, k: 3 * n,
    serves="mlp",
    dims=lambda s, M: (row_width(s.d_ff), row_width(s.d_model), s.activation),  # a training step's (training.Padding)
    training=True,
)
