"""Every threshold that decides between candidates is a field of the one DecisionPolicy
(autofuse/choose/policy.py): changing a field changes the decisions that read it."""

import dataclasses

import pytest
import torch
from _helpers import FakeMark

from autofuse.choose import Choice, DecisionPolicy, Source, current, race, use
from autofuse.choose import check as checked
from autofuse.choose.winner import Outcome, choose_winner
from autofuse.configs import KernelConfig, Library
from autofuse.key import Problem, current_environment
from autofuse.store import TrialRecord

KERNEL = KernelConfig(16, 32, 32, group_m=1, num_stages=1)
KEY = Problem("linear", 72, 40, 4, torch.float32, "gelu", True).key(4, current_environment(torch.device("cpu")))


def _check_picks(library_ms: float, kernel_ms: float) -> object:
    """A first-use check's winner rule on these times, as a GPU run applies it."""
    outcome = Outcome({KERNEL: TrialRecord(KERNEL, "ok", kernel_ms)}, {"eager": library_ms}, KERNEL, 0.1)
    return choose_winner(KEY, outcome, "checked", kernel_margin=current().check_margin).config


def test_the_check_margin_decides_a_near_tie():
    assert _check_picks(1.0, 0.98) == Library("eager")  # 2% is within the default 3%: the library path
    with use(dataclasses.replace(current(), check_margin=0.01)):
        assert _check_picks(1.0, 0.98) == KERNEL


@pytest.mark.parametrize("other_ms, chosen", [(0.98, "eager"), (0.95, "cublaslt_gelu_tanh")])
def test_a_check_keeps_eager_over_another_library_path_within_the_check_margin(other_ms, chosen):
    """Another library path must beat eager by check_margin in a check, as a kernel must (tuning's margin is its
    own, tune_margin: 0, the fastest)."""
    outcome = Outcome({KERNEL: TrialRecord(KERNEL, "ok", 2.0)}, {"eager": 1.0, "cublaslt_gelu_tanh": other_ms},
                      KERNEL, 0.1)
    checked = choose_winner(KEY, outcome, "checked", kernel_margin=current().check_margin)
    assert checked.config == Library(chosen) and checked.runner_up == KERNEL
    assert checked.time_ms == (1.0 if chosen == "eager" else other_ms)
    tuned = choose_winner(KEY, outcome, "random", kernel_margin=current().tune_margin)
    assert tuned.config == Library("cublaslt_gelu_tanh")


def test_a_host_bound_check_still_chooses_by_gpu_time():
    assert _check_picks(0.05, 0.0505) == Library("eager")  # what a graph replays; plain calls race (race.py)


def test_the_host_bound_time_decides_what_an_unraced_step_runs():
    library = Choice(Library("eager"), Source.CHECKED, 0.05, runner_up=KERNEL, runner_up_ms=0.0505)
    assert current().unraced(library).config == KERNEL  # under 0.1 ms and within check_margin: one bound launch
    with use(dataclasses.replace(current(), host_bound_ms=0.01)):
        assert current().unraced(library).config == Library("eager")
    with use(dataclasses.replace(current(), check_margin=0.005)):
        assert current().unraced(library).config == Library("eager")
    alone = Choice(Library("eager"), Source.CHECKED, 0.05)  # no runner-up kernel was correct
    assert current().unraced(alone).config == Library("eager")
    kernel = Choice(KERNEL, Source.CHECKED, 0.05)
    assert current().unraced(kernel).config == KERNEL


def test_the_near_tie_width_decides_what_is_timed_again():
    class Evaluator:
        def retimed_side_by_side(self, record, library_ms, names, rivals=()):
            self.names = names
            return record, library_ms

    evaluator = Evaluator()
    record = TrialRecord(KERNEL, "ok", 1.0)
    checked._side_by_side_if_near(evaluator, record, {"eager": 1.08})
    assert evaluator.names == ["eager"]  # 8% apart: a near tie by default (10%)
    evaluator.names = None
    with use(dataclasses.replace(current(), near_tie=0.05)):
        checked._side_by_side_if_near(evaluator, record, {"eager": 1.08})
    assert evaluator.names is None


def test_the_race_margin_decides_which_table_plain_calls_run(monkeypatch):
    tables = [{"linear": Choice(Library(name), Source.USER_CACHE, 0.001)} for name in ("eager", "other")]
    entries = [lambda *a: "eager", lambda *a: "other"]
    monkeypatch.setattr(race.Raced, "_times", lambda self: [10.0, 9.7])  # the other 3% faster
    monkeypatch.setattr(race, "_capturing", lambda: False)
    monkeypatch.setattr(race, "_synchronize", lambda device: None)
    ticks = iter(range(10**6))
    monkeypatch.setattr(race, "_now", lambda: next(ticks))  # every call costs the same: no table is dropped
    # the stream's marks on the same clock, reached at once
    monkeypatch.setattr(race, "_mark", lambda device: FakeMark(next(ticks), [float("inf")], 1.0))

    def decided(key):
        raced = race.Raced(entries[0], entries[1:], tables, 1, key)
        for _ in range(raced.race_calls()):
            raced("x")
        return raced("x")

    monkeypatch.setattr(race, "_decided", {})
    assert decided(("k", 1)) == "eager"  # the default race_margin is 5%
    with use(dataclasses.replace(current(), race_margin=0.02)):
        assert decided(("k", 2)) == "other"


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(DecisionPolicy)])
def test_every_field_is_read_by_the_decisions(field):
    """A field no decision reads is a threshold kept somewhere else: each is named in choose/ or the tuner."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "autofuse"
    readers = [p for p in root.rglob("*.py") if f".{field}" in p.read_text()]  # a definition has no dot
    assert readers, f"no module reads DecisionPolicy.{field}"
