"""Un-graphed decode calls (autofuse/choose/race.py): where a library path won by GPU time at a decode M,
its runner-up kernel is kept in the record, and a module's first un-graphed call races the tables that compute
the same as plain calls; a call made while a CUDA graph captures runs the GPU-time winner.

On the CPU nothing can be timed: the race's timer is replaced by one that reports fixed times, and the
interpreter's kernels run what the race chose."""

import dataclasses
import logging

import pytest
import torch
from _helpers import FakeMark

import autofuse
from autofuse import ops
from autofuse.choose import Choice, Source
from autofuse.choose import lookup as resolve
from autofuse.choose import race as plain
from autofuse.choose.policy import current as current_policy
from autofuse.choose.policy import use as use_policy
from autofuse.choose.winner import Outcome, choose_winner
from autofuse.configs import KernelConfig, Library
from autofuse.key import Problem, current_environment
from autofuse.ops.linear import linear
from autofuse.store import Store, TrialRecord, Winner

KERNEL = KernelConfig(16, 32, 32, group_m=1, num_stages=1)
HOST_BOUND_MS = current_policy().host_bound_ms
# A race of windows of one call, one round (plain.race_length says how many calls it takes), that
# drops no table on the interpreter's times.
TINY_RACE = dataclasses.replace(current_policy(), race_calls=1, race_rounds=1, race_checkpoint_calls=1,
                                race_keep=float("inf"), race_host_keep=float("inf"), race_first_keep=float("inf"))
FAST = HOST_BOUND_MS / 10  # a decode-sized GPU time (ms)
# Modules built on the CPU run under the interpreter; with a GPU, the gpu-marked test below races for real.
ON_THE_CPU = pytest.mark.skipif(torch.cuda.is_available(), reason="builds its module on the CPU, under the interpreter")


# Linears of sizes that are multiples of 16, which run as they are (no padded layout).
def _key(op="linear", n=80, k=48, bucket=4, activation="gelu", bias=True):
    return Problem(op, n, k, bucket, torch.float32, activation, bias).key(bucket,
                                                                          current_environment(torch.device("cpu")))


def test_a_library_winner_keeps_the_fastest_correct_kernel_as_its_runner_up():
    key = _key()
    slower = KernelConfig(16, 16, 32, group_m=1, num_stages=1)
    done = {KERNEL: TrialRecord(KERNEL, "ok", 2.0), slower: TrialRecord(slower, "ok", 3.0),
            KernelConfig(32, 32, 32, num_stages=1): TrialRecord(KernelConfig(32, 32, 32, num_stages=1), "wrong_result")}
    lost = choose_winner(key, Outcome(done, {"eager": 1.0}, KERNEL, 0.1), "random")
    assert lost.config == Library("eager") and (lost.runner_up, lost.runner_up_ms) == (KERNEL, 2.0)
    won = choose_winner(key, Outcome(done, {"eager": 5.0}, KERNEL, 0.1), "random")
    assert won.config == KERNEL and won.runner_up is None
    none_correct = {KERNEL: TrialRecord(KERNEL, "wrong_result")}
    assert choose_winner(key, Outcome(none_correct, {"eager": 1.0}, KERNEL, 0.1), "random").runner_up is None
    # Round trip through a record; a record without one (written before runner_up existed) stays as it was.
    record = lost.to_record()
    assert record["runner_up"] == {"config": KERNEL.to_json(), "time_ms": 2.0}
    assert Winner.from_record(record) == lost
    assert "runner_up" not in won.to_record() and Winner.from_record(won.to_record()) == won


@pytest.mark.parametrize("runner_up, problem", [
    ({"config": KERNEL.to_json(), "time_ms": 0}, "positive"),
    ({"config": KERNEL.to_json(), "time_ms": "2"}, "positive"),
    ({"config": "library:eager", "time_ms": 2.0}, "kernel config"),
    ({"config": KERNEL.to_json()}, "object"),
    ([KERNEL.to_json(), 2.0], "object"),
    ({"config": {**KERNEL.to_json(), "block_m": 7}, "time_ms": 2.0}, "block_m must be one of"),
])
def test_a_bad_runner_up_is_refused_on_load(runner_up, problem):
    record = {**Winner(_key(), Library("eager"), 1.0, 1.0).to_record(), "runner_up": runner_up}
    with pytest.raises(ValueError, match=problem):
        Winner.from_record(record)


def test_a_runner_up_beside_a_kernel_winner_is_refused():
    record = {**Winner(_key(), KERNEL, 1.0, 2.0).to_record(),
              "runner_up": {"config": KERNEL.to_json(), "time_ms": 2.0}}
    with pytest.raises(ValueError, match="only where a library path won"):
        Winner.from_record(record)


def test_resolve_carries_the_runner_up():
    Store().put_winner(Winner(_key(), Library("eager"), FAST, FAST, runner_up=KERNEL, runner_up_ms=2 * FAST))
    resolve.invalidate()
    choice = resolve.resolve(Problem("linear", 80, 48, 4, torch.float32, "gelu", True))
    assert (choice.config, choice.runner_up, choice.runner_up_ms) == (Library("eager"), KERNEL, 2 * FAST)
    assert choice.kernel_instead() == Choice(KERNEL, choice.source, 2 * FAST)
    assert Choice(KERNEL, Source.USER_CACHE, 1.0).kernel_instead() is None
    assert Choice(Library("eager"), Source.USER_CACHE).kernel_instead() is None


def test_the_candidates_are_the_compared_tables_and_their_kernels():
    library = Choice(Library("cublas_pairs"), Source.SHIPPED, FAST, KERNEL, 2 * FAST)
    down = Choice(KERNEL, Source.SHIPPED, FAST)
    up = Choice(KERNEL, Source.CHECKED, 2 * FAST)
    winner = {"gated_pairs": library, "down": down}
    assert plain.host_bound(winner)
    # A table of kernels only is raced under host_bound_ms, one that runs a library path under
    # library_host_bound_ms (its PyTorch ops' host time).
    assert not plain.host_bound({"gated_pairs": Choice(KERNEL, Source.CHECKED, HOST_BOUND_MS), "down": down})
    library_bound = current_policy().library_host_bound_ms
    assert plain.host_bound({"gated_pairs": Choice(Library("eager"), Source.USER_CACHE, HOST_BOUND_MS), "down": down})
    at_the_bound = Choice(Library("eager"), Source.USER_CACHE, library_bound)
    assert not plain.host_bound({"gated_pairs": at_the_bound, "down": down})
    assert not plain.host_bound({"gated_pairs": Choice(KERNEL, Source.HEURISTIC), "down": down})  # time unknown
    other = {"gated_up": up, "down": down}
    found = plain.candidates(winner, [other, dict(other)])  # a repeat is raced once
    assert found == [other, {"gated_pairs": Choice(KERNEL, Source.SHIPPED, 2 * FAST), "down": down}]
    # A choice made before its check could run is never raced; a table with nothing to replace adds nothing.
    waiting = {"gated_up": Choice(Library("eager"), Source.PENDING), "down": down}
    assert plain.candidates({"gated_up": up, "down": down}, [waiting]) == []


