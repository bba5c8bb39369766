"""Training: torch.autograd.Functions of the fused modules, with a training forward of their own.

Gated MLP. The forward computes the gate and up pre-activations G and U with cuBLAS and keeps them (they
are what the backward needs; recomputing them costs two of the backward's six GEMMs), forms H = act(G) * U
with a pointwise kernel and runs the tuned down projection. Two backwards, by the module's `save_hidden`:
- True (the default): G and U are two buffers (their rows, H's and dH's 128 bytes apart where d_ff's rows are not
  a multiple of 32 bytes long: ACTIVATION_ROW_BYTES) and the forward keeps H as well (torch.compile's trade: one
  more [M, F] activation held from forward to backward). The backward forms dWd = dY^T H first and frees
  H, runs cuBLAS dH = dY Wd and ONE pointwise pass (op gated_dgu) that writes dG, dU over G, U (reading
  three [M, F] tensors, writing two), then dX = dG Wg + dU Wu, dWg = dG^T x, frees dG, and dWu = dU^T x:
  its last GEMM holds dU alone beside the gradients, where one [M, 2F] buffer would be held whole. A host-bound step
  holds [G | U] as one buffer all the same where that keeps its peak at most an eager graph's
  (stacked_pre_activations): one GEMM each for G | U, dX and [dWg; dWu], three cuBLAS calls fewer.
- False (one [M, F] activation less per layer): G | U is one [M, 2F] buffer (one GEMM where the weights
  are stacked) and the backward runs its tuned choice of op gated_bwd, the fused kernel (dH = dY Wd with
  dG | dU written over G | U, and H, in its epilogue) or cuBLAS dH and one pass that also recomputes H
  (writing it over dH): one [M, F] tensor more of memory traffic. Then dX and [dWg; dWu], one GEMM each
  where the weights are stacked.
Where the weight gradients outweigh the activations (separate_weight_gradients: few rows against wide weights), the
kept-H step is three autograd nodes instead of one: a ProjectionFunction each for G and U, whose backward returns
that weight's gradient alone, and a HiddenDownFunction for the rest, so that the engine adds each weight gradient
into .grad and frees it before the next one is formed.
Because the saved pre-activations are overwritten, a graph's backward runs once (retain_graph=True and a
second backward is refused with a clear error).

Linear. The forward keeps its pre-activation Z when there is an activation (as eager does) and
the backward applies PyTorch's own derivative (aten's gelu_backward / silu_backward).

Gradients accumulate into .grad as autograd always does; a second-order backward is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import launch
from .activations import TORCH_ACTIVATIONS, activation_backward
from .choose.policy import current as current_policy
from .configs import KernelConfig
from .layout import TrainingLayout, linear_width, row_width
from .ops.gated_act import gated_activation
from .ops.gated_bwd import LIBRARY_BACKWARDS, gated_backward
from .ops.gated_grad import gated_gradient_kept
from .ops.gated_up import pre_activations, project_into, stacked
from .ops.linear import linear


def _refuse_double_backward() -> None:
    if torch.is_grad_enabled():  # backward(create_graph=True) or autograd.grad(..., create_graph=True)
        raise RuntimeError("autofuse modules do not support double backward (create_graph=True); "
                           "use the eager PyTorch module for higher-order gradients")


def _refuse_second_backward(ctx) -> None:
    if ctx.spent:
        raise RuntimeError("autofuse's MLP backward writes the gradients over the activations its forward "
                           "saved, so each forward's graph can be backpropagated once: run the forward "
                           "again instead of backward(retain_graph=True) twice")
    ctx.spent = True


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


class LinearRun(NamedTuple):
    """A Linear's training forward in the padded space (linear_run): the weight and bias, [N, K] and [N] with N, K =
    layout.linear_width of out_features (n) and in_features (k), zero beyond the live region (views of the
    parameters' own storage on the module's TrainingLayout, else copies in buffers the module holds); x and a
    residual padded per call (pad_columns); the output and gradients the live region's."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    n: int
    k: int


def linear_padded(M: int, n: int, k: int) -> tuple[int, int] | None:
    """(N, K) a FusedLinear's training forward of M rows runs at where out_features n or in_features k is unaligned
    (layout.linear_width pads it) and the GEMM is not host-bound (M N K at least DecisionPolicy.host_bound_step_macs,
    as the MLP's padded step: there the padded copies' calls cost less than unaligned rows cost cuBLAS, 3-4x at the
    MLP's GEMMs); else None, and it runs at n, k."""
    N, K = linear_width(n), linear_width(k)
    if (N, K) == (n, k) or M * N * K < current_policy().host_bound_step_macs:
        return None
    return N, K


def held_zeros(held: dict | None, like: torch.Tensor, shapes: tuple) -> tuple:
    """Zero-filled buffers of `shapes` (a None shape: None) in like's dtype and device, kept as held["padded"] and made
    again where the first one's shape, dtype or device moved (without `held`, made on every call): the padded weight
    copies of a training step, whose padding stays zero while only their live regions are written."""
    buffers = None if held is None else held.get("padded")
    first = None if buffers is None else buffers[0]
    if first is None or first.shape != shapes[0] or first.dtype != like.dtype or first.device != like.device:
        buffers = tuple(None if shape is None else like.new_zeros(shape) for shape in shapes)
        if held is not None:
            held["padded"] = buffers
    return buffers


