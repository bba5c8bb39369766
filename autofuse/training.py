"""Training: torch.autograd.Functions of the fused modules, with a training forward of their own.

Gated MLP. The forward computes the gate and up pre-activations G | U with cuBLAS into one [M, 2F]
buffer and keeps it (it is what the backward needs; recomputing it costs two of the backward's
six GEMMs), forms H = act(G) * U with a pointwise kernel and runs the tuned down projection.
Two backwards, by the module's `save_hidden`:
- True (the default): the forward keeps H as well (torch.compile's trade: one more [M, F] activation
  held from forward to backward); the backward forms dWd = dY^T H first and frees H, then runs cuBLAS
  dH = dY Wd and ONE pointwise pass (op gated_dgu) that writes dG | dU over G | U, reading three [M, F]
  tensors and writing two. Its peak inside the backward is the lean path's.
- False (one [M, F] activation less per layer): the backward's tuned choice of op gated_bwd, the fused
  kernel (dH = dY Wd with dG | dU written over G, U, and H, in its epilogue) or cuBLAS dH and one pass
  that also recomputes H (writing it over dH): one [M, F] tensor more of memory traffic.
The input and weight gradients are then GEMMs over dG | dU. Because the saved buffer is overwritten,
a graph's backward runs once (retain_graph=True and a second backward is refused with a clear error).

Linear. The forward keeps its pre-activation Z when there is an activation (as eager does) and
the backward applies PyTorch's own derivative (aten's gelu_backward / silu_backward).

Gradients accumulate into .grad as autograd always does; a second-order backward is refused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import launch
from .activations import TORCH_ACTIVATIONS, activation_backward
from .configs import KernelConfig
from .ops.gated_act import gated_activation
from .ops.gated_bwd import LIBRARY_BACKWARDS, gated_backward
from .ops.gated_grad import gated_gradient_kept
from .ops.gated_up import pre_activations, stacked
from .ops.linear import linear


def _refuse_double_backward() -> None:
    if torch.is_grad_enabled():  # backward(create_graph=True) or autograd.grad(..., create_graph=True)
        raise RuntimeError("autofuse modules do not support double backward (create_graph=True); "
                           "use the eager PyTorch module for higher-order gradients")


def sum_rows(t: torch.Tensor) -> torch.Tensor:
    return t.sum(0, dtype=torch.float32).to(t.dtype)  # bias gradients: accumulate in float32


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
             config: KernelConfig | None) -> torch.Tensor:
    """x @ weight.T + bias [+ residual] through the tuned linear kernel, or cuBLAS (config None) where
    tuning chose a library path."""
    if config is not None:
        return linear(x, weight, bias, residual, "none", config)
    y = F.linear(x, weight, bias)
    return y if residual is None else y.add_(residual)


class LinearFunction(torch.autograd.Function):
    """y = act(x @ w.T + b) [+ r] for training: Z = x @ w.T + b [+ r when there is no activation] by
    the tuned kernel (config None: cuBLAS), then the activation; Z is kept when it has one."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, activation, config):
        ctx.activation = activation
        ctx.has_bias, ctx.has_residual = bias is not None, residual is not None
        if activation == "none":
            ctx.save_for_backward(x, weight)
            return _project(x, weight, bias, residual, config)
        z = _project(x, weight, bias, None, config)
        ctx.save_for_backward(x, weight, z)
        y = TORCH_ACTIVATIONS[activation](z)
        return y if residual is None else y.add_(residual)

    @staticmethod
    def backward(ctx, dy):
        _refuse_double_backward()
        x, weight, *z = ctx.saved_tensors
        dz = activation_backward(ctx.activation, dy, z[0]) if z else dy
        need = ctx.needs_input_grad  # (x, weight, bias, residual, activation, config)
        dx = dz @ weight if need[0] else None
        dw = dz.t() @ x if need[1] else None
        db = sum_rows(dz) if ctx.has_bias and need[2] else None
        dr = dy if ctx.has_residual and need[3] else None
        return dx, dw, db, dr, None, None


class TrainingLaunches:
    """The training forward's two kernel launches at one M (the pointwise H = act(G) * U, and the tuned
    down projection), bound on the first forward and replayed afterwards like the inference path's
    (bound.BoundLaunch): per call only G | U, H and the output change. Held per module table entry."""

    def __init__(self, M: int) -> None:
        self.M = M
        self.launches: dict[str, tuple] = {}  # name -> (BoundLaunch or None, the weights' addresses)

    def run(self, name: str, tensors: dict, weights: list, first: Callable[[], torch.Tensor]) -> None:
        """Launch `name` bound where it was bound at these weights; else run `first` (which writes the
        tensors' output) through the JIT and bind what it launched."""
        bound, bound_weights = self.launches.get(name, (None, None))
        if bound is not None and weights == bound_weights and bound(tensors):
            return
        with launch.binding() as recorded:
            first()
        if bound is None or weights != bound_weights:
            self.launches[name] = (launch.only_launch(recorded), weights)


