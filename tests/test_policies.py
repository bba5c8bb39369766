"""Search policies and the trial objective's typed failures."""

import os

import pytest
import torch

from autofuse.configs import INTERPRETER_SPACE, KernelConfig, Library, SearchSpace
from autofuse.evaluator import Evaluator
from autofuse.key import Problem, current_environment
from autofuse.ops import linear as linear_module
from autofuse.ops.linear import linear
from autofuse.store import Store, TrialRecord
from autofuse.tune.driver import Job, tune_key
from autofuse.tune.policies import ExhaustivePolicy, OptunaPolicy, RandomPolicy
from autofuse.tune.space import SearchProblem, candidates, feasible

PROBLEM = SearchProblem((1, 2), 37, 72, 40, torch.bfloat16)


def _fake_evaluate(log):
    def evaluate(config):
        log.append(config)
        return TrialRecord(config, "ok", float(config.block_m + config.block_n + config.block_k))
    return evaluate


def test_exhaustive_and_random_visit_every_candidate_once():
    found = candidates(INTERPRETER_SPACE, PROBLEM, 0, True)
    assert len(found) == len(set(found)) > 10
    for policy in (ExhaustivePolicy(found), RandomPolicy(found, seed=3)):
        log = []
        policy.run(_fake_evaluate(log), lambda: True, {})
        assert sorted(map(str, log)) == sorted(map(str, found))
    assert RandomPolicy(found, seed=3).candidates != found  # shuffled


def test_optuna_respects_budget_skips_done_and_never_repeats():
    done = {}
    log = []
    first = KernelConfig(64, 64, 64, group_m=8, num_warps=4, num_stages=1)
    done[first] = TrialRecord(first, "ok", 1.0)
    policy = OptunaPolicy(INTERPRETER_SPACE, PROBLEM, 0, True, seed=0)
    policy.run(_fake_evaluate(log), lambda: len(done) < 8, done)
    assert len(done) == 8 and len(log) == 7 and first not in log
    assert len(set(log)) == len(log)


def test_optuna_in_batches_compiles_each_batch_at_once_and_keeps_the_budget():
    done, log, batches = {}, [], []
    policy = OptunaPolicy(INTERPRETER_SPACE, PROBLEM, 0, True, seed=0, batch=4)
    policy.run(_fake_evaluate(log), lambda: len(done) < 10, done, batches.append)
    assert len(done) == 10 and len(log) == 10 and len(set(log)) == 10  # the budget ends inside the third batch
    assert [len(b) for b in batches] == [4, 4, 4] and log == [c for b in batches for c in b][:10]


def test_filters_drop_what_cannot_fit_before_compiling():
    space = SearchSpace()
    big = SearchProblem((1, 2), 4096, 16384, 2048, torch.bfloat16)
    assert feasible(KernelConfig(256, 256, 128, num_warps=4, num_stages=5), big, 232448, False) is None
    kept = candidates(space, big, 232448, False)
    assert 0 < len(kept) < space.size()
    small = SearchProblem((1, 1), 1, 40, 24, torch.float16)
    assert all(c.block_m == 16 and c.block_n <= 64 and c.block_k <= 32 for c in candidates(space, small, 232448, False))


def test_group_m_is_one_config_where_one_block_of_rows_covers_m():
    decode = SearchProblem((1, 2), 1, 4096, 2048, torch.bfloat16)
    configs = {feasible(KernelConfig(16, 64, 128, group_m=g, num_warps=4, num_stages=3), decode, 232448, False)
               for g in (1, 8, 16)}
    assert configs == {KernelConfig(16, 64, 128, group_m=1, num_warps=4, num_stages=3)}
    # Over several blocks of rows GROUP_M orders the tiles: each value stays a config of its own.
    prefill = SearchProblem((1, 2), 1024, 4096, 2048, torch.bfloat16)
    assert len({feasible(KernelConfig(64, 64, 128, group_m=g, num_warps=4, num_stages=3), prefill, 232448, False)
                for g in (1, 8, 16)}) == 3
    # The twins are gone: the whole space holds what its group_m=1 part holds.
    assert candidates(SearchSpace(), decode, 232448, False) == candidates(SearchSpace(group_m=(1,)), decode, 232448,
                                                                          False)