def test_the_candidates_include_each_other_library_path_of_one_op_at_a_time():
    lt = Choice(Library("cublaslt_gelu_tanh"), Source.CHECKED, FAST)
    linear_paths = tuple(ops.get("linear").library_for("gelu_tanh", True, False))
    assert linear_paths == ("eager", "cublaslt_gelu_tanh", "cublas_bias_act")
    found = plain.candidates({"linear": lt}, [], {"linear": linear_paths})
    assert [t["linear"].config for t in found] == [Library("eager"), Library("cublas_bias_act")]
    assert all(t["linear"].source is Source.CHECKED and t["linear"].time_ms is None for t in found)
    # An MLP: each op of the winner and of each compared table in turn, the other ops as they were.
    pairs, down, up = (Choice(KERNEL, Source.CHECKED, FAST) for _ in range(3))
    libraries = {"gated_up": ("eager", "cublas_gated_act"), "gated_pairs": ("eager", "cublas_pairs"),
                 "down": ("eager",)}
    found = plain.candidates({"gated_pairs": pairs, "down": down}, [{"gated_up": up, "down": down}], libraries)
    assert [{op: c.config.short() for op, c in t.items()} for t in found] == [
        {"gated_up": KERNEL.short(), "down": KERNEL.short()},
        {"gated_pairs": "library:eager", "down": KERNEL.short()},
        {"gated_pairs": "library:cublas_pairs", "down": KERNEL.short()},
        {"gated_pairs": KERNEL.short(), "down": "library:eager"},
        {"gated_up": "library:eager", "down": KERNEL.short()},
        {"gated_up": "library:cublas_gated_act", "down": KERNEL.short()},
        {"gated_up": KERNEL.short(), "down": "library:eager"},
    ]


class _Entry:
    """A table entry on a fake clock: each call advances it by the entry's cost (µs)."""

    clock = [0.0]

    def __init__(self, name, cost=1.0):
        self.name, self.cost, self.calls = name, cost, 0
        # a host-bound table: its GPU time (ms) half its plain call's
        self.table = {"linear": Choice(Library(name), Source.USER_CACHE, cost * 1e-3 / 2)}

    def __call__(self, *args):
        self.calls += 1
        self.clock[0] += self.cost * 1e-6
        return self.name


def _race_to_decision(raced) -> list[float]:
    """Call `raced` until its race decides; the µs each call took on the fake clock."""
    spent = []
    while raced.plain is None:
        before = _Entry.clock[0]
        raced("x")
        spent.append((_Entry.clock[0] - before) * 1e6)
    return spent


def _worst_50(spent: list[float]) -> float:
    """The most any 50 calls in a row cost (µs)."""
    return max(sum(spent[i:i + 50]) for i in range(len(spent) - 49))


def _raced(monkeypatch, costs, key=("test", 1), fresh=True):
    if fresh:
        plain._decided.pop(key, None)
    monkeypatch.setattr(plain, "_now", lambda: _Entry.clock[0])
    monkeypatch.setattr(plain, "_synchronize", lambda device: None)
    # no queue: a mark is reached once recorded
    monkeypatch.setattr(plain, "_mark", lambda device: FakeMark(_Entry.clock[0], _Entry.clock, 1e3))
    entries = [_Entry(f"e{i}", cost) for i, cost in enumerate(costs)]
    raced = plain.Raced(entries[0], entries[1:], [e.table for e in entries], 1, key)
    return raced, entries


@pytest.mark.parametrize("costs, expected, dropped, unraced", [
    # the fastest plain call; e0's host time alone is 3x e1's: dropped without a window; e2, 1.4x e1 (within
    # race_first_keep, over race_keep), dropped at its window's race_checkpoint_calls checkpoint
    ([30.0, 10.0, 14.0], "e1", ["e2"], ["e0"]),
    ([30.0, 29.0, 40.0], "e0", ["e2"], []),  # within race_margin of the GPU-time winner: the winner stays
    ([30.0, 29.5, 28.0], "e2", [], []),  # none dropped: within race_round_keep of e2 after each round
])
def test_the_race_runs_on_the_callers_calls_and_later_ones_run_the_fastest(monkeypatch, costs, expected, dropped,
                                                                           unraced):
    monkeypatch.setattr(plain, "_capturing", lambda: False)
    raced, entries = _raced(monkeypatch, costs)
    racing = plain.planned_length(len(costs))
    policy = current_policy()
    window, checkpoint = policy.race_calls, policy.race_checkpoint_calls
    after = plain.FASTEST_AFTER_FIRST_WINDOWS
    assert racing == 1 + window + (len(costs) - 1) * ((1 + after) * window + policy.race_rounds * 2 * window)
    # (the most calls: a start bound by its GPU time runs one window more, plain.START_WINDOWS_BOUND_BY_GPU)
    assert raced.race_calls() == plain.race_length(len(costs)) == racing + window + policy.race_voids * window
    during = [raced("x") for _ in range(racing)]
    assert set(during) == {e.name for e in entries if e.name not in unraced} | {"e0"}  # the first call: e0's result
    # An entry slower than the fastest known by more than race_keep ran its binding call, its host-timed calls and
    # the calls of its window up to the checkpoint, no more; one whose host time alone rules it out, its binding
    # and host-timed calls.
    estimate = plain.ESTIMATE_CALLS
    assert [e.name for e in entries if e.calls == 1 + estimate + checkpoint] == dropped
    assert [e.name for e in entries if e.calls == 1 + estimate] == unraced
    if not dropped and not unraced:  # the race took every call planned, and its first call ran every entry
        assert sum(e.calls for e in entries) == racing + len(costs) * (1 + estimate) - 1
    assert [raced("x") for _ in range(3)] == [expected] * 3
    # The call after the race's last window settled it: racing + 1 where the race took every call planned, sooner
    # where tables were dropped; calls after it do not go through the race.
    assert raced.calls == raced.decided_after
    assert raced.decided_after == racing + 1 if not dropped and not unraced else raced.decided_after <= racing
    assert raced.plain_table == next(e.table for e in entries if e.name == expected)
    assert raced.table is entries[0].table  # what config_for reports: the GPU-time winner's
    # Another module of the same kind, shape and tables reuses the decision without racing.
    again, others = _raced(monkeypatch, costs, fresh=False)
    assert again("x") == expected and sum(e.calls for e in others) == 1
    assert again.decided_after == 1


