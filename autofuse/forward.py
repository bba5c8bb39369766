"""The forward of each fused module as plain functions of tensors and a resolved config table, so
that the modules (eager) and the torch.library ops (torch.compile, torch.export) run the same code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import launch
from .reference import eager_gated, eager_linear
from .resolve import MAX_M_BUCKET, Choice, m_bucket, resolve, resolve_tuned
from .tune.space import MLP_MAX_M


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
    """{"gated_up", "down"}, or {"mlp"} where the one-launch kernel was tuned faster than eager and
    than the two tuned ops together."""
    pair = {
        "gated_up": resolve("gated_up", M, d_ff, d_model, dtype, device, activation=activation, bias=bias,
                            tuned=tuned),
        "down": resolve("down", M, d_model, d_ff, dtype, device, activation="none", bias=bias, tuned=tuned),
    }
    if not tuned or M > MLP_MAX_M:
        return pair
    fused = resolve_tuned("mlp", M, d_ff, d_model, dtype, device, activation=activation, bias=bias)
    if fused is None or fused.config is None:
        return pair
    pair_ms = [c.time_ms for c in pair.values()]
    if None not in pair_ms and sum(pair_ms) <= fused.time_ms:
        return pair
    return {"mlp": fused}


def _traced(name: str, activation: str, table: dict[str, Choice]):
    """A profiler range naming what runs (op, activation, each kernel's config) while a profiler
    records, e.g. "autofuse::mlp gelu_tanh [gated_up 128x128x64 g8 w8 s4 tma; down eager]"; else None."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return None
    configs = "; ".join(f"{op} {'eager' if c.config is None else c.config.short()}" for op, c in table.items())
    return torch.profiler.record_function(f"autofuse::{name} {activation} [{configs}]")


def run_linear(x2d, weight, bias, r2d, activation: str, table: dict[str, Choice]) -> torch.Tensor:
    traced = _traced("linear", activation, table)
    if traced is not None:
        with traced:
            return _run_linear(x2d, weight, bias, r2d, activation, table["linear"])
    return _run_linear(x2d, weight, bias, r2d, activation, table["linear"])


def _run_linear(x2d, weight, bias, r2d, activation, choice):
    if choice.config is None:  # tuning found eager PyTorch faster for this shape
        return eager_linear(x2d, weight, bias, r2d, activation)
    return launch.linear(x2d, weight, bias, r2d, activation, choice.config)


def run_mlp(x2d, wg, bg, wu, bu, wd, bd, activation: str, table: dict[str, Choice]) -> torch.Tensor:
    traced = _traced("mlp", activation, table)
    if traced is not None:
        with traced:
            return _run_mlp(x2d, wg, bg, wu, bu, wd, bd, activation, table)
    return _run_mlp(x2d, wg, bg, wu, bu, wd, bd, activation, table)


def _run_mlp(x2d, wg, bg, wu, bu, wd, bd, activation, table):
    if "mlp" in table:
        return launch.mlp_decode(x2d, wg, wu, wd, bg, bu, bd, activation, table["mlp"].config)
    up, down = table["gated_up"].config, table["down"].config
    # A None config means tuning found eager PyTorch faster for that op at this shape.
    h = eager_gated(x2d, wg, wu, bg, bu, activation) if up is None else launch.gated_up(x2d, wg, wu, bg, bu,
                                                                                          activation, up)
    return F.linear(h, wd, bd) if down is None else launch.linear(h, wd, bd, None, "none", down)