def test_a_list_policy_hands_its_next_trials_to_prepare_before_evaluating_them():
    found = candidates(INTERPRETER_SPACE, PROBLEM, 0, True)
    done = {found[0]: TrialRecord(found[0], "ok", 1.0)}
    events = []

    def evaluate(config):
        events.append(("evaluate", config))
        return TrialRecord(config, "ok", 1.0)
    policy = ExhaustivePolicy(found)
    policy.ahead = 4
    policy.run(evaluate, lambda: len(done) < 10, done, lambda batch: events.append(("prepare", tuple(batch))))
    prepared = [batch for kind, batch in events if kind == "prepare"]
    assert prepared == [tuple(found[1:5]), tuple(found[5:9]), tuple(found[9:13])]
    # Each batch is prepared before its first trial, and no tried config is prepared again.
    for batch in prepared:
        assert events.index(("prepare", batch)) < events.index(("evaluate", batch[0]))
    assert len(done) == 10 and [c for kind, c in events if kind == "evaluate"] == found[1:10]


def test_precompile_compiles_a_batch_at_once_and_leaves_failures_to_their_trials(monkeypatch):
    import threading
    import time

    evaluator = Evaluator(_key(), 37, torch.device("cpu"), compile_timeout_s=5)
    evaluator.interpret = False  # the GPU path
    running, most, lock = [0], [0], threading.Lock()
    cleaned = []

    def compile_and_sync(config):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        if config.block_k == 32:
            raise RuntimeError("a candidate that fails to compile")
    monkeypatch.setattr(evaluator, "_compile_and_sync", compile_and_sync)
    monkeypatch.setattr(evaluator, "_clean_up", lambda: cleaned.append(True))
    configs = [KernelConfig(32, 64, block_k, num_stages=s) for block_k in (32, 64) for s in (1, 2, 3, 4)]
    evaluator.precompile_all(configs, threads=4)
    assert most[0] == 4 and running[0] == 0 and cleaned == [True]
    evaluator.close()


# These drive the evaluator on CPU tensors, which only the interpreter runs; on a GPU machine the
# same paths are exercised by the GPU tuning tests.
cpu_interpreter_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                          reason="drives the tuner on CPU tensors under Triton's interpreter")


def _key(dtype=torch.float16):
    return Problem("linear", 40, 48, 37, dtype, "gelu", True, True).key(37, current_environment(torch.device("cpu")))


@cpu_interpreter_only
def test_a_wrong_kernel_is_recorded_as_wrong_and_never_wins(monkeypatch):
    real = linear

    def broken(x, w, b, r, act, config, out=None):
        y = real(x, w, b, r, act, config, out=out)
        if config.block_m == 16:  # this family of configs is "fast but wrong"
            y[0, 0] += 1.0
        return y

    monkeypatch.setattr(linear_module, "linear", broken)
    evaluator = Evaluator(_key(), 37, torch.device("cpu"))
    record = evaluator.evaluate(KernelConfig(16, 64, 64, num_stages=1))
    assert record.status == "wrong_result" and "relative error" in record.detail
    assert evaluator.evaluate(KernelConfig(32, 64, 64, num_stages=1)).status == "ok"
    result = tune_key(Job(_key(), 37, "t"), Store(), torch.device("cpu"), policy="exhaustive", trials=12)
    assert result.winner.config is not None and result.winner.config.block_m != 16
    assert result.failures.get("wrong_result", 0) >= 1


@cpu_interpreter_only
def test_unwritten_output_is_caught(monkeypatch):
    monkeypatch.setattr(linear_module, "linear", lambda x, w, b, r, act, config, out=None: out)  # writes nothing
    record = Evaluator(_key(), 37, torch.device("cpu")).evaluate(KernelConfig(32, 64, 64, num_stages=1))
    assert record.status == "wrong_result" and "unwritten" in record.detail


@cpu_interpreter_only
def test_a_crashing_candidate_is_a_typed_failure(monkeypatch):
    class OutOfResources(Exception):
        pass

    def crash(*args, **kwargs):
        raise OutOfResources("out of resource: shared memory, Required: 300000, Hardware limit: 232448")

    monkeypatch.setattr(linear_module, "linear", crash)
    record = Evaluator(_key(), 37, torch.device("cpu")).evaluate(KernelConfig(32, 64, 64, num_stages=1))
    assert record.status == "out_of_resources" and "shared memory" in record.detail

    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(linear_module, "linear", fail)
    # The library paths' times fixed: the interpreter's CPU timings of them are noise under load.
    monkeypatch.setattr(Evaluator, "library_ms", lambda self: {"eager": 1.0, "cublas_bias_act": 2.0})
    result = tune_key(Job(_key(), 37, "t"), Store(), torch.device("cpu"), policy="random", trials=3)
    assert result.winner.config == Library("eager")  # nothing worked: the fastest library path is the winner
    assert result.failures == {"error": 3}