def test_each_entry_runs_a_window_beside_the_fastest_known_then_the_rounds_rotate(monkeypatch):
    monkeypatch.setattr(plain, "_capturing", lambda: False)
    # (race_round_keep as wide as race_keep: the three run every round, whose order this test follows)
    with use_policy(dataclasses.replace(current_policy(), race_calls=2, race_rounds=3, race_checkpoint_calls=1,
                                        race_round_keep=0.25)):
        raced, entries = _raced(monkeypatch, [1.0, 1.1, 0.9], key=("test", "order"))
        order = [raced("x") for _ in range(plain.planned_length(3))]
        estimate = plain.ESTIMATE_CALLS
        assert [e.calls for e in entries] == [1 + estimate + 2 + 6, 1 + estimate + 2 + 6,
                                              1 + estimate + 2 + 12 + 12]
        decided = raced("x")
    # The first call runs every entry (each binds its launches, then has its host time taken) and returns the
    # GPU-time winner's result; a window of the start (e2, of the lowest estimate); per other entry, lowest
    # estimate first, a window of it, then three of the fastest known (e2); then rounds of one window of each other
    # entry, each after a window of the fastest (e2), the order rotated.
    round_a = ["e2", "e2", "e0", "e0", "e2", "e2", "e1", "e1"]
    round_b = ["e2", "e2", "e1", "e1", "e2", "e2", "e0", "e0"]
    expected = ["e0"] + ["e2", "e2"] + ["e0", "e0"] + ["e2"] * 6 + ["e1", "e1"] + ["e2"] * 6 + \
        round_a + round_b + round_a
    assert order == expected and decided == "e2"


def test_a_slow_table_costs_the_race_few_calls_and_no_span_of_calls_much(monkeypatch):
    """Tables up to 4x slower than the fastest known: those whose host time alone is over twice the lowest estimate
    are dropped in the first call, the others raced; no 50 calls in a row cost more than 1.25x what
    the GPU-time winner's would, and the fastest table runs from the decision on."""
    monkeypatch.setattr(plain, "_capturing", lambda: False)
    costs = [1.0, 3.0, 0.9, 4.0, 1.05]
    raced, entries = _raced(monkeypatch, costs, key=("test", "bounded"))
    raced("x")  # the first call: every entry binds
    spent = []
    for _ in range(raced.race_calls() - 1):
        before = _Entry.clock[0]
        raced("x")
        spent.append((_Entry.clock[0] - before) * 1e6)
    assert entries[1].calls == entries[3].calls == 1 + plain.ESTIMATE_CALLS  # dropped without a window
    worst = _worst_50(spent)
    assert worst <= 1.25 * 50 * costs[0]
    assert raced("x") == "e2" and raced.plain is entries[2]


def test_in_the_rounds_no_two_slower_tables_run_back_to_back(monkeypatch):
    """Three tables 30% slower than the fastest kept through the rounds (race_keep and race_round_keep wider than
    that): each of their windows follows one of the fastest table's, so no 50 calls in a row cost over 1.2x the
    fastest's (back to back, their windows made 60 calls at 1.3x)."""
    monkeypatch.setattr(plain, "_capturing", lambda: False)
    with use_policy(dataclasses.replace(current_policy(), race_keep=0.35, race_round_keep=0.35)):
        raced, entries = _raced(monkeypatch, [1.0, 1.3, 1.3, 1.3], key=("test", "interleaved"))
        raced("x")  # the first call: every entry binds
        spent = _race_to_decision(raced)
    assert all(e.calls > 1 + plain.ESTIMATE_CALLS + current_policy().race_calls for e in entries)  # all raced
    assert _worst_50(spent) <= 1.2 * 50
    assert raced.plain is entries[0]


def test_after_a_round_a_table_more_than_race_round_keep_slower_runs_no_more_windows(monkeypatch):
    """Tables 12% and 20% slower than the fastest pass their windows' checkpoints (within race_keep) and run their
    window; then they are dropped before the first round, while one 8% slower (within race_round_keep) runs every
    round."""
    monkeypatch.setattr(plain, "_capturing", lambda: False)
    policy = current_policy()
    assert policy.race_round_keep < 0.12 < 0.20 < policy.race_keep and 0.08 < policy.race_round_keep
    raced, entries = _raced(monkeypatch, [1.0, 1.12, 1.2, 1.08], key=("test", "round keep"))
    for _ in range(raced.race_calls()):
        raced("x")
    window, estimate = policy.race_calls, plain.ESTIMATE_CALLS
    assert entries[1].calls == entries[2].calls == 1 + estimate + window
    assert entries[3].calls == 1 + estimate + window + policy.race_rounds * window
    assert raced("x") == "e0" and raced.plain is entries[0]


def _race_with_gaps(monkeypatch, key, gap_us, costs=(20.0, 18.0)):
    """Race e0 (the GPU-time winner, 20 us a call) and e1 (18 us) on the fake clock; after each call
    gap_us(raced) µs pass outside the race (the caller's own work). Returns the race and the calls it took."""
    monkeypatch.setattr(plain, "_capturing", lambda: False)
    raced, entries = _raced(monkeypatch, list(costs), key=key)
    calls = 0
    while raced.plain is None and calls < plain.race_length(len(costs)) + 1:
        raced("x")
        calls += 1
        _Entry.clock[0] += gap_us(raced) * 1e-6
    return raced, entries, calls


def test_a_window_with_the_callers_foreign_work_in_it_starts_again(monkeypatch):
    """5 ms of the caller's own work inside three of e1's windows after the race's first (as a benchmark's eager
    window between two race calls) would have read those windows at 268 us a call against e1's 18 and settled on
    e0: each starts again from the call after the gap, and the race settles on e1."""
    polluted = []

    def gap(raced):
        window = raced._window
        timed = any(raced._samples)  # the first window gives the gaps' measure
        if timed and window is not None and window.entry == 1 and len(polluted) < 3 and window.start not in polluted:
            polluted.append(window.start)  # once in a window: its start
            return 5000.0
        return 0.0
    raced, entries, calls = _race_with_gaps(monkeypatch, ("test", "foreign"), gap)
    assert len(polluted) == 3 and raced.voided == 3
    assert raced.plain is entries[1] and raced("x") == "e1"
    assert raced.decided_after <= plain.race_length(2)


def test_gaps_of_one_size_at_every_call_void_no_window(monkeypatch):
    """A model's other layers between two calls of a module: the same gap at every call is the caller's steady
    work, not foreign to a window."""
    raced, entries, calls = _race_with_gaps(monkeypatch, ("test", "steady"), lambda raced: 500.0)
    assert raced.voided == 0 and raced.plain is not None
    assert raced.decided_after <= plain.planned_length(2) + 1


