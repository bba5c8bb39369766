"""Dispatch: running a table of choices (choose/plans.py decides them) and the bound entries that replay
it. The eager modules (modules.py) and the torch.library ops (custom_ops.py) share these, so both run the
same code. `call` runs any registered op the same way, with the same decision (a check included).
"""

from __future__ import annotations

import torch

from . import launch, ops, workspaces
from .choose import Choice, resolve_checked
from .configs import KernelConfig
from .key import Problem
from .layout import aligned_width
from .ops.gated_pairs import pairs_of
from .ops.linear import linear
from .ops.linear_fp8 import Fp8Weight, linear_fp8
from .ops.linear_w8a8 import linear_w8a8
from .ops.mlp import mlp_decode


def _traced(name: str, activation: str, table: dict[str, Choice]):
    """A profiler range naming what runs (op, activation, each choice) while a profiler records, e.g.
    "autofuse::mlp gelu_tanh [gated_up 128x128x64 g8 w8 s4 tma; down library:eager]"; else None."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return None
    choices = "; ".join(f"{op} {c.config.short()}" for op, c in table.items())
    return torch.profiler.record_function(f"autofuse::{name} {activation} [{choices}]")


def linear_op(weight) -> str:
    """The op a Linear's weight runs through: `weight` is W (linear), or an Fp8Weight, which names its op (linear_fp8,
    or linear_w8a8 where the activations are quantized too)."""
    return weight.op if isinstance(weight, Fp8Weight) else "linear"


def linear_operands(x2d, weight, bias, r2d) -> dict:
    """A Linear's operands as its op names them (a library candidate takes them so)."""
    if isinstance(weight, Fp8Weight):
        return {"x": x2d, "w": weight.w8, "s": weight.scale, "b": bias, "r": r2d}
    return {"x": x2d, "w": weight, "b": bias, "r": r2d}


def run_linear_kernel(x2d, weight, bias, r2d, activation: str, config: KernelConfig, out=None) -> torch.Tensor:
    """The linear kernel, or the fp8 one of `weight`'s op (linear_op)."""
    if not isinstance(weight, Fp8Weight):
        return linear(x2d, weight, bias, r2d, activation, config, out=out)
    run = linear_w8a8 if ops.get(weight.op).weights == "w8a8" else linear_fp8  # linear_* or down_* of the format
    return run(x2d, weight.w8, weight.scale, bias, r2d, activation, config, out=out)


def run_linear(x2d, weight, bias, r2d, activation: str, table: dict[str, Choice]) -> torch.Tensor:
    traced = _traced(linear_op(weight), activation, table)
    if traced is not None:
        with traced:
            return _run_linear(x2d, weight, bias, r2d, activation, table["linear"])
    return _run_linear(x2d, weight, bias, r2d, activation, table["linear"])


def _run_linear(x2d, weight, bias, r2d, activation, choice: Choice):
    config = choice.kernel
    if config is None:
        return _library(linear_op(weight), choice, linear_operands(x2d, weight, bias, r2d), activation)
    return run_linear_kernel(x2d, weight, bias, r2d, activation, config)


def run_mlp(x2d, params: tuple, activation: str, table: dict[str, Choice]) -> torch.Tensor:
    """params: (wg, bg, wu, bu, wd, bd)."""
    traced = _traced("mlp", activation, table)
    if traced is not None:
        with traced:
            return _run_mlp(x2d, params, activation, table)
    return _run_mlp(x2d, params, activation, table)


def _run_mlp(x2d, params: tuple, activation: str, table: dict[str, Choice]):
    if "mlp" in table:
        return mlp_decode(x2d, params, activation, table["mlp"].kernel)
    h = run_up(x2d, params, activation, table, out=new_hidden(x2d, x2d.shape[0], params))
    return run_down(h, params, table["down"])


def _library(op: str, choice: Choice, operands: dict, activation: str) -> torch.Tensor:
    """The op's library candidate that `choice` names, on operands named as its OpSpec names them."""
    return ops.get(op).library_candidate(choice.config.name)(operands, activation)


def run_choice(op: str, choice: Choice, operands: dict, activation: str, out: torch.Tensor | None = None):
    """Run one op's choice on operands named as its OpSpec names them."""
    if isinstance(choice.config, KernelConfig):
        return ops.get(op).run(operands, activation, choice.config, out=out)
    return _library(op, choice, operands, activation)


def call(op: str, operands: dict, *, activation: str, bias: bool = False, residual: bool = False,
         tuned: bool = True) -> torch.Tensor:
    """Run any registered op on its operands (named as its OpSpec names them), with the choice resolved
    for their shape: the first operand is the [M, k] activations, n is the leading dimension of the
    first [n, k] weight after it. For ops that no module wraps, e.g. one added outside autofuse."""
    spec = ops.get(op)
    x = next(iter(operands.values()))
    M, k = x.shape
    n = _n_of(spec, operands, k)
    choice = resolve_checked(Problem(op, n, k, M, x.dtype, activation, bias, residual, x.device), tuned)
    return run_choice(op, choice, operands, activation)


