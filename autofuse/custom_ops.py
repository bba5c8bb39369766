"""autofuse's modules as torch.library custom ops, so that torch.compile and torch.export see each
as one opaque, well-described op instead of breaking the graph at the Triton launches.

Under torch.compile / torch.export the modules call `torch.ops.autofuse.mlp` / `.linear` (see
FusedMLP.forward); eager calls skip the dispatcher. (The op registry, autofuse/ops, is another thing:
the ops autofuse renders, tunes and launches.) The fake implementations give the output's
shape and dtype (M may be symbolic); the real ones resolve the config table for the concrete M
(memoised per process, dropped when resolve.invalidate() is called) and run the same code as the
eager modules, except that split-K workspaces are allocated per call (workspaces.workspaces_per_call:
CUDA-graph trees allow no persistent allocation in their pool). Gradients: registered formulas
that recompute the pre-activations with PyTorch ops (which torch.compile then fuses); the eager
modules' own backward (autograd.py) is not used there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import workspaces
from .activations import TORCH_ACTIVATIONS, activation_backward
from .choose import LinearPlan, MLPPlan, generation, select, table_key
from .choose.check import no_checks
from .dispatch import BoundLinear, BoundMLP
from .launch import addresses
from .training import sum_rows

_entries: dict[tuple, object] = {}
_entries_generation = generation()  # what _entries were resolved under: older ones are dropped


def _entry(bind, plan: LinearPlan | MLPPlan, M: int, weight: torch.Tensor, tuned: bool):
    """The bound entry (dispatch.BoundMLP / BoundLinear, made by `bind`) for the plan's table at M rows,
    memoised like a module's (per M up to the largest bucket, then per bucket, and per lookup generation)."""
    global _entries_generation
    if generation() != _entries_generation:  # never used again, but holding weights and workspaces
        _entries.clear()
        _entries_generation = generation()
    key = (plan, *table_key(M, weight), tuned)
    entry = _entries.get(key)
    if entry is None:
        # No check runs inside the ops: a table waiting for one (Source.PENDING) is kept too, and resolved
        # again once an eager call's check is remembered (lookup.remember moves generation()).
        table, _ = select(plan, max(M, 1), weight.dtype, weight.device, tuned)
        entry = _entries[key] = bind(table, plan.activation, max(M, 1), inside_ops=True)
    return entry


@torch.library.custom_op("autofuse::mlp", mutates_args=())
def mlp(x: torch.Tensor, params: list[torch.Tensor | None], activation: str, tuned: bool) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) for 2-D x through autofuse's tuned kernels; params: [w_gate, b_gate, w_up,
    b_up, w_down, b_down] (the biases None, or all three given)."""
    M = x.shape[0]
    params = tuple(params)
    w_gate, w_down = params[0], params[4]
    with workspaces.workspaces_per_call(), no_checks():
        plan = MLPPlan(x.shape[1], w_gate.shape[0], activation, params[1] is not None)
        entry = _entry(BoundMLP, plan, M, w_gate, tuned)
        return entry(x, params, addresses(params), M, (M, w_down.shape[0]))


@mlp.register_fake
def _(x, params, activation, tuned):
    return x.new_empty((x.shape[0], params[4].shape[0]))


@torch.library.custom_op("autofuse::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
           activation: str, tuned: bool) -> torch.Tensor:
    """act(x @ weight.T + bias) [+ residual] for 2-D x, through autofuse's tuned kernel."""
    M = x.shape[0]
    with workspaces.workspaces_per_call(), no_checks():
        plan = LinearPlan(x.shape[1], weight.shape[0], activation, bias is not None, residual is not None)
        entry = _entry(BoundLinear, plan, M, weight, tuned)
        return entry(x, weight, bias, residual, addresses((weight, bias)), M, (M, weight.shape[0]))


@linear.register_fake
def _(x, weight, bias, residual, activation, tuned):
    return x.new_empty((x.shape[0], weight.shape[0]))


def _flat(inputs) -> list:
    """The op's inputs with the MLP's parameter list spread out in place."""
    return [t for item in inputs for t in (item if isinstance(item, (list, tuple)) else (item,))]


def _save_inputs(ctx, inputs, output):
    flat = _flat(inputs)
    ctx.save_for_backward(*[t for t in flat if isinstance(t, torch.Tensor)])
    ctx.present = [isinstance(t, torch.Tensor) for t in flat]
    ctx.activation = inputs[-2]


def _unpack(ctx):
    saved = iter(ctx.saved_tensors)
    return [next(saved) if present else None for present in ctx.present]


def _mlp_backward(ctx, dy):
    x, w_gate, b_gate, w_up, b_up, w_down, b_down, _, _ = _unpack(ctx)
    act = TORCH_ACTIVATIONS[ctx.activation]
    g, u = F.linear(x, w_gate, b_gate), F.linear(x, w_up, b_up)
    a = act(g)
    h = a * u
    dh = dy @ w_down
    dg, du = activation_backward(ctx.activation, dh * u, g), dh * a
    sums = sum_rows if b_gate is not None else (lambda t: None)
    return dg @ w_gate + du @ w_up, [dg.t() @ x, sums(dg), du.t() @ x, sums(du), dy.t() @ h, sums(dy)], None, None


def _linear_backward(ctx, dy):
    x, weight, bias, residual, _, _ = _unpack(ctx)
    dz = activation_backward(ctx.activation, dy, F.linear(x, weight, bias))
    return (dz @ weight, dz.t() @ x, sum_rows(dz) if bias is not None else None,
            dy if residual is not None else None, None, None)


mlp.register_autograd(_mlp_backward, setup_context=_save_inputs)
linear.register_autograd(_linear_backward, setup_context=_save_inputs)