def test_windows_run_again_for_foreign_work_are_bounded_by_race_voids(monkeypatch):
    """Foreign work once in every window: race_voids windows start again, then windows count as they are, and the
    race ends within race_length calls."""
    polluted = set()

    def gap(raced):
        window = raced._window
        if window is None or window.start in polluted:
            return 0.0
        polluted.add(window.start)  # once in every window
        return 5000.0
    raced, entries, calls = _race_with_gaps(monkeypatch, ("test", "always"), gap)
    assert raced.voided == current_policy().race_voids
    assert raced.plain is not None and raced.decided_after <= plain.race_length(2) + 1


def test_the_race_starts_from_the_lowest_estimate_of_host_and_known_gpu_time(monkeypatch):
    """A table of cheap host time but long known GPU time is neither started from nor dropped without a window: its
    estimate is its GPU time, and host time alone does not rule it out."""
    monkeypatch.setattr(plain, "_capturing", lambda: False)
    with use_policy(dataclasses.replace(current_policy(), race_calls=2, race_rounds=1, race_checkpoint_calls=1)):
        raced, entries = _raced(monkeypatch, [10.0, 2.0, 30.0], key=("test", "estimate"))
        entries[1].table = {"linear": Choice(Library("e1"), Source.USER_CACHE, 0.05)}  # 50 µs of GPU time
        raced.tables[1] = entries[1].table
        order = [raced("x") for _ in range(4)]
    # The first call (e0's result), then a window of e0 (the start: e1's estimate is 50 µs, e0's 10), then e1's;
    # e2's host time alone (30 µs) is over twice e0's estimate: dropped without a window.
    assert order == ["e0", "e0", "e0", "e1"]
    assert raced._start == 0 and raced._alive == [True, True, False]
    assert entries[2].calls == 1 + plain.ESTIMATE_CALLS


def test_with_the_autofuse_logger_at_debug_a_race_keeps_each_window_it_timed(monkeypatch, caplog):
    """What benchmarks/first_use.py --race-log keeps: the first call's estimates, then each window (the call that
    ended it, the table, its calls, µs a call, its kind, whether it dropped the table); without DEBUG, nothing."""
    monkeypatch.setattr(plain, "_capturing", lambda: False)
    quiet, _ = _raced(monkeypatch, [1.0, 1.1], key=("test", "quiet"))
    assert quiet.windows is None
    with caplog.at_level(logging.DEBUG, logger="autofuse"):
        raced, entries = _raced(monkeypatch, [1.0, 1.8], key=("test", "logged"))
        while raced.plain is None:
            raced("x")
    first, start, *timed = raced.windows
    assert first["call"] == 1 and len(first["host_us"]) == len(first["estimate_us"]) == 2
    assert start == {"call": 1, "start": 0, "dropped_by_host_time": []}
    # e0 (the start) ran a window; e1 (1.8x e0: within race_host_keep and race_first_keep, over race_keep) ended its
    # window at its second checkpoint and was dropped there, leaving e0
    window, checkpoint = current_policy().race_calls, current_policy().race_checkpoint_calls
    assert [(w["table"], w["kind"], w["calls"], w["dropped"]) for w in timed] == [
        ("linear library:e0", plain.WINDOW, window, False), ("linear library:e1", plain.ENDED, checkpoint, True)]
    assert timed[0]["us"] == pytest.approx(1.0) and timed[0]["checkpoints_us"] == {1: pytest.approx(1.0),
                                                                                  checkpoint: pytest.approx(1.0)}
    assert timed[1]["us"] == pytest.approx(1.8) and timed[1]["checkpoints_us"] == {checkpoint: pytest.approx(1.8)}
    assert any("race at M=1" in r.getMessage() for r in caplog.records)


class _Slows(_Entry):
    """An entry whose calls cost `cost` µs up to its `cheap`-th, then `later` µs: a host time estimated on the calls
    right after binding that reads under the plain call that follows."""

    def __init__(self, name, cost, later, cheap):
        super().__init__(name, cost)
        self.later, self.cheap = later, cheap

    def __call__(self, *args):
        if self.calls == self.cheap:
            self.cost = self.later
        return super().__call__(*args)


def test_a_start_slower_than_its_estimate_gives_way_after_one_comparison(monkeypatch):
    """e0's host time read 10 us a call on the calls after binding (the lowest estimate: the start) but its plain
    call then takes 30, against e1's 20: e0 runs one window, e1's window follows and makes it the fastest known, so
    no 50 calls in a row cost over 1.25x e1's (three windows of the start first had made 60 calls at 1.5x)."""
    monkeypatch.setattr(plain, "_capturing", lambda: False)
    plain._decided.pop(("test", "slow start"), None)
    monkeypatch.setattr(plain, "_now", lambda: _Entry.clock[0])
    monkeypatch.setattr(plain, "_synchronize", lambda device: None)
    monkeypatch.setattr(plain, "_mark", lambda device: FakeMark(_Entry.clock[0], _Entry.clock, 1e3))
    start, faster = _Slows("e0", 10.0, 30.0, cheap=1 + plain.ESTIMATE_CALLS), _Entry("e1", 20.0)
    raced = plain.Raced(start, [faster], [start.table, faster.table], 16, ("test", "slow start"))
    raced("x")  # the first call: both bind and have their host time taken
    assert raced._start == 0
    spent = _race_to_decision(raced)
    assert _worst_50(spent) <= 1.25 * 50 * 20.0
    assert raced.plain is faster


def test_a_table_bound_by_its_gpu_time_starts_before_a_host_bound_one_estimated_near_it(monkeypatch):
    """e0 (the GPU-time winner, 10 us) read 10 us a call of host time after binding, e1 4 us of host for 11 us of GPU
    time: e0's estimate is the lower (10 against 11), but host times read then run up to 1.45x slower right after a
    first use, so e1, bound by its GPU time, starts and runs the race's first window."""
    monkeypatch.setattr(plain, "_capturing", lambda: False)
    raced, entries = _raced(monkeypatch, [10.0, 4.0], key=("test", "bound start"))
    entries[0].table = {"linear": Choice(Library("e0"), Source.USER_CACHE, 0.010)}
    entries[1].table = {"linear": Choice(Library("e1"), Source.USER_CACHE, 0.011)}
    raced.tables[:] = [entries[0].table, entries[1].table]
    order = [raced("x") for _ in range(1 + current_policy().race_calls + 1)]
    assert raced._start == 1 and raced._alive == [True, True]
    # the first call returns the GPU-time winner's result; the start's two windows follow (bound by its GPU time),
    # then e0's first window
    order += [raced("x") for _ in range(current_policy().race_calls)]
    assert order == ["e0", *["e1"] * 2 * current_policy().race_calls, "e0"]


