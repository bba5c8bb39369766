"""Tune keys: expand a shapes file into keys, run a policy per key under a budget, keep the winner.

Each trial is written to the store as it finishes, so a killed run loses at most the trial in
flight and `resume=True` picks up where it stopped. The eager PyTorch baseline is timed for every
key; when no candidate beats it the key's winner is the baseline, so a tuned module is never
slower than eager. Under the interpreter timings mean nothing, so there the best candidate wins.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable

import torch

from ..configs import KernelConfig
from ..device import cuda_index, interpreting, shared_memory_limit, tma_usable
from ..key import TuningKey, current_environment, make_key
from ..resolve import heuristic_for
from ..shapes import ShapeSet
from ..store import Store, TrialRecord, Winner
from .objective import Evaluator
from .policies import ExhaustivePolicy, OptunaPolicy, Policy, RandomPolicy
from .space import MLP_MAX_M, Problem, SearchSpace, candidates, default_space


@dataclasses.dataclass(frozen=True)
class Job:
    """One key to tune, at the M it stands for."""

    key: TuningKey
    M: int
    label: str  # e.g. "gemma-2b gated_up"


def jobs_for_shapes(shapes: ShapeSet, device: torch.device, train: bool = False,
                    ops: set[str] | None = None) -> list[Job]:
    """One job per key the shapes need; `train` adds each MLP's backward kernel; `ops` keeps only those ops."""
    env = current_environment(device)
    jobs = []
    for M in shapes.tokens:
        for mlp in shapes.mlps:
            jobs.append(Job(make_key("gated_up", mlp.d_ff, mlp.d_model, M, shapes.dtype, mlp.activation, mlp.bias,
                                     False, env), M, f"{mlp.name} gated_up"))
            jobs.append(Job(make_key("down", mlp.d_model, mlp.d_ff, M, shapes.dtype, "none", mlp.bias, False, env),
                            M, f"{mlp.name} down"))
            if M <= MLP_MAX_M:  # the whole MLP in one launch competes with the two kernels above
                jobs.append(Job(make_key("mlp", mlp.d_ff, mlp.d_model, M, shapes.dtype, mlp.activation, mlp.bias,
                                         False, env), M, f"{mlp.name} mlp"))
            if train:
                jobs.append(Job(make_key("gated_bwd", mlp.d_ff, mlp.d_model, M, shapes.dtype, mlp.activation,
                                         mlp.bias, False, env), M, f"{mlp.name} gated_bwd"))
        for lin in shapes.linears:
            jobs.append(Job(make_key("linear", lin.out_features, lin.in_features, M, shapes.dtype, lin.activation,
                                     lin.bias, False, env), M, f"{lin.name} linear"))
    # One job per key: two shapes may share a projection.
    unique = {job.key: job for job in jobs if ops is None or job.key.op in ops}
    return list(unique.values())


@dataclasses.dataclass
class Progress:
    job: Job
    trials_done: int
    trials_budget: int | None
    best_ms: float | None
    baseline_ms: float
    elapsed_s: float
    eta_s: float | None
    resumed: int


@dataclasses.dataclass
class KeyResult:
    winner: Winner
    resumed: int  # trials found from an earlier run
    new: int  # trials run now
    failures: dict[str, int]


def make_policy(name: str, problem: Problem, device: torch.device, seed: int,
                space: SearchSpace | None = None) -> Policy:
    interpret = interpreting()
    space = space or default_space(problem.template, interpret)
    limit = 0 if interpret else shared_memory_limit(cuda_index(device))
    if name == "optuna":
        return OptunaPolicy(space, problem, limit, interpret, seed=seed)
    found = candidates(space, problem, limit, interpret)
    if name == "exhaustive":
        return ExhaustivePolicy(found)
    if name == "random":
        return RandomPolicy(found, seed=seed)
    raise ValueError(f"unknown policy {name!r}")