def _n_of(spec, operands: dict, k: int) -> int:
    for name, t in list(operands.items())[1:]:
        if t is not None and t.dim() == 2 and t.shape[1] == k:
            return t.shape[0]
    raise ValueError(f"op {spec.name}: cannot tell n from operands {list(operands)}")


def _replayable(inside_ops: bool) -> bool:
    # Entries of the modules replay outside torch.library ops (custom_ops.py keeps its own entries,
    # whose workspaces and H are allocated per call); none replays under a profiler (which wants
    # the ranges of run_mlp / run_linear).
    return inside_ops == workspaces.per_call() and not torch.autograd.profiler._is_profiler_enabled


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


class BoundMLP:
    """A gated MLP's table entry at one M: run through the JIT on its first call while each op's
    kernel launch is bound, and replayed from them afterwards (bound.BoundLaunch): per call only the
    input, H and the output change. A launch that declines falls back to its op's JIT launcher; a
    library choice runs as it is."""

    def __init__(self, table: dict[str, Choice], activation: str, M: int, inside_ops: bool = False) -> None:
        self.table, self.activation, self.M = table, activation, M
        # Inside the torch.library ops: launches with a split-K workspace are not bound, H is not kept
        # (CUDA-graph trees allow no persistent allocation in their pool).
        self.inside_ops = inside_ops
        self.launches: dict | None = None
        self.weights: list = []
        # H between the two kernels, reused call after call: replays run in order on the stream
        # they were bound to, so the next call's writes come after this call's reads.
        self.hidden: tuple[int, torch.Tensor] | None = None  # (stream, H)

    def __call__(self, x: torch.Tensor, params: tuple, weights: list, M: int, out_shape: tuple) -> torch.Tensor:
        """x: [..., d_model] with M rows; params: (wg, bg, wu, bu, wd, bd), each weight W or, for fp8 weights, an
        Fp8Weight; weights: the parameters' addresses."""
        replayable = M == self.M and _replayable(self.inside_ops)
        if replayable and self.launches is not None and weights == self.weights:
            return self._replay(x, params, out_shape)
        x2d = _rows(x)
        if not replayable:
            return as_output(run_mlp(x2d, params, self.activation, self.table), out_shape)
        y, self.launches = self._bind(x2d, params)
        self.weights = weights
        # Not while a CUDA graph captures: the buffer would live in the graph's private pool.
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if not (capturing or self.inside_ops):
            self.hidden = (workspaces.stream_id(x.device), new_hidden(x, M, params))
        return as_output(y, out_shape)

    def _bind(self, x2d, params) -> tuple[torch.Tensor, dict]:
        act, table = self.activation, self.table
        if "mlp" in table:
            with launch.binding() as recorded:
                y = mlp_decode(x2d, params, act, table["mlp"].kernel)
            return y, {"mlp": launch.only_launch(recorded)}
        up, down = table[up_op_of(table)], table["down"]
        with launch.binding() as up_launches:
            h = run_up(x2d, params, act, table, out=new_hidden(x2d, self.M, params))
        with launch.binding() as down_launches:
            y = run_down(h, params, down)
        return y, {"up": None if up.kernel is None else launch.only_launch(up_launches),
                   "down": None if down.kernel is None else launch.only_launch(down_launches)}

    def _replay(self, x, params, out_shape) -> torch.Tensor:
        wd, bd = params[4], params[5]
        act, table, launches = self.activation, self.table, self.launches
        if "mlp" in table:
            y = x.new_empty(out_shape)
            bound = launches["mlp"]
            if bound is None or not bound({"x": x, "y": y}):
                mlp_decode(_rows(x), params, act, table["mlp"].kernel, out=_rows(y))
            return y
        # H is reused on the stream it was made on; a call on another stream (which might run at the
        # same time) gets its own.
        hidden = self.hidden
        if hidden is not None and hidden[0] == workspaces.stream_id(x.device):
            h = hidden[1]
        else:
            h = new_hidden(x, self.M, params)
        bound = launches["up"]
        if bound is None or not bound({"x": x, "h": h}):
            h = run_up(_rows(x), params, act, table, out=h)
        bound = launches["down"]
        if bound is None:
            return as_output(run_down(h, params, table["down"]), out_shape)
        y, padded = _output_for(x, out_shape, self.M, weight_rows(wd))
        if not bound({"x": h, "y": y}):
            run_linear_kernel(h, wd, bd, None, "none", table["down"].kernel, out=_rows(y))
        return as_output(y, out_shape) if padded else y


def weight_rows(w) -> int:
    """The rows (output width) of a weight W or an Fp8Weight."""
    return (w.w8 if isinstance(w, Fp8Weight) else w).shape[0]


def _output_for(x: torch.Tensor, out_shape: tuple, M: int, n: int) -> tuple[torch.Tensor, bool]:
    """(the buffer a replayed launch writes, whether it is padded): out_shape itself, or [M, n] where the launch runs
    at a padded output width n (layout.py), whose first out_shape[-1] columns as_output gives back."""
    if n == out_shape[-1]:
        return x.new_empty(out_shape), False
    return x.new_empty((M, n)), True