class _ColdAfter(_Entry):
    """An entry whose call right after another entry's costs `cold` µs once it has made `after` calls (the first call
    after a switch of tables, slow on a GPU's host for some tables)."""

    last = [None]

    def __init__(self, name, cost, cold, after):
        super().__init__(name, cost)
        self.cold, self.after = cold, after

    def __call__(self, *args):
        switched = self.last[0] is not self
        self.last[0] = self
        if switched and self.calls >= self.after:
            self.clock[0] += (self.cold - self.cost) * 1e-6
        return super().__call__(*args)


@pytest.mark.parametrize("cold, from_its_second_window", [(18.0, True), (25.0, False)])
def test_a_table_is_not_dropped_on_its_windows_slow_first_call(monkeypatch, cold, from_its_second_window):
    """e1 runs 3% slower than e0 a call (within race_round_keep) but its first call after e0's costs 1.8x e0's from
    its second window on, or 2.5x from its first: it runs every round (its first call bounds only its first window,
    within race_first_keep, and is kept out of the second checkpoint's time a call)."""
    monkeypatch.setattr(plain, "_capturing", lambda: False)
    policy = current_policy()
    raced, _ = _raced(monkeypatch, [10.0, 10.3], key=("test", "cold", cold))
    fastest = _ColdAfter("e0", 10.0, 10.0, 0)
    after = 1 + plain.ESTIMATE_CALLS + (policy.race_calls if from_its_second_window else 0)
    cold = _ColdAfter("e1", 10.3, cold, after)
    raced.entries = [fastest, cold]
    for _ in range(raced.race_calls()):
        raced("x")
    assert cold.calls == 1 + plain.ESTIMATE_CALLS + policy.race_calls + policy.race_rounds * policy.race_calls
    assert raced.plain is fastest


class _Stalls(_Entry):
    """An entry whose `nth` call stalls for `stall` µs (a collection, a lazy initialisation) on top of its cost."""

    def __init__(self, name, cost, nth, stall):
        super().__init__(name, cost)
        self.nth, self.stall = nth, stall

    def __call__(self, *args):
        if self.calls + 1 == self.nth:
            self.clock[0] += self.stall * 1e-6
        return super().__call__(*args)


@pytest.mark.parametrize("between_calls", [False, True])
def test_a_window_holding_a_stall_of_the_process_runs_again(monkeypatch, between_calls):
    """A 5 ms stall in the GPU-time winner's first window (20 us a call; a collection, or a first call's lazy work
    after graph replays), inside one of its calls or between two (in the module's forward around the race), read
    that window at 270 us a call, over 4x its estimate: the window runs again, and the race keeps e0 over e1
    (22 us), which the stalled window had made the fastest and e0 a table to drop."""
    monkeypatch.setattr(plain, "_capturing", lambda: False)
    raced, _ = _raced(monkeypatch, [20.0, 22.0], key=("test", "stall", between_calls))
    nth = 1 + plain.ESTIMATE_CALLS + 10
    stalled = _Stalls("e0", 20.0, nth=-1 if between_calls else nth, stall=5000.0)
    raced.entries[0] = stalled
    while raced.plain is None:
        raced("x")
        if between_calls and stalled.calls == nth:
            _Entry.clock[0] += 5000e-6
    assert raced.voided == 1 and raced.plain is stalled
    assert 5000.0 / current_policy().race_calls > current_policy().race_gap_outlier * 20.0


class _Queued:
    """A table entry whose launches queue on a fake GPU: a call costs the host `host` µs, the GPU `gpu` µs after the
    work queued before it; a synchronisation waits for the GPU, a mark is reached once the GPU has done the work
    queued before it. `gpu_ms`: the table's known GPU time, or None."""

    clock = [0.0, 0.0]  # [host now, GPU free at] (µs)

    def __init__(self, name, host, gpu, gpu_ms):
        self.name, self.host, self.gpu, self.calls = name, host, gpu, 0
        self.table = {"gated_up": Choice(Library(name), Source.CHECKED, gpu_ms)}

    def __call__(self, *args):
        self.calls += 1
        now, free = self.clock
        self.clock[0] = now + self.host
        self.clock[1] = max(free, now + self.host) + self.gpu
        return self.name

    @classmethod
    def synchronize(cls, device=None):
        cls.clock[0] = max(cls.clock)

    @classmethod
    def mark(cls, device=None):
        return FakeMark(max(cls.clock), cls.clock, 1e-3)


def _on_queued_gpu(monkeypatch, key) -> None:
    """Races from here on run on the fake GPU of _Queued, none capturing, and `key` is decided afresh."""
    monkeypatch.setattr(plain, "_capturing", lambda: False)
    monkeypatch.setattr(plain, "_now", lambda: _Queued.clock[0] * 1e-6)
    monkeypatch.setattr(plain, "_synchronize", _Queued.synchronize)
    monkeypatch.setattr(plain, "_mark", _Queued.mark)
    plain._decided.pop(key, None)


def _race_queued(monkeypatch, key, other):
    """Race `other` beside a GPU-time winner of 70 us of host and 60 of GPU time a call on the fake GPU, through
    race_length calls and one more: (winner, other, race)."""
    _on_queued_gpu(monkeypatch, key)
    winner = _Queued("winner", host=70.0, gpu=60.0, gpu_ms=0.060)
    raced = plain.Raced(winner, [other], [winner.table, other.table], 16, key)
    for _ in range(raced.race_calls() + 1):
        raced("x")
    return winner, other, raced


def test_a_table_of_unknown_gpu_time_neither_starts_the_race_nor_drops_the_others(monkeypatch):
    """A kernel table whose GPU time is unknown (a library choice's runner-up, never timed) and whose launches cost
    the host 20 us but the GPU 157, against the GPU-time winner's 60 us of GPU time and 70 of host: the kernel
    table's host time alone is no estimate of its plain call (queued behind its GPU time), so it must not drop the
    winner without a window; its window's checkpoints beside the winner's drop it, and plain calls run the winner."""
    winner, kernels, raced = _race_queued(monkeypatch, ("test", "unknown"), _Queued("kernels", 20.0, 157.0, None))
    assert raced._start == 0 and raced._alive[0]
    assert raced.plain is winner and raced("x") == "winner"
    # the kernel table ran its binding call, its host-timed calls and the calls of its window up to its second
    # checkpoint's: its first call took 177 us against the winner's 130 (within race_first_keep); its launches
    # queue, so the mark after its 4th call, not reached by its 8th, is waited for then: its 2nd-4th calls took 157
    # us a call against the winner's 70
    checkpoint = current_policy().race_checkpoint_calls
    assert kernels.calls == 1 + plain.ESTIMATE_CALLS + 2 * checkpoint


def test_a_table_far_slower_than_the_fastest_is_dropped_after_two_calls(monkeypatch):
    """A table of unknown GPU time (no host estimate can rule it out) whose call takes 420 us against the fastest's
    130 (host and GPU, its window's first call): over race_first_keep, it is dropped once the GPU reaches that
    call's mark, waited for after its second call (queued behind it, so the GPU does not idle)."""
    winner, slow, raced = _race_queued(monkeypatch, ("test", "one call"), _Queued("slow", 20.0, 400.0, None))
    assert 420 / 130 > 1 + current_policy().race_first_keep
    assert slow.calls == 1 + plain.ESTIMATE_CALLS + 2
    assert raced.plain is winner


