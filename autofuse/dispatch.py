"""Choose and dispatch: which kernel or library path each op of a module runs at an M (a config
table), and running it. The eager modules (modules.py) and the torch.library ops (custom_ops.py)
share these functions, so both run the same code. `call` runs any registered op the same way.
"""

from __future__ import annotations

import torch

from . import ops
from .configs import KernelConfig
from .key import MAX_M_BUCKET, m_bucket
from .ops.gated_up import gated_up
from .ops.linear import linear
from .ops.mlp import MLP, mlp_decode
from .resolve import Choice, resolve, resolve_tuned


def table_key(M: int, weight: torch.Tensor) -> tuple:
    """What a resolved config table depends on: M itself up to the largest bucket (a user may have
    tuned that exact token count), then its bucket; the weights' dtype and device."""
    return (M if M <= MAX_M_BUCKET else m_bucket(M), weight.dtype, weight.device)


def linear_choices(in_features: int, out_features: int, activation: str, bias: bool, residual: bool, M: int,
                   dtype: torch.dtype, device: torch.device, tuned: bool) -> dict[str, Choice]:
    return {"linear": resolve("linear", M, out_features, in_features, dtype, device, activation=activation,
                              bias=bias, residual=residual, tuned=tuned)}


def mlp_choices(d_model: int, d_ff: int, activation: str, bias: bool, M: int, dtype: torch.dtype,
                device: torch.device, tuned: bool) -> dict[str, Choice]:
    """{"gated_up", "down"}, or {"mlp"} where the one-launch kernel was tuned faster than the two
    tuned ops together (and than their library paths)."""
    pair = {
        "gated_up": resolve("gated_up", M, d_ff, d_model, dtype, device, activation=activation, bias=bias,
                            tuned=tuned),
        "down": resolve("down", M, d_model, d_ff, dtype, device, activation="none", bias=bias, tuned=tuned),
    }
    if not tuned or M > MLP.max_m:
        return pair
    fused = resolve_tuned("mlp", M, d_ff, d_model, dtype, device, activation=activation, bias=bias)
    if fused is None or fused.kernel is None:
        return pair
    pair_ms = [c.time_ms for c in pair.values()]
    if None not in pair_ms and sum(pair_ms) <= fused.time_ms:
        return pair
    return {"mlp": fused}


def _traced(name: str, activation: str, table: dict[str, Choice]):
    """A profiler range naming what runs (op, activation, each choice) while a profiler records, e.g.
    "autofuse::mlp gelu_tanh [gated_up 128x128x64 g8 w8 s4 tma; down library:eager]"; else None."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return None
    choices = "; ".join(f"{op} {c.config.short()}" for op, c in table.items())
    return torch.profiler.record_function(f"autofuse::{name} {activation} [{choices}]")


def run_linear(x2d, weight, bias, r2d, activation: str, table: dict[str, Choice]) -> torch.Tensor:
    traced = _traced("linear", activation, table)
    if traced is not None:
        with traced:
            return _run_linear(x2d, weight, bias, r2d, activation, table["linear"])
    return _run_linear(x2d, weight, bias, r2d, activation, table["linear"])


def _run_linear(x2d, weight, bias, r2d, activation, choice: Choice):
    config = choice.kernel
    if config is None:
        return _library("linear", choice, {"x": x2d, "w": weight, "b": bias, "r": r2d}, activation)
    return linear(x2d, weight, bias, r2d, activation, config)


def run_mlp(x2d, wg, bg, wu, bu, wd, bd, activation: str, table: dict[str, Choice]) -> torch.Tensor:
    traced = _traced("mlp", activation, table)
    if traced is not None:
        with traced:
            return _run_mlp(x2d, wg, bg, wu, bu, wd, bd, activation, table)
    return _run_mlp(x2d, wg, bg, wu, bu, wd, bd, activation, table)


def _run_mlp(x2d, wg, bg, wu, bu, wd, bd, activation, table):
    if "mlp" in table:
        return mlp_decode(x2d, wg, wu, wd, bg, bu, bd, activation, table["mlp"].kernel)
    up, down = table["gated_up"], table["down"]
    if up.kernel is None:
        h = _library("gated_up", up, {"x": x2d, "wg": wg, "wu": wu, "bg": bg, "bu": bu}, activation)
    else:
        h = gated_up(x2d, wg, wu, bg, bu, activation, up.kernel)
    if down.kernel is None:
        return _library("down", down, {"x": h, "w": wd, "b": bd}, "none")
    return linear(h, wd, bd, None, "none", down.kernel)


def _library(op: str, choice: Choice, operands: dict, activation: str) -> torch.Tensor:
    return ops.get(op).library[choice.config.name](operands, activation)


def run_choice(op: str, choice: Choice, operands: dict, activation: str, out: torch.Tensor | None = None):
    """Run one op's choice on operands named as its OpSpec names them."""
    spec = ops.get(op)
    if isinstance(choice.config, KernelConfig):
        return spec.run(operands, activation, choice.config, out=out)
    return spec.library[choice.config.name](operands, activation)


def call(op: str, operands: dict, *, activation: str, bias: bool = False, residual: bool = False,
         tuned: bool = True) -> torch.Tensor:
    """Run any registered op on its operands (named as its OpSpec names them), with the choice resolved
    for their shape: the first operand is the [M, k] activations, n is the leading dimension of the
    first [n, k] weight after it. For ops that no module wraps, e.g. one added outside autofuse."""
    spec = ops.get(op)
    x = next(iter(operands.values()))
    M, k = x.shape
    n = _n_of(spec, operands, k)
    choice = resolve(op, max(M, 1), n, k, x.dtype, x.device, activation=activation, bias=bias, residual=residual,
                     tuned=tuned)
    return run_choice(op, choice, operands, activation)


def _n_of(spec, operands: dict, k: int) -> int:
    for name, t in list(operands.items())[1:]:
        if t is not None and t.dim() == 2 and t.shape[1] == k:
            return t.shape[0]
    raise ValueError(f"op {spec.name}: cannot tell n from operands {list(operands)}")