@cpu_interpreter_only
def test_a_compile_that_overruns_its_limit_is_a_timeout_and_the_run_goes_on(monkeypatch):
    import threading
    import time

    release = threading.Event()
    evaluator = Evaluator(_key(), 37, torch.device("cpu"), compile_timeout_s=0.2)
    # Take the GPU path through _compile with a "compile" that hangs until released.
    evaluator.interpret = False
    monkeypatch.setattr(evaluator, "_compile_and_sync", lambda config: release.wait(30))
    start = time.perf_counter()
    record = evaluator.evaluate(KernelConfig(32, 64, 64, num_stages=1))
    assert record.status == "timeout" and record.detail == "compile took over 0.2 s"
    assert time.perf_counter() - start < 5  # the tuner stopped waiting; it did not hang
    release.set()
    # A later trial gets a fresh worker (the stuck one was abandoned) and completes normally.
    assert evaluator._pool is None
    monkeypatch.setattr(evaluator, "_compile_and_sync", lambda config: None)
    monkeypatch.setattr(evaluator, "_time", lambda fn: 1.0)  # the GPU timer; verification still runs
    assert evaluator.evaluate(KernelConfig(32, 64, 64, num_stages=1)).status == "ok"
    assert evaluator._pool is not None
    evaluator.close()


@cpu_interpreter_only
@pytest.mark.parametrize("side_by_side_kernel_ms", [3.0, 0.5], ids=["library-wins", "kernel-wins"])
def test_the_fastest_trial_is_retimed_beside_the_library_before_it_may_win(monkeypatch, side_by_side_kernel_ms):
    """Trials timed one by one say the kernel beats the library path (1 ms against 2); the final side-by-side
    timing decides, and the record keeps its times, not the trials'."""
    from autofuse.tune import driver

    monkeypatch.setattr(driver, "interpreting", lambda: False)  # times as a GPU reports them
    monkeypatch.setattr(driver, "cuda_index", lambda device: 0)
    monkeypatch.setattr(driver, "shared_memory_limit", lambda index: 232448)  # an H100's, for the search space
    monkeypatch.setattr(Evaluator, "library_ms", lambda self: {"eager": 2.0})
    real_evaluate = Evaluator.evaluate

    def evaluate(self, config):
        record = real_evaluate(self, config)  # compiled and verified for real, under the interpreter
        return TrialRecord(config, record.status, 1.0 if record.status == "ok" else None, record.detail)
    monkeypatch.setattr(Evaluator, "evaluate", evaluate)
    retimed = []

    def side_by_side_ms(self, fns):
        retimed.append(sorted(fns))
        return {"kernel": side_by_side_kernel_ms, "kernel 2": side_by_side_kernel_ms + 0.1, "library:eager": 2.5}
    monkeypatch.setattr(Evaluator, "side_by_side_ms", side_by_side_ms)
    result = tune_key(Job(_key(), 37, "t"), Store(), torch.device("cpu"), policy="random", trials=2)
    # Both trials timed 1.0 ms, a near tie: both are timed again beside the library path.
    assert retimed == [["kernel", "kernel 2", "library:eager"]]
    winner = result.winner
    assert winner.baseline_ms == 2.5
    if side_by_side_kernel_ms > 2.5:
        assert winner.config == Library("eager") and winner.time_ms == 2.5
    else:
        assert isinstance(winner.config, KernelConfig) and winner.time_ms == 0.5


@cpu_interpreter_only
def test_the_trials_near_the_fastest_are_retimed_side_by_side_and_the_fastest_there_wins(monkeypatch):
    """Trials timed one by one: 1.00, 1.05 and 1.08 ms (near ties) and 2.0 (not); side by side the third is fastest."""
    from autofuse.tune import driver

    monkeypatch.setattr(driver, "interpreting", lambda: False)
    monkeypatch.setattr(driver, "cuda_index", lambda device: 0)
    monkeypatch.setattr(driver, "shared_memory_limit", lambda index: 232448)
    monkeypatch.setattr(Evaluator, "library_ms", lambda self: {"eager": 5.0})
    one_by_one = iter([1.0, 1.05, 1.08, 2.0])
    real_evaluate = Evaluator.evaluate

    def evaluate(self, config):
        record = real_evaluate(self, config)
        assert record.status == "ok"
        return TrialRecord(config, "ok", next(one_by_one))
    monkeypatch.setattr(Evaluator, "evaluate", evaluate)
    asked = []

    def side_by_side_ms(self, fns):
        asked.append(sorted(fns))
        return {"kernel": 1.2, "kernel 2": 1.1, "kernel 3": 0.9, "library:eager": 5.0}
    monkeypatch.setattr(Evaluator, "side_by_side_ms", side_by_side_ms)
    store = Store()
    result = tune_key(Job(_key(), 37, "t"), store, torch.device("cpu"), policy="random", trials=4)
    assert asked == [["kernel", "kernel 2", "kernel 3", "library:eager"]]
    third = next(t for t in store.trials(_key()) if t.time_ms == 1.08)
    assert result.winner.config == third.config and result.winner.time_ms == 0.9
