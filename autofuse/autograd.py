"""Backward through the fused modules: torch.autograd.Functions around the fused forwards.

The forward runs autofuse's tuned kernels and saves only its inputs (x and the parameters); the
backward recomputes the pre-activations it needs (the gate and up projections, or a Linear's
pre-activation) and forms the gradients from GEMMs and PyTorch's own activation derivatives
(aten's gelu_backward / silu_backward, the ones eager autograd runs). Saving x alone keeps the
activation memory of a training step at the inputs; fusing the backward into tuned templates is
the next step (issue 5). Gradients accumulate into .grad as autograd always does; a second-order
backward is refused with a clear error.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    def forward(ctx, run, x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation):
        ctx.activation = activation
        ctx.has_bias = b_gate is not None
        ctx.save_for_backward(x, w_gate, b_gate, w_up, b_up, w_down)
        return run()

    @staticmethod
    def backward(ctx, dy):
        _refuse_double_backward()
        x, w_gate, b_gate, w_up, b_up, w_down = ctx.saved_tensors
        g = F.linear(x, w_gate, b_gate)
        u = F.linear(x, w_up, b_up)
        a = TORCH_ACTIVATIONS[ctx.activation](g)
        dh = dy @ w_down
        dg = activation_backward(ctx.activation, dh * u, g)
        du = dh * a
        need = ctx.needs_input_grad  # (run, x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation)
        dx = None
        if need[1]:
            dx = dg @ w_gate
            dx.addmm_(du, w_up)
        dw_gate = dg.t() @ x if need[2] else None
        dw_up = du.t() @ x if need[4] else None
        dw_down = dy.t() @ (a * u) if need[6] else None
        db_gate = _sum_rows(dg) if ctx.has_bias and need[3] else None
        db_up = _sum_rows(du) if ctx.has_bias and need[5] else None
        db_down = _sum_rows(dy) if ctx.has_bias and need[7] else None
        return None, dx, dw_gate, db_gate, dw_up, db_up, dw_down, db_down, None