def test_a_race_of_host_bound_tables_never_waits_for_the_gpu_inside_a_window(monkeypatch):
    """A host-bound table 7% slower than the GPU-time winner (75 us of host and 50 of GPU time a call against 70 and
    60) runs every round; its checkpoints are read once the GPU has reached them, without waiting (a synchronised
    probe drains the queue each time)."""
    waits = []
    monkeypatch.setattr(plain, "_wait", lambda mark: waits.append(mark) or mark.synchronize())
    winner, other, raced = _race_queued(monkeypatch, ("test", "waits"), _Queued("other", 75.0, 50.0, 0.05))
    window = current_policy().race_calls
    assert other.calls == 1 + plain.ESTIMATE_CALLS + window + current_policy().race_rounds * window  # every round
    assert waits == [] and raced.plain is winner


def test_a_race_marks_and_waits_on_its_modules_gpu(monkeypatch):
    """A module on another GPU than the current one (a model spread over GPUs): the race's marks go on that GPU's
    stream and its waits are for that GPU's work (the current device's would not hold the module's kernels)."""
    monkeypatch.setattr(plain, "_capturing", lambda: False)
    raced, entries = _raced(monkeypatch, [10.0, 10.5], key=("test", "device"))
    raced.device = torch.device("cuda", 1)
    devices = []
    monkeypatch.setattr(plain, "_synchronize", lambda device: devices.append(("wait", device)))
    monkeypatch.setattr(plain, "_mark", lambda device: devices.append(("mark", device)) or FakeMark(
        _Entry.clock[0], _Entry.clock, 1e3))
    while raced.plain is None:
        raced("x")
    assert {kind for kind, _ in devices} == {"wait", "mark"}
    assert {device for _, device in devices} == {torch.device("cuda", 1)}


def test_a_race_that_fails_runs_the_gpu_time_winner(monkeypatch, caplog):
    monkeypatch.setattr(plain, "_capturing", lambda: False)
    raced, entries = _raced(monkeypatch, [30.0, 10.0], key=("test", "fails"))

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("no memory for the test")
    raced.entries[1] = out_of_memory
    assert [raced("x") for _ in range(raced.race_calls())][-1] == "e0"
    assert raced("x") == "e0" and raced.plain is entries[0]
    assert any("could not race" in r.getMessage() for r in caplog.records)


def test_a_call_while_a_graph_captures_runs_the_gpu_time_winner(monkeypatch):
    raced, entries = _raced(monkeypatch, [30.0, 10.0])
    monkeypatch.setattr(plain, "_capturing", lambda: True)
    assert raced("x") == "e0" and entries[1].calls == 0  # no race while capturing
    monkeypatch.setattr(plain, "_capturing", lambda: False)
    for _ in range(raced.race_calls()):
        raced("x")
    assert raced("x") == "e1"
    monkeypatch.setattr(plain, "_capturing", lambda: True)
    assert raced("x") == "e0"


def _race_on_cpu(monkeypatch, times):
    """Races on the CPU as on a GPU, with fixed plain-call times and one window of one call per table; records
    which tables were raced."""
    raced, seen = [], set()

    def fixed_times(self):
        if id(self) not in seen:  # once a race: its tables
            seen.add(id(self))
            raced.append(list(self.tables))
        return (times + [float("inf")] * len(self.tables))[:len(self.tables)]
    monkeypatch.setattr(plain, "racing", lambda device: True)
    monkeypatch.setattr(plain, "_capturing", lambda: False)
    monkeypatch.setattr(plain.Raced, "_times", fixed_times)
    # The interpreter's host times say nothing of a GPU's: every table's estimate is the same, none dropped by it,
    # and above every table's GPU time (host-bound, as a race is for).
    monkeypatch.setattr(plain.Raced, "_estimates", lambda self, args: ([1e6] * len(self.tables),) * 2)
    plain._decided.clear()
    return raced


def _race_through(call, tables: int):
    """Call `call` for as long as a race of `tables` tables takes under the policy in use, then once more."""
    for _ in range(plain.race_length(tables)):
        call()
    return call()


def _settle_on_host_time(monkeypatch, caplog, winner: Winner):
    """A Linear at M = 4 whose GPU-time winner is `winner`, raced with 1 us of host time a call for every table:
    the first call's entry."""
    Store().put_winner(winner)
    resolve.invalidate()
    _race_on_cpu(monkeypatch, [30.0, 10.0, 20.0])
    # as Raced._estimates gives: the larger of the host time and the known GPU time, the host time where unknown
    monkeypatch.setattr(plain.Raced, "_estimates", lambda self, args: (
        [1.0] * len(self.tables), [max(1.0, (plain.known_gpu_ms(t) or 0) * 1e3) for t in self.tables]))
    layer = autofuse.get_linear(48, 80, activation="gelu", dtype=torch.float32, device="cpu")
    with torch.no_grad(), use_policy(TINY_RACE):
        layer(torch.randn(4, 48))
    entry = next(iter(layer._bound.values()))
    assert not any("could not race" in r.getMessage() for r in caplog.records)
    return entry


@ON_THE_CPU
def test_a_kernel_winner_under_its_gpu_time_in_host_time_settles_at_the_first_call(monkeypatch, caplog):
    """Host 1 us a call against FAST (10 us) of known GPU time: a kernel table (its bound launches' host time is
    steady) settles at the first call."""
    kernel = _settle_on_host_time(monkeypatch, caplog, Winner(_key(), KERNEL, FAST, FAST))
    assert isinstance(kernel, plain.Raced) and kernel.decided_after == 1 and kernel.plain_table == kernel.table
    assert kernel.plain_table == {"linear": Choice(KERNEL, Source.USER_CACHE, FAST)}


@ON_THE_CPU
def test_a_library_winner_under_its_gpu_time_in_host_time_still_races(monkeypatch, caplog):
    """The same with a library path as the GPU-time winner: its PyTorch ops' host time wanders, so two calls' host
    time do not settle it; the race runs."""
    library = _settle_on_host_time(monkeypatch, caplog, Winner(_key(), Library("eager"), FAST, FAST, runner_up=KERNEL,
                                                       runner_up_ms=2 * FAST))
    assert isinstance(library, plain.Raced) and library.decided_after is None and library.plain is None


@ON_THE_CPU
@pytest.mark.parametrize("slower_by, settled", [(current_policy().check_margin / 2, True),
                                                (2 * current_policy().check_margin, False)])
