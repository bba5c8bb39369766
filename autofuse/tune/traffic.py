"""Tuning from recorded traffic (autofuse/traffic.py): which keys and M values to tune, with how much of the
budget, and what the tuned records are expected to save.

- Points: per recorded shape, the M values that carry at least HOT_SHARE of its time are tuned exactly (a key
  of that M, which the runtime looks up before the M's bucket); the other M values are grouped by the runtime's
  power-of-two buckets, and each bucket's key is tuned at the time-weighted median of the M values it serves
  (not at the bucket's edge), so its config fits the traffic it will run.
- Budget: the run's total (trials per key x keys, or seconds per key x keys) is spread by each key's share of
  the recorded time, every key keeping MIN_TRIALS (or MIN_TIME_SHARE of a key's seconds).
- Times: a shape's calls are weighed by their timed samples (Traffic.per_call_ms); where some shape of the trace
  has no timed call at all, every shape is weighed by its work instead (calls x M x its weights' size), and the
  plan says so.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .. import ops, traffic
from ..key import Problem, current_environment, m_bucket
from ..shapes import DTYPES, LinearShape, MLPShape
from .driver import Job, TuneOptions

HOT_SHARE = 0.10  # an M carrying this share of its shape's time is tuned exactly
MAX_HOT = 8  # exact M values per shape at most
MIN_TRIALS = 3  # trials every key keeps, whatever its share
MIN_TIME_SHARE = 0.1  # of a key's seconds (--time-budget), every key keeps


@dataclasses.dataclass(frozen=True)
class Point:
    """One M a shape is tuned at: its key's M (exact, or the bucket it serves), the M it is tuned at, and the
    recorded calls and time (ms, or work where the trace has no times) it stands for."""

    shape: traffic.Shape
    key_m: int
    run_m: int
    exact: bool
    calls: int
    weight: float  # recorded ms (Plan.timed) or work
    tokens: tuple[int, ...]  # the recorded M values it serves


@dataclasses.dataclass
class Plan:
    points: list[Point]
    timed: bool  # weights are recorded ms; False: work (calls x M x weights' elements)

    @property
    def total(self) -> float:
        return sum(p.weight for p in self.points)


def _work(shape: traffic.Shape, M: int, calls: int) -> float:
    a, b = shape.dims
    return calls * M * a * b * (3 if shape.kind == "mlp" else 1)


def plan(recorded: traffic.Traffic, hot_share: float = HOT_SHARE, max_hot: int = MAX_HOT) -> Plan:
    """The points to tune for `recorded` traffic (see the module's docstring)."""
    timed = all(any(c.sampled for c in by_m.values()) for by_m in recorded.counts.values())
    points = []
    for shape, by_m in sorted(recorded.counts.items(), key=lambda kv: dataclasses.astuple(kv[0])):
        weights = {M: (recorded.time_ms(shape, M) if timed else _work(shape, M, c.calls)) for M, c in by_m.items()
                   if c.calls}
        total = sum(weights.values())
        if total <= 0:
            continue
        ranked = sorted(weights, key=lambda M: (-weights[M], M))
        hot = [M for M in ranked[:max_hot] if weights[M] >= hot_share * total] or ranked[:1]
        served: dict[tuple[int, bool], list[int]] = {(M, True): [M] for M in hot}
        for M in ranked:
            if M in hot:
                continue
            bucket = m_bucket(M)
            # A hot M at the bucket's edge is that bucket's key: it serves the bucket's other M values too.
            served.setdefault((bucket, bucket in hot), []).append(M)
        for (key_m, exact), tokens in served.items():
            run_m = key_m if exact else _weighted_median(tokens, weights)
            points.append(Point(shape, key_m, run_m, exact, sum(by_m[M].calls for M in tokens),
                                sum(weights[M] for M in tokens), tuple(sorted(tokens))))
    return Plan(points, timed)


def _weighted_median(tokens: list[int], weights: dict[int, float]) -> int:
    ordered = sorted(tokens)
    half = sum(weights[M] for M in ordered) / 2
    running = 0.0
    for M in ordered:
        running += weights[M]
        if running >= half:
            return M
    return ordered[-1]


def entry(shape: traffic.Shape) -> MLPShape | LinearShape:
    """The shapes-file entry of a recorded shape (what an op's `dims` reads)."""
    a, b = shape.dims
    name = shape.label()
    if shape.kind == "mlp":
        return MLPShape(name, a, b, shape.activation, shape.bias)
    return LinearShape(name, a, b, shape.activation, shape.bias)


def jobs(points: list[Point], device: torch.device, only: set[str] | None = None) -> list[tuple[Job, Point]]:
    """The keys of each point (every op that serves its shape's kind; the backward's only for shapes recorded in
    training), each with the point it stands for; a key two points share is tuned once, for the first."""
    env = current_environment(device)
    found: dict = {}
    for point in points:
        shape, item = point.shape, entry(point.shape)
        for spec in ops.specs():
            # A shape's keys are its weight format's ops (fp8 and w8a8 modules run their own).
            if spec.serves != shape.kind or (spec.training and not shape.train) or spec.weights != shape.weights:
                continue
            if spec.max_m is not None and point.run_m > spec.max_m:
                continue
            if only is not None and spec.name not in only:
                continue
            if not spec.runs_for(item):  # its module never runs the op
                continue
            label = f"{shape.kind} {shape.dims[0]}->{shape.dims[1]} {spec.name}"
            for n, k, activation in spec.keyed_dims(item, point.run_m, shape.train):
                key = Problem(spec.name, n, k, point.run_m, DTYPES[shape.dtype], activation, shape.bias).key(
                    point.key_m, env)
                found.setdefault(key, (Job(key, point.run_m, label), point))
    return list(found.values())


def budgets(planned: list[tuple[Job, Point]], options: TuneOptions) -> list[tuple[Job, TuneOptions]]:
    """Each key's options: the run's budget (options.trials, options.time_budget_s per key, times the keys)
    spread by the key's share of the recorded time (its point's, split evenly among the point's keys)."""
    per_point: dict[Point, int] = {}
    for _, point in planned:
        per_point[point] = per_point.get(point, 0) + 1
    total = sum(point.weight for point in per_point)
    n = len(planned)
    out = []
    for job, point in planned:
        share = point.weight / per_point[point] / total if total > 0 else 1 / n
        trials = seconds = None
        if options.trials is not None:
            spare = max(0, options.trials * n - MIN_TRIALS * n)
            trials = MIN_TRIALS + round(spare * share)
        if options.time_budget_s is not None:
            pool = options.time_budget_s * n
            floor = MIN_TIME_SHARE * options.time_budget_s
            seconds = floor + max(0.0, pool - floor * n) * share
        out.append((job, dataclasses.replace(options, trials=trials, time_budget_s=seconds)))
    return out


@dataclasses.dataclass(frozen=True)
class Saving:
    point: Point
    recorded_ms: float  # the point's recorded time (ms)
    tuned_ms: float  # the same calls at the tuned records' speed (ms)

    @property
    def saved_ms(self) -> float:
        return self.recorded_ms - self.tuned_ms


def tuned_call_ms(kind: str, winners: dict[str, float]) -> float | None:
    """A module's call at the tuned records' times: a Linear's key, or an MLP's faster plan (the one-launch
    kernel, or the faster up projection plus the down projection)."""
    if kind == "linear":
        return winners.get("linear")
    plans = []
    ups = [winners[op] for op in ("gated_up", "gated_pairs") if op in winners]
    if ups and "down" in winners:
        plans.append(min(ups) + winners["down"])
    if "mlp" in winners:
        plans.append(winners["mlp"])
    return min(plans) if plans else None


def savings(planned: Plan, winners: dict[tuple[Point, str], float], before: dict[tuple[Point, str], float]
            ) -> list[Saving]:
    """Per point: its recorded ms, and those ms scaled by how much faster the tuned records run a call at its M
    than what ran when the traffic was recorded (`before`: each key's record then, or where it had none the
    fastest library path, what an undecided key runs). Both are the tuner's graph-replayed times, so the ratio is
    a GPU time's; a host-bound call's recorded time shrinks less. `winners`, `before`: (point, op) -> ms."""
    rows = []
    for point in planned.points:
        tuned = tuned_call_ms(point.shape.kind, {op: ms for (p, op), ms in winners.items() if p == point})
        then = tuned_call_ms(point.shape.kind, {op: ms for (p, op), ms in before.items() if p == point})
        if not planned.timed or tuned is None or not then:
            continue
        rows.append(Saving(point, point.weight, point.weight * min(tuned, then) / then))
    return rows


def describe_share(weight: float, total: float) -> str:
    return f"{100 * weight / total:.1f}%" if total > 0 and math.isfinite(weight) else "-"
