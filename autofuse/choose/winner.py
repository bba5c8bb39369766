"""The winner rule, the one both a tuning run and a first-use check apply to what they timed."""

from __future__ import annotations

import dataclasses

from ..configs import KernelConfig, Library
from ..key import TuningKey
from ..store import TrialRecord, Winner
from .policy import current


@dataclasses.dataclass
class Outcome:
    """What a tuning run or a check timed for one key: the trials by config, each library candidate's time,
    the heuristic's config, the seconds it took, and (tuning) the fastest trial retimed beside the library
    candidates, which stands in for the fastest of `done`."""

    done: dict[KernelConfig, TrialRecord]
    library_ms: dict[str, float]
    heuristic: KernelConfig
    seconds: float
    confirmed: TrialRecord | None = None


def fastest_trial(done: dict) -> TrialRecord | None:
    """The fastest correct trial of `done` (trials by config), or None where none is correct."""
    ok = [t for t in done.values() if t.status == "ok"]
    return min(ok, key=lambda t: t.time_ms) if ok else None


def near_fastest(done: dict, at_most: int) -> list[TrialRecord]:
    """The correct trials of `done` within the policy's near tie of the fastest, fastest first, at most `at_most`:
    what is timed again side by side before a winner is chosen (decode kernels' times swing up to 10% between
    timing windows, so the fastest of many trials timed one by one is partly the luckiest)."""
    ok = sorted((t for t in done.values() if t.status == "ok"), key=lambda t: t.time_ms)
    near = current().near
    return [t for t in ok if near(t.time_ms, ok[0].time_ms)][:at_most]


def choose_winner(key: TuningKey, outcome: Outcome, policy_name: str, times_mean_speed: bool = True,
                  kernel_margin: float = 0.0) -> Winner:
    """The fastest correct kernel if it beats the library candidate by more than `kernel_margin` (a fraction of the
    library's time: DecisionPolicy.check_margin for a check, tune_margin for tuning), else that library candidate,
    with the kernel as its runner-up. The library candidate is the fastest, except that eager stays unless another
    beats it by `kernel_margin` too: eager is what the user's PyTorch runs anyway, and a check's brief times cannot
    tell a few percent apart between library paths either (a Linear 627 -> 8288 at M = 1 chose cuBLASLt's epilogue
    on a check's near tie and ran it 7.36 us a call graph-replayed, against eager's 7.05 and torch.compile's 6.96,
    H200). Where times do not mean speed (the interpreter), the best kernel, so that tuning there still exercises
    every kernel path."""
    done = outcome.done
    best = outcome.confirmed if outcome.confirmed is not None else fastest_trial(done)
    library, library_time = min(outcome.library_ms.items(), key=lambda kv: kv[1])
    eager_ms = outcome.library_ms.get("eager")
    if eager_ms is not None and not library_time < eager_ms * (1 - kernel_margin):
        library, library_time = "eager", eager_ms
    heuristic_record = done.get(outcome.heuristic)
    heuristic_ms = heuristic_record.time_ms if heuristic_record and heuristic_record.status == "ok" else None
    common = dict(heuristic_ms=heuristic_ms, trials=len(done), tune_seconds=outcome.seconds, policy=policy_name)
    if best is not None and (not times_mean_speed or best.time_ms < library_time * (1 - kernel_margin)):
        return Winner(key, best.config, best.time_ms, library_time, **common)
    lost = Winner(key, Library(library), library_time, library_time, **common)
    # The best kernel is kept beside the library path, for un-graphed decode calls (choose/race.py).
    return lost if best is None else dataclasses.replace(lost, runner_up=best.config, runner_up_ms=best.time_ms)
