"""Backward through the fused modules: torch.autograd.Functions around the fused forwards.

The forward runs autofuse's tuned kernels and saves only its inputs (x and the parameters).
Gated MLP: one fused kernel (templates/gated_bwd.py.jinja) recomputes the gate and up
pre-activations and forms dH = dY Wd in the same K loop, and writes dG, dU and H, so none of G, U
or dH reaches memory; the input and weight gradients are then GEMMs over those. Linear: the
pre-activation is recomputed and PyTorch's own activation derivative applied (aten's
gelu_backward / silu_backward, as eager autograd runs them). Gradients accumulate into .grad as
autograd always does; a second-order backward is refused with a clear error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import launch
from .activations import TORCH_ACTIVATIONS


def activation_backward(activation: str, grad: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """d act(pre) / d pre * grad, computed as eager autograd computes it."""
    if activation == "none":
        return grad
    if activation == "relu":
        return torch.where(pre > 0, grad, torch.zeros_like(grad))
    if activation in ("gelu", "gelu_tanh"):
        return torch.ops.aten.gelu_backward(grad, pre, approximate="tanh" if activation == "gelu_tanh" else "none")
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, pre)
    raise ValueError(f"no derivative for activation {activation!r}")


def gated_backward_eager(x, dy, w_gate, w_up, w_down, b_gate, b_up, activation) -> torch.Tensor:
    """[dG | dU | H] as PyTorch computes them (the gated backward kernel's baseline and, in float64,
    its reference): G, U recomputed, dH = dY Wd, then the activation derivative."""
    g, u = F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up)
    a = TORCH_ACTIVATIONS[activation](g)
    dh = dy @ w_down
    return torch.cat([activation_backward(activation, dh * u, g), dh * a, a * u], dim=1)


def _refuse_double_backward() -> None:
    if torch.is_grad_enabled():  # backward(create_graph=True) or autograd.grad(..., create_graph=True)
        raise RuntimeError("autofuse modules do not support double backward (create_graph=True); "
                           "use the eager PyTorch module for higher-order gradients")


def _sum_rows(t: torch.Tensor) -> torch.Tensor:
    return t.sum(0, dtype=torch.float32).to(t.dtype)  # bias gradients: accumulate in float32


class LinearFunction(torch.autograd.Function):
    """y = act(x @ w.T + b) [+ r], forward through `run` (the fused kernel)."""

    @staticmethod
    def forward(ctx, run, x, weight, bias, residual, activation):
        ctx.activation = activation
        ctx.has_bias, ctx.has_residual = bias is not None, residual is not None
        ctx.save_for_backward(x, weight, bias)
        return run()

    @staticmethod
    def backward(ctx, dy):
        _refuse_double_backward()
        x, weight, bias = ctx.saved_tensors
        dz = dy
        if ctx.activation != "none":
            dz = activation_backward(ctx.activation, dy, F.linear(x, weight, bias))
        need = ctx.needs_input_grad  # (run, x, weight, bias, residual, activation)
        dx = dz @ weight if need[1] else None
        dw = dz.t() @ x if need[2] else None
        db = _sum_rows(dz) if ctx.has_bias and need[3] else None
        dr = dy if ctx.has_residual and need[4] else None
        return None, dx, dw, db, dr, None


class MLPFunction(torch.autograd.Function):
    """y = down(act(gate(x)) * up(x)), forward through `run` (the fused kernels)."""

    @staticmethod
    def forward(ctx, run, x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, backward_config):
        ctx.activation, ctx.backward_config = activation, backward_config
        ctx.has_bias = b_gate is not None
        ctx.save_for_backward(x, w_gate, b_gate, w_up, b_up, w_down)
        return run()

    @staticmethod
    def backward(ctx, dy):
        _refuse_double_backward()
        x, w_gate, b_gate, w_up, b_up, w_down = ctx.saved_tensors
        dy = dy.contiguous()
        F_ = w_gate.shape[0]
        if ctx.backward_config is None:  # tuning found PyTorch faster for this shape
            both = gated_backward_eager(x, dy, w_gate, w_up, w_down, b_gate, b_up, ctx.activation)
            dgu, h = both[:, :2 * F_], both[:, 2 * F_:]
        else:
            dgu, h = launch.gated_backward(x, dy, w_gate, w_up, w_down, b_gate, b_up, ctx.activation,
                                           ctx.backward_config)
        dg, du = dgu[:, :F_], dgu[:, F_:]
        need = ctx.needs_input_grad  # (run, x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, config)
        dx = None
        if need[1]:
            dx = dg @ w_gate
            dx.addmm_(du, w_up)
        dw_gate = dw_up = None
        if need[2] or need[4]:
            dw = dgu.t() @ x  # one GEMM: [dW_gate; dW_up]
            dw_gate, dw_up = (dw[:F_] if need[2] else None), (dw[F_:] if need[4] else None)
        dw_down = dy.t() @ h if need[6] else None
        db_gate = db_up = None
        if ctx.has_bias and (need[3] or need[5]):
            db = _sum_rows(dgu)
            db_gate, db_up = db[:F_], db[F_:]
        db_down = _sum_rows(dy) if ctx.has_bias and need[7] else None
        return None, dx, dw_gate, db_gate, dw_up, db_up, dw_down, db_down, None, None