def linear_run(weight: torch.Tensor, bias: torch.Tensor | None, sizes: tuple[int, int], held: dict,
               layout: TrainingLayout | None = None) -> LinearRun:
    """The padded weight and bias as a LinearRun: views of the parameters' own storage where they are still laid out
    as `layout` (the module's TrainingLayout) made them, else copies in the padded buffers `held` keeps (made again
    where the dtype or device moved; their padding stays zero: only the live region is written). Outside the graph:
    copied under autograd, each step's copy would chain a CopySlices node onto the last step's."""
    n, k = weight.shape
    if layout is not None:
        with torch.no_grad():
            wide = layout.widen((weight, bias), launch.addresses((weight, bias)))
        if wide is not None:  # laid out at linear_width(n) rows, k columns: the sizes linear_padded gives
            return LinearRun(wide[0], wide[1], n, k)
    padded_weight, padded_bias = held_zeros(held, weight, (sizes, None if bias is None else sizes[:1]))
    with torch.no_grad():
        padded_weight[:n, :k].copy_(weight)
        if bias is not None:
            padded_bias[:n].copy_(bias)
    return LinearRun(padded_weight, padded_bias, n, k)


class LinearFunction(torch.autograd.Function):
    """y = act(x @ w.T + b) [+ r] for training: Z = x @ w.T + b [+ r when there is no activation] by
    the tuned kernel (config None: cuBLAS), then the activation; Z is kept when it has one. With a LinearRun
    the GEMMs run in the padded space: x, r and dY padded, the run's copies read (kept on ctx: the module writes
    them again at its next forward, so the parameter is what is saved and version-checked, as in MLPFunction)."""

    @staticmethod
    def forward(ctx, x, weight, bias, residual, activation, config, run=None):
        ctx.activation = activation
        ctx.has_bias, ctx.has_residual = bias is not None, residual is not None
        ctx.run = run
        w, b, r = weight, bias, residual
        if run is not None:
            w, b = run.weight, run.bias
            x = pad_columns(x, w.shape[1])
            r = None if residual is None else pad_columns(residual, w.shape[0])
        if activation == "none":
            ctx.save_for_backward(x, weight)
            y = _project(x, w, b, r, config)
        else:
            z = _project(x, w, b, None, config)
            ctx.save_for_backward(x, weight, z)
            y = TORCH_ACTIVATIONS[activation](z)
            y = y if r is None else y.add_(r)
        return y if run is None else y[:, :run.n]

    @staticmethod
    def backward(ctx, dy):
        _refuse_double_backward()
        x, weight, *z = ctx.saved_tensors
        run = ctx.run
        dz = dy
        if run is not None:
            weight = run.weight
            dz = pad_columns(dy, weight.shape[0])
        dz = activation_backward(ctx.activation, dz, z[0]) if z else dz
        need = ctx.needs_input_grad  # (x, weight, bias, residual, activation, config, run)
        dx = torch.mm(dz, weight) if need[0] else None
        dw = torch.mm(dz.t(), x) if need[1] else None
        db = sum_rows(dz) if ctx.has_bias and need[2] else None
        dr = dy if ctx.has_residual and need[3] else None
        if run is not None:  # the live region's
            dx = None if dx is None else dx[:, :run.k]
            dw = None if dw is None else dw[:run.n, :run.k]
            db = None if db is None else db[:run.n]
        return dx, dw, db, dr, None, None, None