def test_a_bound_kernel_table_near_a_library_winners_gpu_time_settles_at_the_first_call(monkeypatch, caplog,
                                                                                        slower_by, settled):
    """A library path won by GPU time (what a graph replays); its runner-up kernel's table, of host time under its
    GPU time, is within check_margin of it: no plain call of the library path can be faster by more, so un-graphed
    calls run the kernel from the first call, without a race's windows. Beyond check_margin the race runs."""
    library = _settle_on_host_time(monkeypatch, caplog, Winner(_key(), Library("eager"), FAST, FAST, runner_up=KERNEL,
                                                       runner_up_ms=FAST * (1 + slower_by)))
    assert isinstance(library, plain.Raced) and library.table["linear"].config == Library("eager")
    if settled:
        assert library.decided_after == 1 and library.plain_table["linear"].config == KERNEL
    else:
        assert library.decided_after is None and library.plain is None


@ON_THE_CPU
def test_an_un_graphed_linear_runs_its_runner_up_kernel_where_that_races_faster(monkeypatch):
    Store().put_winner(Winner(_key(), Library("eager"), FAST, FAST, runner_up=KERNEL, runner_up_ms=2 * FAST))
    resolve.invalidate()
    raced = _race_on_cpu(monkeypatch, [30.0, 10.0])
    layer = autofuse.get_linear(48, 80, activation="gelu", dtype=torch.float32, device="cpu")
    x = torch.randn(4, 48)
    with torch.no_grad(), use_policy(TINY_RACE):
        out = _race_through(lambda: layer(x), 3)
        again = layer(x)
    expected = linear(x, layer.weight, layer.bias, None, "gelu", KERNEL)
    assert torch.equal(out, expected) and torch.equal(again, expected)
    assert len(raced) == 1
    assert [t["linear"].config for t in raced[0]] == [Library("eager"), KERNEL, Library("cublas_bias_act")]
    assert layer.config_for(4) == {"linear": Library("eager")}  # the GPU-time winner, what graphs run
    assert layer.plain_config_for(4) == {"linear": KERNEL}
    entry = next(iter(layer._bound.values()))
    assert isinstance(entry, plain.Raced) and entry.device == layer.weight.device  # the race's marks and waits
    monkeypatch.setattr(plain, "_capturing", lambda: True)
    with torch.no_grad():
        graphed = layer(x)
    library = ops.get("linear").library["eager"]({"x": x, "w": layer.weight, "b": layer.bias, "r": None}, "gelu")
    assert torch.equal(graphed, library)