def tune_key(job: Job, store: Store, device: torch.device, *, policy: str = "optuna", trials: int | None = 20,
             time_budget_s: float | None = None, resume: bool = False, seed: int = 0,
             space: SearchSpace | None = None, progress: Callable[[Progress], None] | None = None) -> KeyResult:
    key, M = job.key, job.M
    if not resume:
        store.clear_trials(key)
    done: dict[KernelConfig, TrialRecord] = {t.config: t for t in store.trials(key)}
    resumed = len(done)
    start = time.perf_counter()
    evaluator = Evaluator(key, M, device, seed=seed)
    try:
        baseline_ms = evaluator.baseline_ms()
        problem = Problem(key.template, M, key.n, key.k, key.torch_dtype,
                          tma=tma_usable(device, key.k, key.torch_dtype))
        counter = {"new": 0}

        def best_ms() -> float | None:
            times = [t.time_ms for t in done.values() if t.status == "ok"]
            return min(times) if times else None

        def report() -> None:
            if progress is None:
                return
            elapsed = time.perf_counter() - start
            n_new = counter["new"]
            remaining = None if trials is None else max(trials - len(done), 0)
            eta = elapsed / n_new * remaining if n_new and remaining is not None else None
            if time_budget_s is not None:
                eta = min(eta if eta is not None else time_budget_s, max(time_budget_s - elapsed, 0.0))
            progress(Progress(job, len(done), trials, best_ms(), baseline_ms, elapsed, eta, resumed))

        def evaluate(config: KernelConfig) -> TrialRecord:
            record = evaluator.evaluate(config)
            store.put_trial(key, record)  # persisted before the next trial starts
            counter["new"] += 1
            done[config] = record
            report()
            return record

        def budget() -> bool:
            if trials is not None and len(done) >= trials:
                return False
            return time_budget_s is None or time.perf_counter() - start < time_budget_s

        report()
        heuristic = heuristic_for(key.template, M, key.n, key.k, key.torch_dtype, device)
        if heuristic not in done and budget():
            evaluate(heuristic)
        make_policy(policy, problem, device, seed, space).run(evaluate, budget, done)
    finally:
        evaluator.close()

    ok = [t for t in done.values() if t.status == "ok"]
    best = min(ok, key=lambda t: t.time_ms) if ok else None
    heuristic_record = done.get(heuristic)
    heuristic_ms = heuristic_record.time_ms if heuristic_record and heuristic_record.status == "ok" else None
    if best is not None and (interpreting() or best.time_ms < baseline_ms):
        config, time_ms = best.config, best.time_ms
    else:
        config, time_ms = None, baseline_ms
    winner = Winner(key, config, time_ms, baseline_ms, heuristic_ms, len(done), time.perf_counter() - start, policy)
    store.put_winner(winner)
    failures: dict[str, int] = {}
    for t in done.values():
        if t.status != "ok":
            failures[t.status] = failures.get(t.status, 0) + 1
    return KeyResult(winner, resumed, counter["new"], failures)


def tune_shapes(shapes: ShapeSet, device: torch.device, *, train: bool = False, ops: set[str] | None = None,
                trials: int | None = 20, time_budget_s: float | None = None, policy: str = "optuna",
                resume: bool = False, seed: int = 0) -> list[tuple[Job, KeyResult]]:
    """Tune every key of `shapes` (only `ops` when given) into the user cache, one status line per
    key on stderr; the runtime sees the winners at once."""
    from .. import resolve as resolve_module
    from ..store import cache_dir
    from .progress import ProgressLine

    store = Store(cache_dir())
    jobs = jobs_for_shapes(shapes, device, train=train, ops=ops)
    budget = f" or {time_budget_s:g} s" if time_budget_s else ""
    print(f"tuning {len(jobs)} keys with {policy}, {trials} trials{budget} each, cache {store.directory}",
          file=sys.stderr, flush=True)
    results = []
    try:
        for i, job in enumerate(jobs, 1):
            line = ProgressLine(f"[{i}/{len(jobs)}]")
            result = tune_key(job, store, device, policy=policy, trials=trials, time_budget_s=time_budget_s,
                              resume=resume, seed=seed, progress=line)
            line.finish()
            results.append((job, result))
    finally:
        resolve_module.invalidate()
        store.close()
    return results