class TrainingLaunches:
    """The training forward's two kernel launches at one M (the pointwise H = act(G) * U, and the tuned
    down projection), bound on the first forward and replayed afterwards like the inference path's
    (bound.BoundLaunch): per call only G | U, H and the output change. Held per module table entry.
    `weights` holds the padded copies of the weights (Padding.params), reused step after step: the module's one
    dict, shared by its entries at every M, since a copy per token count would hold the weights again for each."""

    def __init__(self, M: int, weights: dict) -> None:
        self.M = M
        self.launches: dict[str, tuple] = {}  # name -> (BoundLaunch or None, the weights' addresses)
        self.weights = weights
        self.stacked: tuple | None = None  # (gate's address, up's, dtype, stacked(gate, up)): stacked_weights

    def stacked_weights(self, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor | None:
        """stacked(w_gate, w_up), found again only where either weight's address or dtype moved. Sound: a view
        kept here keeps its storage alive, so no other tensor can start at a kept address meanwhile; a kept None
        (two buffers) costs at most one GEMM more a step, until an address moves."""
        held = self.stacked
        gate, up = w_gate.data_ptr(), w_up.data_ptr()
        if held is not None and held[0] == gate and held[1] == up and held[2] is w_gate.dtype:
            return held[3]
        w_gu = stacked(w_gate, w_up)
        self.stacked = (gate, up, w_gate.dtype, w_gu)
        return w_gu

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


# pad_columns fills only the padding columns of a padded x or dY from this many elements on ([8192, 2048]).
ROWS_FILL_ALONE = 1 << 24


def pad_columns(t: torch.Tensor, width: int) -> torch.Tensor:
    """t ([M, live columns]) in a new [M, width] tensor, zero beyond its columns (t itself where it is that wide).
    From ROWS_FILL_ALONE elements on, a copy into new storage and a fill of the padding columns alone: F.pad (what
    smaller steps, whose time is the host's, keep: one call) fills all of [M, width] before copying, and those fills
    were 37 us of a 3587 -> 8063 step at M = 8192, x's and dY's (H100 profile)."""
    M, live = t.shape
    if live == width:
        return t
    if M * width < ROWS_FILL_ALONE:
        return F.pad(t, (0, width - live))
    out = t.new_empty((M, width))
    out[:, :live].copy_(t)
    out[:, live:].zero_()
    return out


class Padding:
    """A training step of a gated MLP whose d_model or d_ff is not an aligned width (layout.row_width) runs
    in a padded space: x, the weights and biases zero-padded to D = row_width(d_model) and W = row_width(d_ff),
    so that every cuBLAS GEMM of the step has aligned sizes and rows (its fast kernels need them: unaligned, the same
    GEMMs ran 3-4x slower), exactly, since the padding contributes zeros everywhere; the output and the gradients
    are the live region of the padded results. Aligned rows alone are not enough: a kept-H step that read the gate and
    up parameters themselves at an aligned d_model (d_ff-wide G, U and H in activation buffers, whose rows start
    128 bytes apart; the down weight alone copied and read through its first d_ff columns) held a third of the
    copies and stepped 3.3-3.9x slower (3200 -> 6655, 1088 -> 3221, 3587 -> 8063 at M = 2048 and 8192, H100): an
    odd N or K keeps cuBLAS off its fast kernels too. Where d_model is aligned, the gate and up parameters
    themselves are the first rows of padded storage (layout.TrainingLayout, made by the module's first training
    forward) that the step reads in place, and the down weight alone is copied. Else (d_model unaligned, or
    parameters replaced since) the padded weights are copied once a step into buffers kept on the table entry, gate
    and up as the two halves of one, so that their addresses stay and one GEMM covers both."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        self.d, self.f = d_model, d_ff
        self.D, self.W = row_width(d_model), row_width(d_ff)

    @staticmethod
    def of(w_gate: torch.Tensor) -> Padding | None:
        f, d = w_gate.shape
        return Padding(d, f) if (row_width(d), row_width(f)) != (d, f) else None

    def params(self, params: tuple, launches: TrainingLaunches | None, layout: TrainingLayout | None = None) -> tuple:
        """(w_gate, b_gate, w_up, b_up, w_down, b_down) padded, in buffers reused step after step where the entry
        has launches (their padding stays zero: only the live region is written); the gate and up weights and biases
        as views of the parameters' own storage where they are still laid out as `layout` (the module's
        TrainingLayout) made them, the down weight then copied alone. Called outside autograd (the views must not be
        graph nodes)."""
        w_gate, b_gate, w_up, b_up, w_down, b_down = params
        wide = None if layout is None else layout.widen(params, launch.addresses(params))
        W, D = self.W, self.D
        d, f = self.d, self.f
        if wide is not None:  # gate and up read in place (D == d here); the down weight copied alone
            down, = held_zeros(None if launches is None else launches.weights, w_down, ((D, W),))
            down[:d, :f].copy_(w_down)
            return (*wide[:4], down, b_down)
        gate_up, biases, down, down_bias = held_zeros(
            None if launches is None else launches.weights, w_gate,
            ((2, W, D), (2, W) if b_gate is not None else None, (D, W), (D,) if b_down is not None else None))
        gate_up[0, :f, :d].copy_(w_gate)
        gate_up[1, :f, :d].copy_(w_up)
        down[:d, :f].copy_(w_down)
        if biases is not None:
            biases[0, :f].copy_(b_gate)
            biases[1, :f].copy_(b_up)
            down_bias[:d].copy_(b_down)
        return (gate_up[0], None if biases is None else biases[0], gate_up[1], None if biases is None else biases[1],
                down, down_bias)

    def grads(self, grads: tuple) -> tuple:
        """(dx, dw_gate, db_gate, dw_up, db_up, dw_down) of the live region of the padded ones."""
        dx, dw_gate, db_gate, dw_up, db_up, dw_down = grads
        d, f = self.d, self.f
        return (None if dx is None else dx[:, :d], None if dw_gate is None else dw_gate[:f, :d],
                None if db_gate is None else db_gate[:f], None if dw_up is None else dw_up[:f, :d],
                None if db_up is None else db_up[:f], None if dw_down is None else dw_down[:d, :f])


@dataclasses.dataclass(frozen=True)
class TrainingStep:
    """What a training forward of a gated MLP runs: its activation, the down projection's kernel (None: cuBLAS),
    the backward's choice where H is recomputed (op gated_bwd), the entry's bound launches (None while a choice
    waits for its check), and whether H is kept for the backward."""

    activation: str
    down_config: KernelConfig | None
    backward_config: object  # KernelConfig | Library | None
    launches: TrainingLaunches | None = None
    save_hidden: bool = False


# Rows of the [M, d_ff] activations a training step makes (G, U, H, dH) that are not a multiple of ALIGNED_ROW_BYTES
# long start every ACTIVATION_ROW_BYTES bytes, as Inductor lays out its buffers (comprehensive padding): cuBLAS read
# H's rows of 4872 bf16 elements (9744 bytes, 16 mod 32) in the down projection at M = 8192 in 342 us against 285
# over 128-byte rows (d_model 2368, H100), and the step ran 3-5% faster at M = 8192 (0-1% at 2048). Rows of 6384
# (12768 bytes, a multiple of 32) gained nothing: that step moved -1.8% to +2.0% between runs, so such rows stay
# dense. The pointwise passes then run over whole rows (whole_rows), padding columns included: over the live
# columns alone their masks keep Triton from loading 16 bytes at a time. A host-bound step keeps them dense
# (StepRun.padded_rows).
ALIGNED_ROW_BYTES = 32
ACTIVATION_ROW_BYTES = 128


def _padded_width(width: int, like: torch.Tensor) -> int:
    size = like.element_size()
    if width * size % ALIGNED_ROW_BYTES == 0:
        return width
    per_row = ACTIVATION_ROW_BYTES // size
    return -(-width // per_row) * per_row


def activation_buffer(M: int, width: int, like: torch.Tensor, padded_rows: bool = True) -> torch.Tensor:
    """An uninitialised [M, width] tensor like `like` whose rows start every ACTIVATION_ROW_BYTES bytes: a view of
    the first `width` columns of wider storage where width elements are not a whole number of such rows; dense
    where not `padded_rows` (a host-bound step: StepRun.padded_rows)."""
    if not padded_rows:
        return like.new_empty((M, width))
    padded = _padded_width(width, like)
    buffer = like.new_empty((M, padded))
    return buffer if padded == width else buffer[:, :width]


def whole_rows(t: torch.Tensor) -> torch.Tensor:
    """A tensor activation_buffer made, as the [M, padded width] tensor of its whole rows (its view's base); any
    other tensor as it is. A pass over whole rows computes values in the padding columns that nothing reads: every
    GEMM and every gradient of the step reads the first d_ff columns. Attribute reads only (a storage lookup per
    call cost the step's host 10-15 us at M = 2048)."""
    base = t._base
    if base is None or base.dim() != 2:
        return t
    M, width = t.shape
    if base.shape != (M, _padded_width(width, t)) or base.data_ptr() != t.data_ptr() or not base.is_contiguous():
        return t
    return base


def _training_forward(x, params: tuple, step: TrainingStep, separate: bool, w_gu: torch.Tensor | None,
                      padded_rows: bool):
    """(pre-activations, H, Y) of x and params (w_gate, b_gate, w_up, b_up, w_down, b_down): cuBLAS for the
    pre-activations, then the pointwise H and the down projection (bound where possible). The pre-activations
    are (G, U), two buffers, where `separate` (the backward then frees dG before its last GEMM); else ([G | U],
    G, U): one [M, 2F] buffer (what op gated_bwd's kernels read), formed by one GEMM where w_gu (stacked(w_gate,
    w_up)) is not None, and its two halves. G, U and H are activation buffers with padded_rows."""
    w_gate, b_gate, w_up, b_up, w_down, b_down = params
    M, F_ = x.shape[0], w_gate.shape[0]
    if separate:
        g = project_into(activation_buffer(M, F_, x, padded_rows), x, w_gate, b_gate)
        u = project_into(activation_buffer(M, F_, x, padded_rows), x, w_up, b_up)
        h, y = _hidden_and_down(g, u, w_down, b_down, step, padded_rows)
        return (g, u), h, y
    pre = pre_activations(x, w_gate, b_gate, w_up, b_up, w_gu)
    g, u = pre[:, :F_], pre[:, F_:]
    h, y = _hidden_and_down(g, u, w_down, b_down, step, False)
    return (pre, g, u), h, y


def _hidden_and_down(g, u, w_down, b_down, step: TrainingStep, buffers: bool):
    """(H, Y): H = act(G) * U by one pointwise pass and Y = H W_down^T + b_down by the tuned down projection, both
    bound launches where the step has them at this M. Where G and U are activation buffers with padded rows
    (`buffers`), H is one too and the pass runs over the three's whole rows; else (the halves of [G | U], or dense
    buffers) H is dense."""
    activation, down_config, launches = step.activation, step.down_config, step.launches
    M, F_ = g.shape
    h = activation_buffer(M, F_, g) if buffers else g.new_empty((M, F_))
    # G, U and H are activation buffers of one width alike where `buffers`: passes run over their whole rows.
    whole = {"g": whole_rows(g), "u": whole_rows(u), "h": whole_rows(h)} if buffers else {"g": g, "u": u, "h": h}
    if launches is None or launches.M != M:
        gated_activation(whole["g"], whole["u"], activation, out=whole["h"])
        return h, _project(h, w_down, b_down, None, down_config)
    launches.run("gated_act", whole, [], lambda: gated_activation(whole["g"], whole["u"], activation, out=whole["h"]))
    if down_config is None:  # a library path: nothing to bind
        return h, _project(h, w_down, b_down, None, None)
    y = h.new_empty((M, w_down.shape[0]))
    launches.run("down", {"x": h, "y": y}, launch.addresses((w_down, b_down)),
                 lambda: linear(h, w_down, b_down, None, "none", down_config, out=y))
    return h, y


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


def _keep_for_backward(ctx, saved: tuple, kept: tuple) -> None:
    """save_for_backward(*saved), and the activations `kept` on ctx (intermediates, neither input nor output: no
    reference cycle), so that the backward frees each once it is spent: saved through save_for_backward they would
    live until the backward returns. Where saved-tensor hooks are active (activation checkpointing, offloading)
    `kept` goes through save_for_backward too, so that the hooks see them."""
    if _saved_tensor_hooks_active():
        ctx.save_for_backward(*saved, *kept)
        ctx.kept = None
    else:
        ctx.save_for_backward(*saved)
        ctx.kept = list(kept)


def _take_kept(ctx, saved_rest: list) -> list:
    """The activations _keep_for_backward kept, from ctx or from the saved tensors after `saved` (`saved_rest`, emptied
    here): the returned list then holds the backward's only references, which its callee drops as it goes."""
    kept = list(saved_rest) if ctx.kept is None else ctx.kept
    ctx.kept = None
    saved_rest.clear()
    return kept


def _backward_dy(ctx, dy: torch.Tensor) -> list:
    """dY as the backward's GEMMs read it (padded to D columns where the step runs padded), in a list the callee
    empties once dY is spent: a padded copy of dY ([M, D], which the engine's own dY does not keep alive) is then
    freed before the weight gradients' GEMMs, whose last one is the step's peak."""
    padding = ctx.padding
    return [dy.contiguous() if padding is None else pad_columns(dy, padding.D)]


class MLPFunction(torch.autograd.Function):
    """y = down(act(gate(x)) * up(x)) for training; see the module docstring for what runs where."""

    @staticmethod
    def forward(ctx, x, *params_and_run):
        """apply(x, w_gate, b_gate, w_up, b_up, w_down, b_down, run: StepRun, layout: TrainingLayout | None):
        run.form other than THREE_NODES."""
        *params, (step, form, padding, padded_rows), layout = params_and_run
        launches = step.launches
        checked = (params[0], params[2], params[4])  # the weights whose versions the backward checks
        if padding is not None:  # unaligned d_model or d_ff: the step runs in the padded space
            params = padding.params(tuple(params), launches, layout)
            x = pad_columns(x, padding.D)
        w_gate, b_gate, w_up, b_up, w_down, b_down = params
        separate = form == TWO_BUFFERS
        # The gate and up weights as one [2F, D] tensor where they are the halves of one buffer (the training
        # layout): the forward's G | U and the backward's dX each read it by one GEMM.
        w_gu = None
        if not separate:
            w_gu = stacked(w_gate, w_up) if launches is None else launches.stacked_weights(w_gate, w_up)
        pre, h, y = _training_forward(x, tuple(params), step, separate, w_gu, padded_rows)
        ctx.w_gu, ctx.padded_rows = w_gu, padded_rows and separate
        ctx.padding, ctx.launches = padding, launches
        ctx.activation, ctx.backward_config = step.activation, step.backward_config
        ctx.has_bias = b_gate is not None
        ctx.spent = False
        # Padded: the copies (Padding.params) are held by the module and written again by its next forward, so a
        # second forward before this backward (two losses summed, a module used twice) would fail their version
        # check though their values stay the parameters'; the parameters themselves are saved instead, checked
        # as eager checks them, and the backward reads the copies from ctx.
        ctx.run_weights = None if padding is None else (w_gate, w_up, w_down)
        saved = (x, *checked)
        ctx.halves = None
        if form == RECOMPUTE_H:
            ctx.kept = None
            ctx.save_for_backward(*saved, pre[0])  # [G | U], overwritten by the backward with [dG | dU]
        elif separate:  # G and U, then H
            _keep_for_backward(ctx, saved, (*pre, h))
        else:  # [G | U], then H; its halves, the forward's views, kept for the backward's pass where nothing else is
            _keep_for_backward(ctx, saved, (pre[0], h))
            if ctx.kept is not None:  # (saved-tensor hooks would not see them)
                ctx.halves = pre[1:]
        return y if padding is None else y[:, :padding.d]

    @staticmethod
    def backward(ctx, dy):
        _refuse_double_backward()
        _refuse_second_backward(ctx)
        x, w_gate, w_up, w_down, *saved = ctx.saved_tensors
        if ctx.run_weights is not None:
            w_gate, w_up, w_down = ctx.run_weights
            ctx.run_weights = None
        padding = ctx.padding
        need = ctx.needs_input_grad  # (x, w_gate, b_gate, w_up, b_up, w_down, b_down, run)
        db_down = sum_rows(dy) if ctx.has_bias and need[6] else None
        dys = _backward_dy(ctx, dy)
        del dy
        if len(saved) == 1:  # save_hidden False: one [G | U] buffer, H recomputed
            grads = _backward_recomputing_h(ctx, dys, x, saved.pop(), w_gate, w_up, w_down, need)
        else:
            grads = _backward_from_kept_h(ctx, dys, x, _take_kept(ctx, saved), (w_gate, w_up, w_down), need)
        if padding is not None:
            grads = padding.grads(grads)
        return (*grads, db_down, None, None)


def separate_weight_gradients(M: int, d_model: int, d_ff: int) -> bool:
    """Whether a training step whose forward keeps H returns each weight's gradient from an autograd node of its own
    (mlp_training), at the sizes the step runs at (training.Padding's). With X, A and W the bytes of one [M, d_model],
    one [M, d_ff] and one weight: one node returning dWd, dWg and dWu together peaks at its last GEMM, holding all three
    beside Y, dX and dU (2X + 3W + A), while a graph of one node per GEMM (eager's, Liger's) peaks at its down
    projection's, holding G, U, H, dH, Y and dWd (4A + X + W), since the engine adds each weight gradient into .grad
    and frees it as soon as its node returns. Where X + 2W > 3A one node would hold more than such a graph, and
    the split's peak, its dH GEMM's (3A + X + W), is below both: 3200 -> 6655 at M = 2048 held 132 MiB split, 174 as
    one node, Liger 157 (H100). Only where the GEMMs hide two more autograd Functions' host time
    (DecisionPolicy.host_bound_step_macs); elsewhere the step stays one node."""
    if M * d_model * d_ff < current_policy().host_bound_step_macs:
        return False
    return M * d_model + 2 * d_ff * d_model > 3 * M * d_ff


def stacked_pre_activations(M: int, d_model: int, d_ff: int) -> bool:
    """Whether a training step that keeps H (as one MLPFunction) holds G | U as one [M, 2 d_ff] buffer, at the sizes
    the step runs at: one cuBLAS GEMM forms both, one dX and one [dWg; dWu], three calls fewer a step than two buffers
    take, which in turn let the backward free dG before its last GEMM. With X, A and W as in
    separate_weight_gradients, the one buffer's step peaks at 2A + X + 3W, min(A, W) above the two buffers' and at
    most an eager graph's 4A + X + W (Inductor's and Liger's steps held the same) where W <= A, that is d_model <= M.
    Chosen where the step is host-bound (M d_model d_ff below DecisionPolicy.host_bound_step_macs), so that the calls
    it saves are what the step's time is made of, and the weights weigh no more than the activations."""
    return d_model <= M and M * d_model * d_ff < current_policy().host_bound_step_macs


class ProjectionFunction(torch.autograd.Function):
    """Z = x W^T + b by cuBLAS into an activation buffer, an autograd node whose backward returns W's and b's
    gradients alone (x's comes from HiddenDownFunction, which reads these weights too, so the engine adds nothing).
    apply(x_run, weight, bias, weight_run, bias_run, live): the GEMMs read x_run, weight_run and bias_run (the padded
    space's, training.Padding); the gradients go to weight and bias, of their `live` (rows, columns) where padded."""

    @staticmethod
    def forward(ctx, x_run, weight, bias, weight_run, bias_run, live):
        ctx.live, ctx.has_bias = live, bias is not None
        ctx.save_for_backward(x_run)
        return project_into(activation_buffer(x_run.shape[0], weight_run.shape[0], x_run), x_run, weight_run,
                            bias_run)

    @staticmethod
    def backward(ctx, dz):
        _refuse_double_backward()
        x_run, = ctx.saved_tensors
        need = ctx.needs_input_grad  # (x_run, weight, bias, weight_run, bias_run, live)
        dw = torch.mm(dz.t(), x_run) if need[1] else None
        db = sum_rows(dz) if ctx.has_bias and need[2] else None
        if ctx.live is not None:
            rows, columns = ctx.live
            dw = None if dw is None else dw[:rows, :columns]
            db = None if db is None else db[:rows]
        return None, dw, db, None, None, None


class RunWeights(NamedTuple):
    """The weights a HiddenDownFunction's GEMMs read: the parameters, or their copies in the padded space (padding
    not None), and the gate and up parameters themselves (`checked`: where the GEMMs read copies, the backward checks
    their versions, as eager does). Passed as one argument, not as inputs: the gradients go to the parameters."""

    padding: Padding | None
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    b_down: torch.Tensor | None
    checked: tuple = ()


class HiddenDownFunction(torch.autograd.Function):
    """Y = down(act(G) * U) of the G and U two ProjectionFunctions made: the MLP's node where its weight gradients
    are nodes of their own (separate_weight_gradients). Its backward returns dX, dG and dU (written over G and U)
    and the down projection's gradients. apply(x, g, u, w_down, b_down, run, step): the GEMMs read run's weights."""

    @staticmethod
    def forward(ctx, x, g, u, w_down, b_down, run: RunWeights, step):
        padding, w_gate_run, w_up_run, w_down_run, b_down_run, checked = run
        h, y = _hidden_and_down(g, u, w_down_run, b_down_run, step, True)
        ctx.padding, ctx.launches, ctx.activation = padding, step.launches, step.activation
        ctx.has_bias = b_down is not None
        ctx.spent = False
        # Padded: the parameters saved for their version check, the copies read from ctx (MLPFunction.forward says why).
        ctx.run_weights = None if padding is None else (w_gate_run, w_up_run, w_down_run)
        weights = (w_gate_run, w_up_run, w_down_run) if padding is None else (*checked, w_down)
        _keep_for_backward(ctx, (*weights, g, u), (h,))  # H freed once dWd is formed
        return y if padding is None else y[:, :padding.d]

    @staticmethod
    def backward(ctx, dy):
        _refuse_double_backward()
        _refuse_second_backward(ctx)
        w_gate, w_up, w_down, g, u, *saved = ctx.saved_tensors
        if ctx.run_weights is not None:
            w_gate, w_up, w_down = ctx.run_weights
            ctx.run_weights = None
        padding = ctx.padding
        need = ctx.needs_input_grad  # (x, g, u, w_down, b_down, ...)
        db_down = sum_rows(dy) if ctx.has_bias and need[4] else None
        dys = _backward_dy(ctx, dy)
        del dy
        dw_down = _down_then_pass(ctx, dys, _take_kept(ctx, saved), g, u, w_down, need[3])
        dx = _input_gradient(g, u, w_gate, w_up) if need[0] else None
        if padding is not None:
            dx = None if dx is None else dx[:, :padding.d]
            dw_down = None if dw_down is None else dw_down[:padding.d, :padding.f]
        return dx, g if need[1] else None, u if need[2] else None, dw_down, db_down, None, None


# The forms of a gated MLP's training step (step_form).
RECOMPUTE_H = "recompute-h"  # save_hidden False: one [G | U] buffer kept, H recomputed by op gated_bwd's choice
THREE_NODES = "three-nodes"  # H kept; each weight's gradient from an autograd node of its own
ONE_BUFFER = "one-buffer"  # H kept, one MLPFunction over one [G | U] buffer
TWO_BUFFERS = "two-buffers"  # H kept, one MLPFunction over G and U as two buffers


def step_form(M: int, d_model: int, d_ff: int, save_hidden: bool) -> str:
    """The form a training step of a gated MLP takes at the sizes it runs at (training.Padding's): the one place that
    decides it, by the module's save_hidden, separate_weight_gradients and stacked_pre_activations."""
    if not save_hidden:
        return RECOMPUTE_H
    if separate_weight_gradients(M, d_model, d_ff):
        return THREE_NODES
    return ONE_BUFFER if stacked_pre_activations(M, d_model, d_ff) else TWO_BUFFERS


class StepRun(NamedTuple):
    """What a training forward of a gated MLP runs at its M: the entry's TrainingStep, its step_form, the Padding of
    its sizes (None where aligned) and whether its activation buffers' rows are padded (activation_buffer). Decided
    by step_run once per M and entry (the module keeps the last)."""

    step: TrainingStep
    form: str
    padding: Padding | None
    padded_rows: bool


def step_run(M: int, w_gate: torch.Tensor, step: TrainingStep) -> StepRun:
    """A host-bound step (M d_model d_ff below DecisionPolicy.host_bound_step_macs) keeps its activations dense: the
    padded rows' views and their whole rows cost its host about 140 us a step at 2368 -> 4872, M = 2048 (H100: a
    torch.empty, a view and a base lookup each 12-22 us there) for 0-1% of GPU time."""
    padding = Padding.of(w_gate)
    f, d = w_gate.shape
    D, W = row_width(d), row_width(f)
    return StepRun(step, step_form(M, D, W, step.save_hidden), padding,
                   M * D * W >= current_policy().host_bound_step_macs)


def mlp_training(x: torch.Tensor, params: tuple, run: StepRun, layout: TrainingLayout | None = None) -> torch.Tensor:
    """The training forward of a gated MLP (params: w_gate, b_gate, w_up, b_up, w_down, b_down) as `run` says:
    two ProjectionFunctions and a HiddenDownFunction (form THREE_NODES), else the one MLPFunction. `layout`: the
    module's TrainingLayout, whose views a padded step reads in place of copies (Padding.params)."""
    step, form, padding, _ = run  # three nodes: never host-bound (separate_weight_gradients), rows padded
    if form != THREE_NODES:
        return MLPFunction.apply(x, *params, run, layout)
    f, d = params[0].shape
    read, x_run, live = params, x, None  # what the GEMMs read
    if padding is not None:  # the padded space's copies: data for the GEMMs, outside the graph
        with torch.no_grad():
            read = padding.params(tuple(params), step.launches, layout)
            x_run = pad_columns(x.detach(), padding.D)
        live = (f, d)
    w_gate, b_gate, w_up, b_up, w_down, b_down = params
    g = ProjectionFunction.apply(x_run, w_gate, b_gate, read[0], read[1], live)
    u = ProjectionFunction.apply(x_run, w_up, b_up, read[2], read[3], live)
    return HiddenDownFunction.apply(x, g, u, w_down, b_down,
                                    RunWeights(padding, read[0], read[2], read[4], read[5], (w_gate, w_up)), step)


def _gradients_over(launches: TrainingLaunches | None, activation: str, dh: torch.Tensor, g: torch.Tensor,
                    u: torch.Tensor, buffers: bool) -> None:
    """dG and dU written over g and u by op gated_dgu: a bound launch like the forward's passes where the entry
    has launches at this M; over whole rows where g and u are `buffers` (not the halves of one [G | U]) and all
    three are activation buffers padded alike (whole_rows)."""
    if buffers:
        whole = [whole_rows(t) for t in (dh, g, u)]
        if len({t.shape for t in whole}) == 1:
            dh, g, u = whole
    if launches is None or launches.M != dh.shape[0]:
        gated_gradient_kept(dh, g, u, activation, out=(g, u))
        return
    launches.run("gated_dgu", {"dh": dh, "g": g, "u": u, "dg": g, "du": u}, [],
                 lambda: gated_gradient_kept(dh, g, u, activation, out=(g, u)))


def _down_then_pass(ctx, dys: list, hidden: list, g: torch.Tensor, u: torch.Tensor, w_down: torch.Tensor,
                    need_down: bool, buffers: bool = True) -> torch.Tensor | None:
    """dWd = dY^T H (None where W_down needs no gradient), then H freed; cuBLAS dH = dY W_down, then dY freed, and
    one pass writing dG, dU over G, U (two activation buffers with padded rows; the halves of one, or dense buffers,
    where not `buffers`, dH dense then too). dY and H come as the one item of `dys` and `hidden`, which are emptied
    here, so that each buffer is freed once spent (dH then takes H's place)."""
    h = hidden.pop()
    dy = dys.pop()
    dw_down = torch.mm(dy.t(), h) if need_down else None
    del h
    dh = torch.mm(dy, w_down, out=activation_buffer(dy.shape[0], w_down.shape[1], dy, buffers))
    del dy
    _gradients_over(ctx.launches, ctx.activation, dh, g, u, buffers)
    return dw_down


def _backward_from_kept_h(ctx, dys: list, x, kept: list, weights: tuple, need) -> tuple:
    """The gradients of x, w_gate, b_gate, w_up, b_up, w_down from dY (`dys`, its one item) and the forward's G,
    U, H (`kept`: G and U two buffers, or [G | U] one, then H); both lists are emptied here, so that each buffer is
    freed once spent: dWd and dG, dU over G, U (_down_then_pass), then dX, and each weight's gradient. From two
    buffers, each weight's gradient with its pre-activation gradient freed right after: the last GEMM holds dU alone,
    not [dG | dU]; from one, the GEMMs over [dG | dU] (_stacked_gradients)."""
    w_gate, w_up, w_down = weights
    *pre, h = kept
    kept.clear()
    hidden = [h]
    del h
    if len(pre) == 1:
        gu = pre.pop()
        halves = ctx.halves
        ctx.halves = None
        if halves is None:
            F_ = w_gate.shape[0]
            halves = gu[:, :F_], gu[:, F_:]
        dw_down = _down_then_pass(ctx, dys, hidden, *halves, w_down, need[5], False)
        return _stacked_gradients(ctx, gu, x, w_gate, w_up, need, dw_down)
    g, u = pre
    pre.clear()
    dw_down = _down_then_pass(ctx, dys, hidden, g, u, w_down, need[5], ctx.padded_rows)
    dg, du = g, u
    del g, u  # dg and du are now the only references to those two buffers
    dx = _input_gradient(dg, du, w_gate, w_up) if need[0] else None
    db_gate = sum_rows(dg) if ctx.has_bias and need[2] else None
    db_up = sum_rows(du) if ctx.has_bias and need[4] else None
    dw_gate = torch.mm(dg.t(), x) if need[1] else None
    del dg
    dw_up = torch.mm(du.t(), x) if need[3] else None
    return dx, dw_gate, db_gate, dw_up, db_up, dw_down


def _input_gradient(dg: torch.Tensor, du: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """dX = dG W_gate + dU W_up: two cuBLAS calls, the second accumulating into the first's result."""
    dx = torch.mm(dg, w_gate)
    return dx.addmm_(du, w_up)


def _stacked_gradients(ctx, dgu: torch.Tensor, x, w_gate, w_up, need, dw_down) -> tuple:
    """(dx, dw_gate, db_gate, dw_up, db_up, dw_down) from [dG | dU] (one [M, 2F] buffer): one GEMM for dX where the
    weights are stacked (ctx.w_gu, the forward's; else two), one for [dWg; dWu], one row sum for both biases."""
    F_ = w_gate.shape[0]
    dx = None
    if need[0]:
        w_gu = ctx.w_gu
        if w_gu is not None:  # the training layout: one GEMM over d_ff twice
            dx = torch.mm(dgu, w_gu)
        else:
            dx = _input_gradient(dgu[:, :F_], dgu[:, F_:], w_gate, w_up)
    dw_gate = dw_up = None
    if need[1] or need[3]:
        dw = torch.mm(dgu.t(), x)  # one GEMM: [dW_gate; dW_up]
        dw_gate, dw_up = (dw[:F_] if need[1] else None), (dw[F_:] if need[3] else None)
    db_gate = db_up = None
    if ctx.has_bias and (need[2] or need[4]):
        db = sum_rows(dgu)
        db_gate, db_up = db[:F_], db[F_:]
    return dx, dw_gate, db_gate, dw_up, db_up, dw_down


def _backward_recomputing_h(ctx, dys: list, x, gu, w_gate, w_up, w_down, need) -> tuple:
    """The gradients of x, w_gate, b_gate, w_up, b_up, w_down from dY (`dys`, its one item, emptied here) and
    the forward's [G | U], whose H was not kept: op gated_bwd's tuned choice writes dG | dU over G | U and
    recomputes H; dWd, then H and dY freed; then the GEMMs over dG | dU (one each where the weights are
    stacked)."""
    dy = dys.pop()
    config = ctx.backward_config
    if isinstance(config, KernelConfig):
        dgu, h = gated_backward(dy, gu, w_down, ctx.activation, config, out=(gu, None))
    else:  # a library path (None: eager), where tuning or a check chose one for this shape
        library = LIBRARY_BACKWARDS["eager" if config is None else config.name]
        dgu, h = library(dy, gu, w_down, ctx.activation, out=(gu, None))
    dw_down = torch.mm(dy.t(), h) if need[5] else None
    del h, dy  # first, so that the [M, F] H is freed before the next GEMMs allocate
    return _stacked_gradients(ctx, dgu, x, w_gate, w_up, need, dw_down)
