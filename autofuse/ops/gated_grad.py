"""The gated MLP backward's pointwise pass, op `gated_grad` (templates/gated_grad.py.jinja): from dH, which
cuBLAS computed as dY Wd, and the forward's saved [G | U], dG | dU and H in one pass over memory — the
library path `cublas_gated_grad` of op gated_bwd, what Inductor would generate beside a cuBLAS GEMM.
One fixed tile shape serves every size, so nothing is tuned.

Op `gated_dgu` is the same pass without H, for a training forward that kept H (training.py): it moves five
[M, F] tensors' worth of memory instead of six."""

from __future__ import annotations

import torch

from .. import launch as L
from ..activations import GATED_ACTIVATIONS, TORCH_ACTIVATIONS, activation_backward
from ..configs import KernelConfig
from ..opspec import POINTWISE, Operand, OpSpec

DGU_OPERANDS = (
    Operand("dh", "[M, N]: dH = dY Wd", "mn"),
    Operand("gu", "[M, 2 N]: the forward's G in columns [0, N), U in [N, 2 N)", "mn"),
    Operand("dgu", "[M, 2 N]: dG in columns [0, N), dU in [N, 2 N); may be gu_ptr", "mn"),
)
OPERANDS = (*DGU_OPERANDS, Operand("h", "[M, N]", "mn"))


def _sizes(caller: str, dh: torch.Tensor, gu: torch.Tensor) -> tuple[int, int]:
    """(M, F) of the two passes' operands, dH [M, F] beside gu = [G | U] [M, 2F]."""
    L.require(dh.dim() == 2 and tuple(gu.shape) == (dh.shape[0], 2 * dh.shape[1]),
              f"{caller}: gu must be [M, 2F] beside dH [M, F], got {tuple(gu.shape)} and {tuple(dh.shape)}")
    return dh.shape


def gated_gradient(dh: torch.Tensor, gu: torch.Tensor, activation: str,
                   out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dGU, H) from dH ([M, F]) and gu = [G | U] ([M, 2F]), written into `out` = (dGU, H) where given;
    dGU may be gu itself (each element is read before the same program writes it)."""
    M, F = _sizes("gated_gradient", dh, gu)
    dgu_out, h_out = out if out is not None else (None, None)
    dgu, h = L.output(dgu_out, (M, 2 * F), gu), L.output(h_out, (M, F), gu)
    if M and F:
        L.pointwise_launch(GATED_GRAD, activation, gu.dtype, M, F, {"dh": dh, "gu": gu, "dgu": dgu, "h": h})
    return dgu, h


def gated_gradient_kept(dh: torch.Tensor, gu: torch.Tensor, activation: str,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """dGU = [dG | dU] ([M, 2F]) from dH ([M, F]) and gu = [G | U], where the forward kept H: written into
    `out` where given, which may be gu itself."""
    M, F = _sizes("gated_gradient_kept", dh, gu)
    dgu = L.output(out, (M, 2 * F), gu)
    if M and F:
        L.pointwise_launch(GATED_DGU, activation, gu.dtype, M, F, {"dh": dh, "gu": gu, "dgu": dgu})
    return dgu


def _run(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """One [M, 3F] result, dG | dU | H, as op gated_bwd's."""
    dh = ops["dh"]
    n = dh.shape[1]
    out = L.allocate((dh.shape[0], 3 * n), dh) if out is None else out
    gated_gradient(dh, ops["gu"], activation, out=(out[:, :2 * n], out[:, 2 * n:]))
    return out


def gated_from_dh(dh: torch.Tensor, gu: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dGU, H) from dH in PyTorch's separate ops: this pass's eager form, and (in float64) the reference
    of op gated_bwd."""
    F_ = dh.shape[1]
    g, u = gu[:, :F_], gu[:, F_:]
    a = TORCH_ACTIVATIONS[activation](g)
    return torch.cat([activation_backward(activation, dh * u, g), dh * a], dim=1), a * u


def _eager(ops: dict, activation: str) -> torch.Tensor:
    return torch.cat(gated_from_dh(ops["dh"], ops["gu"], activation), dim=1)


GATED_GRAD = OpSpec(
    name="gated_grad",
    template="gated_grad",
    doc="the gated backward's pointwise dG | dU and H from dH (nothing to tune)",
    operands=OPERANDS,
    activations=GATED_ACTIVATIONS,
    run=_run,
    **POINTWISE,
    library={"eager": _eager},
    template_files=("gated_grad.py.jinja", "_pointwise.py.jinja", "_grad.py.jinja", "_common.py.jinja"),
)


def _run_dgu(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    return gated_gradient_kept(ops["dh"], ops["gu"], activation, out=out)


def _eager_dgu(ops: dict, activation: str) -> torch.Tensor:
    return gated_from_dh(ops["dh"], ops["gu"], activation)[0]


GATED_DGU = OpSpec(
    name="gated_dgu",
    template="gated_dgu",
    doc="the gated backward's pointwise dG | dU from dH, where the forward kept H (nothing to tune)",
    operands=DGU_OPERANDS,
    activations=GATED_ACTIVATIONS,
    run=_run_dgu,
    **POINTWISE,
    library={"eager": _eager_dgu},
    template_files=("gated_dgu.py.jinja", "gated_grad.py.jinja", "_pointwise.py.jinja", "_grad.py.jinja",
                    "_common.py.jinja"),
)
