"""Tune keys: expand a shapes file into keys, run a policy per key under a budget, keep the winner.

Each trial is written to the store as it finishes, so a killed run loses at most the trial in
flight and `resume=True` picks up where it stopped. Every library candidate of the op is timed
too; when no kernel beats the fastest of them, the key's winner is that library path, so a tuned
module is never slower than its library paths on the tuned key. Under the interpreter timings mean
nothing, so there the best kernel wins.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

import torch

from .. import ops, variants
from ..choose import lookup
from ..choose.heuristics import alternatives_for, device_info, heuristic_for, search_starts_for
from ..choose.policy import current as current_policy
from ..choose.winner import Outcome, choose_winner, fastest_trial, near_fastest
from ..configs import KernelConfig, SearchSpace, Shape
from ..device import cuda_index, interpreting, shared_memory_limit
from ..evaluator import Evaluator
from ..key import Problem, TuningKey, current_environment
from ..resources import user_cache_dir
from ..shapes import ShapeSet
from ..store import Store, TrialRecord, Winner
from .policies import POLICIES, make_policy
from .progress import RunProgress, plural
from .space import SearchProblem

logger = logging.getLogger("autofuse")


@dataclasses.dataclass(frozen=True)
class Job:
    """One key to tune, at the M it stands for."""

    key: TuningKey
    M: int
    label: str  # e.g. "gemma-2b gated_up"


def jobs_for_shapes(shapes: ShapeSet, device: torch.device, train: bool = False,
                    only: set[str] | None = None) -> list[Job]:
    """One job per key the shapes need: each registered op that serves an MLP or a Linear in the shapes' weight
    format (OpSpec.weights: dense, fp8 or w8a8) gets a key per entry whose module runs it (OpSpec.keyed_for) and M
    (within the op's max_m; training ops only with `train`); `only` keeps those ops."""
    env = current_environment(device)
    entries = {"mlp": shapes.mlps, "linear": shapes.linears}
    jobs = []
    for M in shapes.tokens:
        for spec in ops.specs():
            if not spec.serves or (spec.training and not train) or (spec.max_m is not None and M > spec.max_m):
                continue
            if spec.weights != shapes.weights:
                continue
            for entry in entries[spec.serves]:
                if not spec.runs_for(entry):
                    continue
                for n, k, activation in spec.keyed_dims(entry, M, train):
                    key = Problem(spec.name, n, k, M, shapes.dtype, activation, entry.bias).key(M, env)
                    jobs.append(Job(key, M, f"{entry.name} {spec.name}"))
    # One job per key: two shapes may share a projection.
    unique = {job.key: job for job in jobs if only is None or job.key.op in only}
    return list(unique.values())


# Trials per key by default. Exhaustive sweeps of five keys of a Llama-3.2-1B-shaped MLP (decode, prefill, the
# backward; H100 and H200), Optuna replayed on their measured times: the median regret over the sweep's best is
# 0-7.5% after the heuristic and 20 trials, 0-6.4% after 30 (at most 2.9% on all but the one-launch MLP at M = 1,
# which the plans seldom run) and 0-1.3% after 40. 30 buys most of 40's quality for three quarters of its time.
DEFAULT_TRIALS = 30


@dataclasses.dataclass(frozen=True)
class TuneOptions:
    """How a key is tuned: the search policy, its budget (trials, or seconds, whichever ends first), the seed,
    whether to resume from stored trials, whether to store the winner over a faster stored record, and a
    search space of one's own (default: the op's)."""

    policy: str = "optuna"
    trials: int | None = DEFAULT_TRIALS
    time_budget_s: float | None = None
    seed: int = 0
    resume: bool = False
    replace: bool = False
    space: SearchSpace | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")

    @classmethod
    def of(cls, options: TuneOptions | None, overrides: dict) -> TuneOptions:
        """`options` (default TuneOptions()) with the given fields replaced."""
        return dataclasses.replace(options or cls(), **overrides)


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
    final: bool = False  # the key's last report: its trials are over
    exhausted: bool = False  # ...because the search space had no untried config left


@dataclasses.dataclass
class KeyResult:
    winner: Winner  # the record the key holds after the run
    resumed: int  # trials found from an earlier run
    new: int  # trials run now
    failures: dict[str, int]
    # This run's winner, where the stored record outranked it and was kept (store.outranked_by).
    not_stored: Winner | None = None


class _Budget:
    """Trials and seconds left for one key, and its progress reports."""

    def __init__(self, job: Job, options: TuneOptions, baseline_ms: float, resumed: int, done: dict,
                 progress: Callable[[Progress], None] | None) -> None:
        self.job, self.trials, self.time_budget_s = job, options.trials, options.time_budget_s
        self.baseline_ms = baseline_ms
        self.resumed, self.done, self.progress = resumed, done, progress
        self.start = time.perf_counter()
        self.new = 0

    def left(self) -> bool:
        if self.trials is not None and len(self.done) >= self.trials:
            return False
        return self.time_budget_s is None or self.elapsed() < self.time_budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def trials_left(self, at_most: int) -> int:
        """How many more trials the budget allows, up to `at_most` (a time budget: `at_most`)."""
        return at_most if self.trials is None else max(0, min(at_most, self.trials - len(self.done)))

    def report(self, final: bool = False) -> None:
        if self.progress is None:
            return
        elapsed = self.elapsed()
        remaining = None if self.trials is None else max(self.trials - len(self.done), 0)
        eta = elapsed / self.new * remaining if self.new and remaining is not None else None
        if self.time_budget_s is not None:
            eta = min(eta if eta is not None else self.time_budget_s, max(self.time_budget_s - elapsed, 0.0))
        times = [t.time_ms for t in self.done.values() if t.status == "ok"]
        self.progress(Progress(self.job, len(self.done), self.trials, min(times) if times else None, self.baseline_ms,
                               elapsed, eta, self.resumed, final=final, exhausted=final and self.left()))


# Kernels (the fastest trial and those within a near tie of it) timed again side by side with the library paths.
_RETIMED_KERNELS = 4


def run_trials(job: Job, store: Store, device: torch.device, options: TuneOptions,
               progress: Callable[[Progress], None] | None = None) -> tuple[Outcome, int]:
    """Time the op's library candidates, then the heuristic's config and the policy's picks, each trial stored
    as it ends; then, where times mean speed, the fastest trial and those within a near tie of it again beside
    every library candidate (Evaluator.retimed_side_by_side): the fastest of many separately timed trials is
    partly the luckiest, and must not win against library times taken once at the start. Returns (what was
    timed, with the fastest kernel of that retiming as its confirmed trial where times mean speed; how many
    trials were resumed)."""
    key, M = job.key, job.M
    start = time.perf_counter()
    if not options.resume:
        store.clear_trials(key)
    done: dict[KernelConfig, TrialRecord] = {t.config: t for t in store.trials(key)}
    resumed = len(done)
    evaluator = Evaluator(key, M, device, seed=options.seed, budget_ms=current_policy().trial_budget_ms)
    try:
        library_ms = evaluator.library_ms()
        budget = _Budget(job, options, min(library_ms.values()), resumed, done, progress)

        def evaluate(config: KernelConfig) -> TrialRecord:
            record = evaluator.evaluate(config)
            store.put_trial(key, record)  # persisted before the next trial starts
            budget.new += 1
            done[config] = record
            budget.report()
            return record

        budget.report()
        at_m = Problem(key.op, key.n, key.k, M, key.torch_dtype, key.activation, key.bias, key.residual, device)
        heuristic = heuristic_for(at_m)
        shape = Shape(M, key.n, key.k, key.torch_dtype)
        interpret = interpreting()
        limit = 0 if interpret else shared_memory_limit(cuda_index(device))
        space = options.space or key.spec.search_space(interpret)
        problem = SearchProblem(key.spec.operand_tiles, M, key.n, key.k, key.torch_dtype,
                                space.searched(variants.applicable(key.spec, device_info(device), shape)))
        # The search starts from the heuristic's config, the key's stored kernel (a first-use check's or an earlier
        # tuning's) and the configs a first-use check times beside the heuristic's, so that a run never ends slower
        # than what first use chose (6096 -> 26336 at M = 16 on an H100: a run of 30 trials with a time budget kept
        # a split-K tile, 239.5 us graph-replayed, over the 16x64x256 tile first use had run, 229.4), then the op's
        # measured starting points (the GEMV's at decode's smallest M), where the space searches their variant.
        def prepare(configs: list[KernelConfig]) -> None:  # compile the trials about to run, at once
            evaluator.precompile_all(configs[:budget.trials_left(len(configs))], _compile_threads())

        stored = store.get_winner(key)
        kept = (stored.config,) if stored is not None and isinstance(stored.config, KernelConfig) else ()
        starts = [c for c in dict.fromkeys((heuristic, *kept, *alternatives_for(at_m), *search_starts_for(at_m)))
                  if c not in done and any(v.name == c.variant for v in problem.kinds)]
        if len(starts) > 1:
            prepare(starts)
        for config in starts:
            if budget.left():
                evaluate(config)
        make_policy(options.policy, space, problem, limit, interpret, options.seed).run(evaluate, budget.left, done,
                                                                                       prepare)
        budget.report(final=True)  # budget left over means the space ran out of untried configs
        confirmed = fastest_trial(done)
        if confirmed is not None and not interpret:
            rivals = near_fastest(done, _RETIMED_KERNELS)[1:]
            with torch.no_grad():
                confirmed, library_ms = evaluator.retimed_side_by_side(confirmed, library_ms, list(library_ms), rivals)
            logger.info("%s: fastest trial %s retimed beside the library candidates: %.4f ms against %s", key.op,
                        confirmed.config.short(), confirmed.time_ms,
                        ", ".join(f"{name} {ms:.4f}" for name, ms in library_ms.items()))
    finally:
        evaluator.close()
    return Outcome(done, library_ms, heuristic, time.perf_counter() - start, confirmed), resumed


def _compile_threads() -> int:
    """Threads that compile a list policy's next trials at once: one per core the process may use, at most 16."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(16, cores))


def tune_key(job: Job, store: Store, device: torch.device, options: TuneOptions | None = None,
             progress: Callable[[Progress], None] | None = None, **overrides) -> KeyResult:
    """Run one key's trials, then choose its winner by the policy's rule (choose/winner.py) and store it,
    unless the stored record outranks it (store.outranked_by: e.g. a faster tuned record) and
    `options.replace` is off. `overrides`: fields of TuneOptions to change (policy="random", trials=3)."""
    options = TuneOptions.of(options, overrides)
    outcome, resumed = run_trials(job, store, device, options, progress)
    policy = current_policy()
    winner = choose_winner(job.key, outcome, options.policy, times_mean_speed=not interpreting(),
                           kernel_margin=policy.tune_margin)
    stored = store.put_winner(winner, replace=options.replace)
    done = outcome.done
    failures: dict[str, int] = {}
    for t in done.values():
        if t.status != "ok":
            failures[t.status] = failures.get(t.status, 0) + 1
    return KeyResult(stored, resumed, len(done) - resumed, failures, None if stored is winner else winner)


# What a key's tuning costs beside its GEMM's size, in multiply-adds: on a GPU compiling and timing each
# trial (about what timing a 4096 x 4096 x 4096 GEMM adds); under the interpreter almost nothing, since
# every trial computes the whole product in NumPy.
_KEY_OVERHEAD = {False: 2**36, True: 2**16}


def key_weight(job: Job, interpret: bool) -> float:
    """A key's relative cost in a run, for the run's ETA: its multiply-adds plus a per-key overhead."""
    return job.M * job.key.n * job.key.k + _KEY_OVERHEAD[interpret]


def tune_shapes(shapes: ShapeSet, device: torch.device, options: TuneOptions | None = None, *, train: bool = False,
                only: set[str] | None = None, progress: RunProgress | None = None,
                **overrides) -> list[tuple[Job, KeyResult]]:
    """Tune every key of `shapes` (only the ops in `only` when given) into the user cache; the runtime
    sees the winners at once. `progress` (the CLI's status lines) hands each key its callback and is told
    what each key weighs (key_weight), for an ETA that scales with the keys to come; each finished key is
    also logged. `overrides`: fields of TuneOptions to change."""
    options = TuneOptions.of(options, overrides)
    jobs = jobs_for_shapes(shapes, device, train=train, only=only)
    budget = f" or {options.time_budget_s:g} s" if options.time_budget_s else ""
    logger.info("tuning %s (%s) with %s, %s trials%s each, cache %s", plural(len(jobs), "key"),
                str(shapes.dtype).removeprefix("torch."), options.policy, options.trials, budget, user_cache_dir())
    return tune_jobs([(job, options) for job in jobs], device, progress)


def tune_jobs(jobs: list[tuple[Job, TuneOptions]], device: torch.device, progress: RunProgress | None = None
              ) -> list[tuple[Job, KeyResult]]:
    """Tune each job with its own options into the user cache (tune_shapes' jobs share one; a run from recorded
    traffic gives each key its share of the budget); the runtime sees the winners at once."""
    store = Store(user_cache_dir())
    if progress is not None:
        progress.weights = [key_weight(job, interpreting()) * _budget_weight(options) for job, options in jobs]
    results = []
    try:
        for i, (job, options) in enumerate(jobs, 1):
            line = progress.for_key(i, len(jobs)) if progress is not None else None
            result = tune_key(job, store, device, options, progress=line)
            logger.debug("tuned %s M=%d: %s", job.label, job.M, result.winner.config.short())
            results.append((job, result))
    except KeyboardInterrupt:
        raise TuningInterrupted(len(results), len(jobs)) from None
    finally:
        lookup.invalidate()
        store.close()
    return results


def _budget_weight(options: TuneOptions) -> float:
    """How a key's budget scales its cost, for the run's ETA: its trials (seconds, where only those are set)."""
    if options.trials is not None:
        return float(options.trials)
    return options.time_budget_s or 1.0


class TuningInterrupted(KeyboardInterrupt):
    """Ctrl-C during tune_shapes, with how far the run got: the finished keys' winners and every
    finished trial are stored, so the same run started again continues where this one stopped."""

    def __init__(self, done: int, total: int) -> None:
        super().__init__(f"{done} of {total} keys done")
        self.done, self.total = done, total