def _training_forward(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, down_config,
                      launches: TrainingLaunches | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(G | U, H, Y): cuBLAS for G | U, then the pointwise H and the down projection (bound where possible)."""
    gu = pre_activations(x, w_gate, b_gate, w_up, b_up)
    M = x.shape[0]
    if launches is None or launches.M != M:
        h = gated_activation(gu, activation)
        return gu, h, _project(h, w_down, b_down, None, down_config)
    h = gu.new_empty((M, w_gate.shape[0]))
    launches.run("gated_act", {"gu": gu, "h": h}, [], lambda: gated_activation(gu, activation, out=h))
    if down_config is None:  # a library path: nothing to bind
        return gu, h, _project(h, w_down, b_down, None, None)
    y = h.new_empty((M, w_down.shape[0]))
    launches.run("down", {"x": h, "y": y}, launch.addresses((w_down, b_down)),
                 lambda: linear(h, w_down, b_down, None, "none", down_config, out=y))
    return gu, h, y


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor default hooks (torch.autograd.graph.saved_tensors_hooks: non-reentrant
    checkpointing, CPU offloading) are active. A private PyTorch query; where it is missing, assume they are
    (the answer that is always correct, at one [M, F] activation's cost)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True
    try:
        return top(False) is not None
    except (TypeError, RuntimeError):
        return True


class MLPFunction(torch.autograd.Function):
    """y = down(act(gate(x)) * up(x)) for training; see the module docstring for what runs where."""

    @staticmethod
    def forward(ctx, x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, down_config, backward_config,
                launches=None, save_hidden=False):
        """backward_config: op gated_bwd's choice, used where H is not saved (`save_hidden` False)."""
        gu, h, y = _training_forward(x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, down_config,
                                     launches)
        ctx.activation, ctx.backward_config = activation, backward_config
        ctx.has_bias = b_gate is not None
        ctx.spent = False
        # H kept on ctx (an intermediate, neither input nor output: no reference cycle) is freed by the
        # backward as soon as dWd is formed, so the backward's peak is the lean path's; saved through
        # save_for_backward it would live until the backward returns. Where saved-tensor hooks are active
        # (activation checkpointing, offloading), it goes through save_for_backward so that they see it.
        ctx.hidden = None
        saved = (x, gu, w_gate, w_up, w_down)
        if save_hidden and _saved_tensor_hooks_active():
            saved += (h,)
        elif save_hidden:
            ctx.hidden = h
        ctx.save_for_backward(*saved)
        return y

    @staticmethod
    def backward(ctx, dy):
        _refuse_double_backward()
        if ctx.spent:
            raise RuntimeError("autofuse's MLP backward writes the gradients over the activations its forward "
                               "saved, so each forward's graph can be backpropagated once: run the forward "
                               "again instead of backward(retain_graph=True) twice")
        ctx.spent = True
        x, gu, w_gate, w_up, w_down, *kept = ctx.saved_tensors
        h = ctx.hidden if ctx.hidden is not None else (kept[0] if kept else None)  # None: H not kept
        ctx.hidden = None
        kept.clear()  # so that `del h` below leaves no reference here
        dy = dy.contiguous()
        F_ = w_gate.shape[0]
        config = ctx.backward_config
        need = ctx.needs_input_grad  # (x, w_gate, b_gate, w_up, b_up, w_down, b_down, activation, configs)
        if h is not None:  # the forward's H: dWd first, then cuBLAS dH and one pass writing dG | dU over G | U
            dw_down = dy.t() @ h if need[5] else None
            del h  # freed here where it was kept on ctx: dH below takes its place
            dh = dy @ w_down
            dgu = gated_gradient_kept(dh, gu, ctx.activation, out=gu)
            del dh  # before the GEMMs below allocate
        else:
            if isinstance(config, KernelConfig):
                dgu, h = gated_backward(dy, gu, w_down, ctx.activation, config, out=(gu, None))
            else:  # a library path (None: eager), where tuning or a check chose one for this shape
                library = LIBRARY_BACKWARDS["eager" if config is None else config.name]
                dgu, h = library(dy, gu, w_down, ctx.activation, out=(gu, None))
            dw_down = dy.t() @ h if need[5] else None
            del h  # first, so that the [M, F] H is freed before the next GEMMs allocate
        dg, du = dgu[:, :F_], dgu[:, F_:]
        dx = None
        if need[0]:
            w_gu = stacked(w_gate, w_up)
            if w_gu is not None:  # the training layout: one GEMM over d_ff twice
                dx = dgu @ w_gu
            else:
                dx = dg @ w_gate
                dx.addmm_(du, w_up)
        dw_gate = dw_up = None
        if need[1] or need[3]:
            dw = dgu.t() @ x  # one GEMM: [dW_gate; dW_up]
            dw_gate, dw_up = (dw[:F_] if need[1] else None), (dw[F_:] if need[3] else None)
        db_gate = db_up = None
        if ctx.has_bias and (need[2] or need[4]):
            db = sum_rows(dgu)
            db_gate, db_up = db[:F_], db[F_:]
        db_down = sum_rows(dy) if ctx.has_bias and need[6] else None
        return dx, dw_gate, db_gate, dw_up, db_up, dw_down, db_down, None, None, None, None, None
