"""Search policies behind one interface, so their quality can be compared on the same key.

A policy proposes configs; the driver evaluates them (compile, verify, time) and says how each
went. Every policy skips configs already tried (a resumed run repeats no work) and stops when
the driver's budget says so.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import Protocol

from ..configs import KernelConfig, SearchSpace
from ..store import TrialRecord
from .space import SearchProblem, candidates, config_from, feasible, flat_dimensions, flat_point

# evaluate(config) -> the trial's record; budget() -> False once trials or time are spent; prepare(configs): the
# configs about to be evaluated, to compile ahead (the driver compiles them at once on threads).
Evaluate = Callable[[KernelConfig], TrialRecord]
# Configs the Optuna policy proposes at a time, compiled at once (OptunaPolicy).
OPTUNA_BATCH = 1
Prepare = Callable[[list[KernelConfig]], None]


class Policy(Protocol):
    def run(self, evaluate: Evaluate, budget: Callable[[], bool], done: dict[KernelConfig, TrialRecord],
            prepare: Prepare | None = None) -> None: ...


class _ListPolicy:
    """Walks a fixed list of candidates in order, handing each next `ahead` untried ones to `prepare` first."""

    ahead = 16

    def __init__(self, candidates: Iterable[KernelConfig]) -> None:
        self.candidates = list(candidates)

    def run(self, evaluate, budget, done, prepare=None) -> None:
        todo = [config for config in self.candidates if config not in done]
        for start in range(0, len(todo), self.ahead):
            if not budget():
                return
            batch = todo[start:start + self.ahead]
            if prepare is not None:
                prepare(batch)
            for config in batch:
                if not budget():
                    return
                done[config] = evaluate(config)


class ExhaustivePolicy(_ListPolicy):
    """Every feasible config of the space, in the space's order."""


class RandomPolicy(_ListPolicy):
    """Every feasible config of the space, in a seeded random order."""

    def __init__(self, candidates: Iterable[KernelConfig], seed: int = 0) -> None:
        super().__init__(candidates)
        random.Random(seed).shuffle(self.candidates)


class OptunaPolicy:
    """TPE over the space's dimensions (categorical: the tile knobs, the variant, each variant's knobs),
    seeded. Trials already done (a resumed run) are handed to the study first, so the sampler learns from
    them and none is repeated. It proposes `batch` configs at a time (a constant liar stands in for the times of
    those not yet timed), so that `prepare` compiles them at once on threads before they are timed in turn: a
    trial's time is mostly its compile."""

    _MAX_SAMPLES_PER_TRIAL = 50  # infeasible or repeated samples cost nothing, but bound them

    def __init__(self, space: SearchSpace, problem: SearchProblem, shared_memory_limit: int, interpret: bool,
                 seed: int = 0, batch: int = OPTUNA_BATCH) -> None:
        self.space, self.problem = space, problem
        self.shared_memory_limit, self.interpret, self.seed = shared_memory_limit, interpret, seed
        self.batch = batch

    def run(self, evaluate, budget, done, prepare=None) -> None:
        import optuna  # here, not at the top: only a tuning run that uses it pays its import

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        dims = flat_dimensions(self.space, self.problem, self.interpret)
        distributions = {name: optuna.distributions.CategoricalDistribution(values) for name, values in dims.items()}
        sampler = optuna.samplers.TPESampler(seed=self.seed, constant_liar=self.batch > 1)
        study = optuna.create_study(direction="minimize", sampler=sampler)
        for config, record in done.items():
            params = flat_point(config, dims)
            if params is not None:
                study.add_trial(self._frozen(optuna, params, distributions, record))
        samples = 0
        while budget() and samples < self._MAX_SAMPLES_PER_TRIAL * (len(done) + 1):
            pending: list[tuple[object, KernelConfig]] = []  # asked, not yet told: each a config to time
            while len(pending) < self.batch and samples < self._MAX_SAMPLES_PER_TRIAL * (len(done) + 1):
                samples += 1
                trial = study.ask(distributions)
                config = config_from(trial.params)
                if config is not None:
                    config = feasible(config, self.problem, self.shared_memory_limit, self.interpret)
                if config is None:  # filtered out before compiling
                    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                elif config in done:  # timed before: told at once
                    self._tell(optuna, study, trial, done[config])
                else:
                    pending.append((trial, config))
            if prepare is not None and len(pending) > 1:
                prepare(list(dict.fromkeys(config for _, config in pending)))
            for trial, config in pending:
                if config not in done:
                    if not budget():  # the budget ran out inside the batch: the rest is never timed
                        study.tell(trial, state=optuna.trial.TrialState.FAIL)
                        continue
                    done[config] = evaluate(config)
                self._tell(optuna, study, trial, done[config])

    @staticmethod
    def _tell(optuna, study, trial, record: TrialRecord) -> None:
        if record.status == "ok":
            study.tell(trial, record.time_ms)
        else:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)

    @staticmethod
    def _frozen(optuna, params, distributions, record: TrialRecord):
        if record.status == "ok":
            return optuna.trial.create_trial(params=params, distributions=distributions, value=record.time_ms)
        return optuna.trial.create_trial(params=params, distributions=distributions,
                                         state=optuna.trial.TrialState.PRUNED)


def _optuna(space: SearchSpace, problem: SearchProblem, limit: int, interpret: bool, seed: int) -> Policy:
    return OptunaPolicy(space, problem, limit, interpret, seed=seed)


def _exhaustive(space: SearchSpace, problem: SearchProblem, limit: int, interpret: bool, seed: int) -> Policy:
    return ExhaustivePolicy(candidates(space, problem, limit, interpret))


def _random(space: SearchSpace, problem: SearchProblem, limit: int, interpret: bool, seed: int) -> Policy:
    return RandomPolicy(candidates(space, problem, limit, interpret), seed=seed)


# Search policies by name: the tuner and the CLI's --policy read this map.
POLICIES: dict[str, Callable[..., Policy]] = {"optuna": _optuna, "exhaustive": _exhaustive, "random": _random}


def make_policy(name: str, space: SearchSpace, problem: SearchProblem, shared_memory_limit: int, interpret: bool,
                seed: int = 0) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](space, problem, shared_memory_limit, interpret, seed)