def as_output(y: torch.Tensor, out_shape: tuple) -> torch.Tensor:
    """A Linear's or an MLP's down projection's [M, n] output as the module's output: its first out_shape[-1]
    columns where it ran at a padded width (layout.py; a view, no copy), reshaped to out_shape."""
    if y.shape[-1] != out_shape[-1]:
        y = y[:, :out_shape[-1]]
    return y if len(out_shape) == 2 else y.reshape(out_shape)  # a reshape that changes nothing costs host time


def up_op_of(table: dict[str, Choice]) -> str:
    """Which op computes H in a two-op table: gated_up, or gated_pairs over an interleaved layout."""
    return "gated_pairs" if "gated_pairs" in table else "gated_up"


def run_up(x2d, params, activation: str, table: dict[str, Choice], out: torch.Tensor | None = None) -> torch.Tensor:
    """H through the table's gated_up or gated_pairs choice (the Fp8Weights' op where the weights are fp8), written
    into `out` where the choice is a kernel (a library choice returns its own)."""
    wg, bg, wu, bu = params[:4]
    if isinstance(wg, Fp8Weight):
        operands = {"x": x2d, "wg": wg.w8, "wu": wu.w8, "sg": wg.scale, "su": wu.scale, "bg": bg, "bu": bu}
        return run_choice(wg.op, table["gated_up"], operands, activation, out)
    if "gated_pairs" in table:
        w, b = pairs_of(wg, bg)
        return run_choice("gated_pairs", table["gated_pairs"], {"x": x2d, "w": w, "b": b}, activation, out)
    return run_choice("gated_up", table["gated_up"], {"x": x2d, "wg": wg, "wu": wu, "bg": bg, "bu": bu}, activation,
                      out)


def run_down(h, params, down: Choice) -> torch.Tensor:
    wd, bd = params[4:]
    if down.kernel is None:
        op = wd.op if isinstance(wd, Fp8Weight) else "down"
        return _library(op, down, linear_operands(h, wd, bd, None), "none")
    return run_linear_kernel(h, wd, bd, None, "none", down.kernel)


def new_hidden(like: torch.Tensor, M: int, params: tuple) -> torch.Tensor:
    """An empty H [M, d_ff] for an MLP's params in `like`'s dtype and device, its rows layout.aligned_width(d_ff)
    elements apart. The down projection reads H along its rows, and rows of d_ff = 27640 bf16 elements (a stride
    not divisible by 16) load one element at a time: the fp8 down projection of 6480 -> 27640 at M = 16 ran 153 us
    on them (H100). Dense MLPs already run at a width that is a multiple of 16 (layout.run_width), where this
    changes nothing."""
    width = hidden_width(params)
    return like.new_empty((M, aligned_width(width)))[:, :width]


def hidden_width(params: tuple) -> int:
    """d_ff of an MLP's params (wg, bg, wu, bu, wd, bd), each weight W or an Fp8Weight."""
    return weight_rows(params[0])


class BoundLinear:
    """A Linear's table entry at one M, bound like BoundMLP: per call only the input, residual and
    output change. A library choice is called directly (no launch to bind). `op`: linear, or linear_fp8, whose
    calls take the weight as (W8, s)."""

    def __init__(self, table: dict[str, Choice], activation: str, M: int, inside_ops: bool = False,
                 op: str = "linear") -> None:
        self.table, self.activation, self.M, self.inside_ops = table, activation, M, inside_ops
        choice = table["linear"]
        self.kernel = choice.kernel
        self.library = None if self.kernel is not None else ops.get(op).library_candidate(choice.config.name)
        self.launch = None
        self.weights: list = []

    def __call__(self, x, weight, bias, residual, weights: list, M: int, out_shape: tuple) -> torch.Tensor:
        bound = self.launch
        replayable = M == self.M and _replayable(self.inside_ops)
        if replayable and bound is not None and weights == self.weights:
            y, padded = _output_for(x, out_shape, self.M, weight_rows(weight))
            if not bound({"x": x, "r": residual, "y": y}):
                r2d = None if residual is None else _rows(residual)
                run_linear_kernel(_rows(x), weight, bias, r2d, self.activation, self.kernel, out=_rows(y))
            return as_output(y, out_shape) if padded else y
        x2d, r2d = _rows(x), None if residual is None else _rows(residual)
        if self.library is not None and not torch.autograd.profiler._is_profiler_enabled:
            return as_output(self.library(linear_operands(x2d, weight, bias, r2d), self.activation), out_shape)
        if self.kernel is None or not replayable:
            return as_output(run_linear(x2d, weight, bias, r2d, self.activation, self.table), out_shape)
        with launch.binding() as recorded:
            y = run_linear_kernel(x2d, weight, bias, r2d, self.activation, self.kernel)
        self.launch, self.weights = launch.only_launch(recorded), weights
        return as_output(y, out_shape)
