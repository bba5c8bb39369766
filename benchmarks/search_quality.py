"""How close does the tuner's search come to an exhaustive sweep of its space?

  measure (a CUDA GPU):  python benchmarks/search_quality.py measure [--keys decode,prefill,backward]
                             [--trials 30] [--tuned-cache DIR] [--work DIR] [--sweep-budget-ms 20] [--out DIR]
  simulate (anywhere):   python benchmarks/search_quality.py simulate FILE [--seeds 20] [--budgets 5,10,20,40]
                             [--patience P]

measure samples the keys of a Llama-3.2-1B-shaped MLP (d_model 2048, d_ff 8192, SwiGLU, bf16): decode (M = 1:
gated_pairs and the one-launch mlp, each over its whole search space), prefill (M = 1024: gated_up and down) and
the training backward (M = 1024: gated_bwd), these three over the large tiles of LARGE_TILES (the whole space
holds 4,000-5,000 configs there: too long for one run). Per key:
  1. the tuned record: the one in --tuned-cache (e.g. what `autofuse tune --traffic` stored; see
     benchmarks/traffic_tune.py --keep-cache), else a tuning run as users run it (Optuna, --trials) into an empty
     cache;
  2. every config of the sweep's space through the exhaustive policy (compiled ahead on threads, 16 at a time),
     each trial kept in --work as it ends, so that a killed run continues where it stopped;
  3. the tuned record's config and the sweep's fastest timed again side by side (replayed in turn): the tuned
     kernel's speed as a fraction of the sweep's best.
Writes search_quality.json (every trial's config, status and time) to --out (default benchmarks/results/<gpu>/).

simulate replays the default policy (Optuna's TPE, after the heuristic's config, as the tuner runs it) and random
search against a measured table, many seeds each: every proposal is answered with its measured time, so the
policies are compared on identical numbers, free of timing noise. Per key and budget (trials after the
heuristic's): the regret (the best config found over the sweep's best, minus 1), median and worst over the
seeds, and the trials each needed to come within 3% of the sweep's best.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import harness
import torch

from autofuse import ops, variants
from autofuse.configs import KernelConfig, Library, SearchSpace, Shape
from autofuse.store import TrialRecord
from autofuse.tune.driver import DEFAULT_TRIALS
from autofuse.tune.policies import OPTUNA_BATCH
from autofuse.tune.space import SearchProblem, candidates

D_MODEL, D_FF, ACTIVATION = 2048, 8192, "silu"
# At M = 1024 the whole space holds 4,000-5,000 configs per key; these large tiles hold 224-392.
LARGE_TILES = SearchSpace(block_m=(64, 128, 256), block_n=(64, 128, 256), block_k=(32, 64, 128), group_m=(1, 8),
                          num_warps=(4, 8), num_stages=(3, 4, 5))
# (group, label, op, M, sweep space: None for the op's whole space)
KEYS = [
    ("decode", "gated_pairs M=1", "gated_pairs", 1, None),
    ("decode", "mlp (one launch) M=1", "mlp", 1, None),
    ("prefill", "gated_up M=1024", "gated_up", 1024, LARGE_TILES),
    ("prefill", "down M=1024", "down", 1024, LARGE_TILES),
    ("backward", "gated_bwd M=1024", "gated_bwd", 1024, LARGE_TILES),
]
WITHIN = 0.03  # "found": within 3% of the sweep's best


def _dims(op: str) -> tuple[int, int, str]:
    """(n, k, activation) of an op of the sampled MLP (the down projection's activation is its own, not the
    MLP's)."""
    from autofuse.shapes import MLPShape

    return ops.get(op).dims(MLPShape("llama-3.2-1b", D_MODEL, D_FF, ACTIVATION, False), 1)


def measure(args) -> None:
    import dataclasses as dc

    from autofuse.choose.heuristics import device_info
    from autofuse.choose.policy import current, use
    from autofuse.evaluator import Evaluator
    from autofuse.key import Problem, current_environment
    from autofuse.store import Store
    from autofuse.tune.driver import Job, tune_key

    device = torch.device("cuda")
    info = device_info(device)
    groups = set(args.keys.split(","))
    work = Path(args.work or tempfile.mkdtemp(prefix="search-quality-"))
    sweeps = Store(str(work / "sweep"))
    tuned_store = Store(args.tuned_cache) if args.tuned_cache else Store(str(work / "tuned"))
    results = []
    for group, label, op, M, space in KEYS:
        if group not in groups:
            continue
        n, k, activation = _dims(op)
        key = Problem(op, n, k, M, torch.bfloat16, activation).key(M, current_environment(device))
        job = Job(key, M, label)
        spec = ops.get(op)
        space = space or spec.search_space(False)
        kinds = space.searched(variants.applicable(spec, info, Shape(M, n, k, torch.bfloat16)))
        size = len(candidates(space, SearchProblem(spec.operand_tiles, M, n, k, torch.bfloat16, kinds),
                              info.shared_memory_limit, False))
        tuned = tuned_store.get_winner(key)
        source = "tuned cache"
        if tuned is None or args.tuned_cache is None:
            start = time.perf_counter()
            tuned = tune_key(job, tuned_store, device, trials=args.trials).winner
            source = f"tuned now, optuna, {args.trials} trials, {time.perf_counter() - start:.0f} s"
        print(f"{label}: sweeping {size} configs ({', '.join(v.name for v in kinds)}); tuned record "
              f"{tuned.config.short()} ({source})", flush=True)
        start = time.perf_counter()
        with use(dc.replace(current(), trial_budget_ms=args.sweep_budget_ms)):
            swept = tune_key(job, sweeps, device, policy="exhaustive", trials=None, space=space, resume=True)
        seconds = time.perf_counter() - start
        trials = sweeps.trials(key)
        best = min((t for t in trials if t.status == "ok"), key=lambda t: t.time_ms)
        evaluator = Evaluator(key, M, device, budget_ms=current().trial_budget_ms)
        try:
            with torch.no_grad():
                side = evaluator.side_by_side_ms({"tuned": evaluator.runner(tuned.config),
                                                  "sweep": evaluator.runner(best.config)})
        finally:
            evaluator.close()
        ratio = side["sweep"] / side["tuned"]
        print(f"{label}: {len(trials)} trials in {seconds:.0f} s, best {best.config.short()} {best.time_ms:.4f} ms; "
              f"side by side: tuned {side['tuned']:.4f} ms, sweep's best {side['sweep']:.4f} ms "
              f"(tuned at {ratio:.3f} of its speed)", flush=True)
        results.append({
            "group": group, "label": label, "op": op, "n": n, "k": k, "M": M, "activation": activation,
            "space": space.dimensions(), "variants": [v.name for v in kinds],
            "shared_memory_limit": info.shared_memory_limit, "multiprocessors": info.multiprocessors,
            "capability": list(info.capability), "sweep_seconds": seconds, "sweep_budget_ms": args.sweep_budget_ms,
            "library_ms": swept.winner.baseline_ms, "heuristic": _heuristic(key, M, device).to_dict(),
            "tuned": {"config": _config_json(tuned.config), "source": source},
            "side_by_side_ms": side, "tuned_speed_of_sweep_best": ratio,
            "trials": [t.to_json() for t in trials],
        })
        harness.write(harness.out_dir(args.out), "search_quality.json", {"keys": results})


def _heuristic(key, M: int, device: torch.device) -> KernelConfig:
    from autofuse.choose.heuristics import heuristic_for
    from autofuse.key import Problem

    return heuristic_for(Problem(key.op, key.n, key.k, M, key.torch_dtype, key.activation, key.bias, key.residual,
                                 device))


def _config_json(config: KernelConfig | Library):
    return config.to_dict() if isinstance(config, KernelConfig) else str(config)


@dataclasses.dataclass
class Replay:
    """One key of a measured file, ready to replay policies against."""

    label: str
    table: dict[KernelConfig, TrialRecord]
    best_ms: float
    space: SearchSpace
    problem: SearchProblem
    shared_memory_limit: int
    heuristic: KernelConfig | None

    @property
    def heuristic_timed(self) -> int:
        """1 where the tuner times the heuristic's config before the policy's picks (it is in the table), else 0."""
        return int(self.heuristic is not None and self.heuristic in self.table)

    @classmethod
    def of(cls, entry: dict) -> Replay:
        table = {KernelConfig.from_dict(t["config"]): TrialRecord.from_json(t) for t in entry["trials"]}
        best = min(t.time_ms for t in table.values() if t.status == "ok")
        space = SearchSpace(**{k: tuple(v) for k, v in entry["space"].items()})
        kinds = tuple(variants.get(name) for name in entry["variants"])
        problem = SearchProblem(ops.get(entry["op"]).operand_tiles, entry["M"], entry["n"], entry["k"],
                                torch.bfloat16, kinds)
        heuristic = KernelConfig.from_dict(entry["heuristic"]) if entry.get("heuristic") else None
        return cls(entry["label"], table, best, space, problem, entry["shared_memory_limit"], heuristic)

    def run(self, policy_name: str, seed: int, budget: int, batch: int = OPTUNA_BATCH) -> list[float]:
        """The times `policy_name` finds, in order, within `budget` trials after the heuristic's config (which the
        tuner times first), Optuna proposing `batch` configs at a time; a config the table lacks (outside the swept
        space) counts as failed."""
        from autofuse.tune.policies import OptunaPolicy, RandomPolicy

        found: list[float] = []
        done: dict[KernelConfig, TrialRecord] = {}

        def evaluate(config: KernelConfig) -> TrialRecord:
            record = self.table.get(config, TrialRecord(config, "error", None, "not measured"))
            found.append(record.time_ms if record.status == "ok" else float("inf"))
            return record

        if self.heuristic_timed:
            done[self.heuristic] = evaluate(self.heuristic)
        limit = len(done) + budget
        if policy_name == "optuna":
            policy = OptunaPolicy(self.space, self.problem, self.shared_memory_limit, False, seed=seed, batch=batch)
        else:
            policy = RandomPolicy(candidates(self.space, self.problem, self.shared_memory_limit, False), seed=seed)
        policy.run(evaluate, lambda: len(done) < limit, done)
        return found


def early_stop(run: list[float], patience: int | None, gain: float = 0.01) -> list[float]:
    """The part of a run a search stopped early would have timed: up to and including the trial that made
    `patience` trials in a row without improving the best by more than `gain` (all of it where patience is
    None)."""
    if patience is None:
        return run
    best, since = float("inf"), 0
    for i, ms in enumerate(run):
        since = 0 if ms < best * (1 - gain) else since + 1
        best = min(best, ms)
        if since >= patience:
            return run[:i + 1]
    return run


def simulate(path: Path, seeds: int, budgets: list[int], policies: tuple[str, ...] = ("optuna", "random"),
             batch: int = OPTUNA_BATCH, patience: int | None = None) -> dict:
    """Per key, policy and budget: the median and worst regret over the seeds, and the trials to come within
    WITHIN of the sweep's best (median, min, max; inf where a seed never did within the largest budget). With
    `patience`, each budget's run stops early (early_stop) and the mean number of trials it timed is reported."""
    data = json.loads(path.read_text())
    largest = max(budgets)
    report = {}
    for entry in data["keys"]:
        replay = Replay.of(entry)
        target = (1 + WITHIN) * replay.best_ms
        rows = {}
        for policy_name in policies:
            runs = [replay.run(policy_name, seed, largest, batch) for seed in range(seeds)]
            first = replay.heuristic_timed
            stopped = {b: [early_stop(run[:first + b], patience) for run in runs] for b in budgets}
            regret = {b: [min(run, default=float("inf")) / replay.best_ms - 1 for run in stopped[b]]
                      for b in budgets}
            # Trials until one within WITHIN, the heuristic's config counted: 1 where it is within already.
            reach = [next((i + 1 for i, ms in enumerate(run) if ms <= target), float("inf")) for run in runs]
            rows[policy_name] = {
                "regret": {b: (statistics.median(r), max(r)) for b, r in regret.items()},
                "trials_to_within": (statistics.median(reach), min(reach), max(reach)),
                "trials_timed": {b: statistics.mean(len(run) for run in stopped[b]) for b in budgets},
            }
        report[entry["label"]] = {"configs": len(replay.table), "best_ms": replay.best_ms, "policies": rows,
                                  "tuned_speed_of_sweep_best": entry.get("tuned_speed_of_sweep_best")}
    return report


def _print(report: dict, gpu: str, seeds: int, budgets: list[int], patience: int | None = None) -> None:
    print(f"{gpu}: regret (best found / sweep's best - 1), median and worst over {seeds} seeds, after the heuristic's "
          f"config and B trials; trials to come within {WITHIN:.0%}, the heuristic's counted (median, min-max)\n")
    head = " | ".join(f"B={b}" for b in budgets)
    print(f"| key | configs | policy | {head} | trials to {WITHIN:.0%} | tuned / sweep best |")
    print("|---|---:|---|" + "---:|" * len(budgets) + "---|---:|")
    for label, row in report.items():
        for policy_name, numbers in row["policies"].items():
            cells = " | ".join(f"{100 * med:.1f}% ({100 * worst:.1f}%)" + (
                f", {numbers['trials_timed'][b]:.0f} timed" if patience is not None else "")
                for b, (med, worst) in numbers["regret"].items())
            med, low, high = numbers["trials_to_within"]
            speed = row["tuned_speed_of_sweep_best"] if policy_name == "optuna" else None
            print(f"| {label} | {row['configs']} | {policy_name} | {cells} | {med:.0f} ({low:.0f}-{high:.0f}) | "
                  f"{'' if speed is None else f'{speed:.3f}'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="sweep the sampled keys on this GPU (CUDA)")
    m.add_argument("--out", default=None, help="folder for the raw JSON (default: benchmarks/results/<gpu>/)")
    m.add_argument("--keys", default="decode,prefill,backward", help="groups of keys to sweep")
    m.add_argument("--trials", type=int, default=DEFAULT_TRIALS,
                   help="the tuning run's trials where --tuned-cache has no record")
    m.add_argument("--tuned-cache", default=None, help="a cache folder whose records are the tuned ones")
    m.add_argument("--work", default=None, help="folder the sweeps' trials are kept in (a rerun resumes them)")
    m.add_argument("--sweep-budget-ms", type=float, default=20.0, help="GPU time each swept config is timed for")
    s = sub.add_parser("simulate", help="replay the policies against a measured file (anywhere)")
    s.add_argument("file")
    s.add_argument("--seeds", type=int, default=20)
    s.add_argument("--budgets", default="5,10,20,40", help="trials after the heuristic's config")
    s.add_argument("--batch", type=int, default=OPTUNA_BATCH, help="configs Optuna proposes at a time")
    s.add_argument("--patience", type=int, default=None,
                   help="stop a run after this many trials in a row without a 1%% gain (the trials it timed reported)")
    args = parser.parse_args()
    if args.command == "measure":
        if not torch.cuda.is_available():
            parser.exit(2, "search_quality.py measure needs a CUDA GPU; simulate runs anywhere\n")
        measure(args)
    else:
        path = Path(args.file)
        if not path.is_file():
            parser.exit(2, f"{path}: no such file\n")
        budgets = sorted({int(b) for b in args.budgets.split(",")})
        report = simulate(path, args.seeds, budgets, batch=args.batch, patience=args.patience)
        _print(report, json.loads(path.read_text())["run"]["gpu"], args.seeds, budgets, args.patience)


if __name__ == "__main__":
    main()
