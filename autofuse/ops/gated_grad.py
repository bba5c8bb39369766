"""The gated MLP backward's pointwise pass, op `gated_grad` (templates/gated_grad.py.jinja): from dH, which
cuBLAS computed as dY Wd, and the forward's saved G and U, dG, dU and H in one pass over memory — the
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
    Operand("g", "[M, N]: the forward's gate pre-activations G", "mn"),
    Operand("u", "[M, N]: the forward's up pre-activations U", "mn"),
    Operand("dg", "[M, N]: dG; may be g_ptr", "mn"),
    Operand("du", "[M, N]: dU; may be u_ptr", "mn"),
)
OPERANDS = (*DGU_OPERANDS, Operand("h", "[M, N]", "mn"))


def _sizes(caller: str, dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[int, int]:
    """(M, F) of the two passes' operands: dH, G and U, [M, F] each."""
    L.require(dh.dim() == 2 and g.shape == dh.shape and u.shape == dh.shape,
              lambda: f"{caller}: g and u must be [M, F] like dH, got {tuple(g.shape)}, {tuple(u.shape)} and dH "
              f"{tuple(dh.shape)}")
    return dh.shape


def gated_gradient(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, activation: str,
                   out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dG, dU, H) from dH, G and U ([M, F] each), written into `out` = (dG, dU, H) where given; dG and dU
    may be g and u themselves, H may be dh (each element is read before the same program writes it)."""
    M, F = _sizes("gated_gradient", dh, g, u)
    dg_out, du_out, h_out = out if out is not None else (None, None, None)
    dg, du, h = L.output(dg_out, (M, F), g), L.output(du_out, (M, F), g), L.output(h_out, (M, F), g)
    if M and F:
        L.pointwise_launch(GATED_GRAD, activation, g.dtype, M, F,
                           {"dh": dh, "g": g, "u": u, "dg": dg, "du": du, "h": h})
    return dg, du, h


def gated_gradient_kept(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, activation: str,
                        out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dG, dU) from dH, G and U ([M, F] each), where the forward kept H: written into `out` = (dG, dU)
    where given, which may be g and u themselves."""
    M, F = _sizes("gated_gradient_kept", dh, g, u)
    dg_out, du_out = out if out is not None else (None, None)
    dg, du = L.output(dg_out, (M, F), g), L.output(du_out, (M, F), g)
    if M and F:
        L.pointwise_launch(GATED_DGU, activation, g.dtype, M, F, {"dh": dh, "g": g, "u": u, "dg": dg, "du": du})
    return dg, du


def _run(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """One [M, 3F] result, dG | dU | H, as op gated_bwd's."""
    dh = ops["dh"]
    n = dh.shape[1]
    out = L.allocate((dh.shape[0], 3 * n), dh) if out is None else out
    gated_gradient(dh, ops["g"], ops["u"], activation, out=(out[:, :n], out[:, n:2 * n], out[:, 2 * n:]))
    return out


def gated_from_dh(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor,
                  activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dG, dU, H) from dH, G and U in PyTorch's separate ops: this pass's eager form, and (in float64) the
    reference of op gated_bwd."""
    a = TORCH_ACTIVATIONS[activation](g)
    return activation_backward(activation, dh * u, g), dh * a, a * u


def _eager(ops: dict, activation: str) -> torch.Tensor:
    return torch.cat(gated_from_dh(ops["dh"], ops["g"], ops["u"], activation), dim=1)


GATED_GRAD = OpSpec(
    name="gated_grad",
    template="gated_grad",
    doc="the gated backward's pointwise dG | dU and H from dH (nothing to tune)",
    operands=OPERANDS,
    activations=GATED_ACTIVATIONS,
    run=_run,
    **POINTWISE,
    library={"eager": _eager},
)


def _run_dgu(ops: dict, activation: str, config: KernelConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """One [M, 2F] result, dG | dU."""
    dh = ops["dh"]
    n = dh.shape[1]
    out = L.allocate((dh.shape[0], 2 * n), dh) if out is None else out
    gated_gradient_kept(dh, ops["g"], ops["u"], activation, out=(out[:, :n], out[:, n:]))
    return out


def _eager_dgu(ops: dict, activation: str) -> torch.Tensor:
    return torch.cat(gated_from_dh(ops["dh"], ops["g"], ops["u"], activation)[:2], dim=1)


GATED_DGU = OpSpec(
    name="gated_dgu",
    template="gated_dgu",
    doc="the gated backward's pointwise dG | dU from dH, where the forward kept H (nothing to tune)",
    operands=DGU_OPERANDS,
    activations=GATED_ACTIVATIONS,
    run=_run_dgu,
    **POINTWISE,
    library={"eager": _eager_dgu},
)