@ON_THE_CPU
def test_nothing_is_raced_above_host_bound_times_or_without_alternatives(monkeypatch):
    # A library path at library_host_bound_ms of GPU time: not raced (a kernel-only table at host_bound_ms).
    library_bound = current_policy().library_host_bound_ms
    Store().put_winner(Winner(_key(), Library("eager"), library_bound, library_bound, runner_up=KERNEL,
                              runner_up_ms=1.5 * library_bound))
    # No runner-up, and no other library path: without an activation, bias or residual, eager's one matmul
    # is the Linear's only library path.
    plain_key = Problem("linear", 80, 48, 8, torch.float32, "none").key(8, current_environment(torch.device("cpu")))
    Store().put_winner(Winner(plain_key, Library("eager"), FAST, FAST))
    resolve.invalidate()
    raced = _race_on_cpu(monkeypatch, [30.0, 10.0])
    layer = autofuse.get_linear(48, 80, activation="gelu", dtype=torch.float32, device="cpu")
    bare = autofuse.get_linear(48, 80, bias=False, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        layer(torch.randn(4, 48))
        bare(torch.randn(8, 48))
    assert raced == [] and layer.plain_config_for(4) == {"linear": Library("eager")}
    assert bare.plain_config_for(8) == {"linear": Library("eager")}
    assert layer.plain_config_for(16) is None  # no call at that M yet


@ON_THE_CPU
def test_an_un_graphed_linear_races_the_other_library_paths_where_no_kernel_is_kept(monkeypatch):
    Store().put_winner(Winner(_key(activation="gelu_tanh"), Library("cublaslt_gelu_tanh"), FAST, FAST))
    resolve.invalidate()
    raced = _race_on_cpu(monkeypatch, [30.0, 10.0, 20.0])
    layer = autofuse.get_linear(48, 80, activation="gelu_tanh", dtype=torch.float32, device="cpu")
    x = torch.randn(4, 48)
    with torch.no_grad(), use_policy(TINY_RACE):
        out = _race_through(lambda: layer(x), 3)
    assert [t["linear"].config for t in raced[0]] == [Library(n) for n in ("cublaslt_gelu_tanh", "eager",
                                                                            "cublas_bias_act")]
    assert layer.plain_config_for(4) == {"linear": Library("eager")}
    eager = ops.get("linear").library["eager"]({"x": x, "w": layer.weight, "b": layer.bias, "r": None}, "gelu_tanh")
    assert torch.equal(out, eager)


@ON_THE_CPU
def test_an_un_graphed_mlp_races_the_two_up_projection_ops(monkeypatch):
    # The interleaved module compares gated_pairs (here its library path, faster by GPU time) with gated_up.
    common = dict(bucket=4, activation="silu", bias=False)
    pairs_config = KernelConfig(16, 32, 32, group_m=1, num_stages=1)
    Store().put_winner(Winner(_key("gated_pairs", 80, 48, **common), Library("cublas_pairs"), FAST, FAST))
    Store().put_winner(Winner(_key("gated_up", 80, 48, **common), KERNEL, 2 * FAST, 3 * FAST))
    Store().put_winner(Winner(_key("down", 48, 80, bucket=4, activation="none", bias=False), pairs_config, FAST,
                              2 * FAST))
    resolve.invalidate()
    raced = _race_on_cpu(monkeypatch, [30.0, 10.0])
    mlp = autofuse.get_mlp(48, 80, activation="silu", dtype=torch.float32, device="cpu")
    assert mlp.config_for(4) == {"gated_pairs": Library("cublas_pairs"), "down": pairs_config}
    x = torch.randn(4, 48)
    with torch.no_grad(), use_policy(TINY_RACE):
        out = _race_through(lambda: mlp(x), 8)
    assert [list(t) for t in raced[0]][:2] == [["gated_pairs", "down"], ["gated_up", "down"]]
    assert mlp.plain_config_for(4) == {"gated_up": KERNEL, "down": pairs_config}
    g, u, d = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    h = ops.get("gated_up").run({"x": x, "wg": g, "wu": u, "bg": None, "bu": None}, "silu", KERNEL)
    assert torch.equal(out, linear(h, d, None, None, "none", pairs_config))


@pytest.mark.gpu
def test_on_a_gpu_the_race_runs_for_real_and_a_captured_call_runs_the_graphed_winner():
    key = Problem("linear", 256, 128, 1, torch.bfloat16, "gelu", True).key(1, current_environment(torch.device("cuda")))
    kernel = KernelConfig(16, 64, 64, group_m=1, num_warps=4, num_stages=3)
    Store().put_winner(Winner(key, Library("eager"), FAST, FAST, runner_up=kernel, runner_up_ms=FAST))
    resolve.invalidate()
    plain._decided.clear()
    layer = autofuse.get_linear(128, 256, activation="gelu", dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1, 128, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        racing = layer._bound_table(1, layer.weight).race_calls()
        for _ in range(racing):
            out = layer(x)
        out = layer(x)
        chosen = layer.plain_config_for(1)["linear"]
        operands = {"x": x, "w": layer.weight, "b": layer.bias, "r": None}
        expected = (linear(x, layer.weight, layer.bias, None, "gelu", kernel) if chosen == kernel else
                    ops.get("linear").library[chosen.name](operands, "gelu"))
        assert chosen in (kernel, Library("eager"), Library("cublas_bias_act")) and torch.equal(out, expected)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = layer(x)
        graph.replay()
        library = ops.get("linear").library["eager"]({"x": x, "w": layer.weight, "b": layer.bias, "r": None}, "gelu")
    torch.cuda.synchronize()
    assert torch.equal(captured, library)


def test_a_table_whose_host_time_is_over_a_gpu_bound_tables_estimate_is_dropped_without_a_window(monkeypatch):
    """A kernel table of 58 us of host for 108 of GPU time a call (its plain call is its GPU time) beside library
    tables of 153 and 117 us of host time: the first, over race_host_keep_bound above 108 (within race_host_keep), is
    dropped at the first call without a window (its probes had run at 212-296 us a call); the second is raced."""
    key = ("test", "host over bound")
    _on_queued_gpu(monkeypatch, key)
    policy = current_policy()
    winner = _Queued("library", host=153.0, gpu=100.0, gpu_ms=0.100)
    kernels = _Queued("kernels", host=58.0, gpu=108.0, gpu_ms=0.108)
    other = _Queued("other", host=117.0, gpu=110.0, gpu_ms=None)
    assert 108 * (1 + policy.race_host_keep_bound) < 153 < 108 * (1 + policy.race_host_keep)
    raced = plain.Raced(winner, [kernels, other], [winner.table, kernels.table, other.table], 128, key)
    raced("x")
    assert raced._alive == [False, True, True] and raced._start == 1
    assert winner.calls == 1 + plain.ESTIMATE_CALLS
    while raced.plain is None:
        raced("x")
    assert winner.calls == 1 + plain.ESTIMATE_CALLS and raced.plain is kernels


class _SlowFirstWindow(_Queued):
    """A _Queued entry whose GPU takes `slow` µs a call over the `calls` calls after its first 1 + ESTIMATE_CALLS (the
    race's first window after the first call)."""

    def __init__(self, name, host, gpu, gpu_ms, slow, calls):
        super().__init__(name, host, gpu, gpu_ms)
        self.steady, self.slow, self.window = gpu, slow, calls

    def __call__(self, *args):
        first = 1 + plain.ESTIMATE_CALLS
        self.gpu = self.slow if first <= self.calls < first + self.window else self.steady
        return super().__call__(*args)


def test_a_start_bound_by_its_gpu_time_runs_two_windows_and_its_first_bounds_no_checkpoint(monkeypatch):
    """The start (20 us of host for 100 of GPU time a call) reads 240 us a call in its first window after the first
    call, 100 after; a table of 160 us a call (1.6x) passed the checkpoint against that first window's reading and
    ran a whole window. The start runs a second window first, and the other table's checkpoint is held to the second's
    reading: dropped once the GPU reaches its checkpoint's mark."""
    key = ("test", "slow first window")
    _on_queued_gpu(monkeypatch, key)
    policy = current_policy()
    window, checkpoint = policy.race_calls, policy.race_checkpoint_calls
    start = _SlowFirstWindow("start", host=20.0, gpu=100.0, gpu_ms=0.100, slow=240.0, calls=window)
    other = _Queued("other", host=20.0, gpu=160.0, gpu_ms=None)
    assert 160 < 240 * (1 + policy.race_keep) and 160 > 100 * (1 + policy.race_keep)
    raced = plain.Raced(start, [other], [start.table, other.table], 128, key)
    raced("x")
    assert raced._plan[:2] == [(0, window, False)] * 2
    while raced.plain is None:
        raced("x")
    assert other.calls == 1 + plain.ESTIMATE_CALLS + 2 * checkpoint  # its mark waited for after twice its calls
    assert raced.plain is start and start.calls > 1 + plain.ESTIMATE_CALLS + 2 * window


def test_no_50_calls_hold_two_first_windows_of_slower_tables(monkeypatch):
    """Three tables 30% slower than the fastest whose first call after a switch of tables costs 10x the fastest's
    call (a library table's first call after another's): each first window ends at its first checkpoint, and three of
    the fastest's windows follow it, so that no 50 calls in a row hold two of them (with one, 50 calls cost 1.54x
    the fastest's, with two 1.36x)."""
    monkeypatch.setattr(plain, "_capturing", lambda: False)
    raced, _ = _raced(monkeypatch, [1.0, 1.3, 1.3, 1.3], key=("test", "spaced probes"))
    after = 1 + plain.ESTIMATE_CALLS
    raced.entries = [_ColdAfter("e0", 1.0, 1.0, 0), *(_ColdAfter(f"e{i}", 1.3, 10.0, after) for i in (1, 2, 3))]
    raced("x")  # the first call: every entry binds
    spent = _race_to_decision(raced)
    assert _worst_50(spent) <= 1.25 * 50
    assert raced.plain.name == "e0"


class _CountedKey(tuple):
    """A race key that counts how often it is hashed (a real key holds every table's configs: 3.1 us a hash for seven
    tables on a CPU)."""

    hashes = [0]

    def __hash__(self):
        self.hashes[0] += 1
        return tuple.__hash__(self)


def test_a_race_looks_up_another_modules_decision_between_windows_only(monkeypatch):
    """Each call inside a window runs the entry without hashing the key; a call that starts a window looks the
    decision of another module of the same key up (and settles on it)."""
    monkeypatch.setattr(plain, "_capturing", lambda: False)
    key = _CountedKey(("test", "hashed"))
    raced, _ = _raced(monkeypatch, [1.0, 1.1, 1.2], key=key)
    _CountedKey.hashes[0] = 0
    spent = _race_to_decision(raced)
    assert raced.calls == len(spent) > 100
    assert _CountedKey.hashes[0] <= len(spent) // current_policy().race_calls + 3
    # another module of the same key settles at its first call
    again, _ = _raced(monkeypatch, [1.0, 1.1, 1.2], key=key, fresh=False)
    assert again("x") == raced.plain.name and again.decided_after == 1
