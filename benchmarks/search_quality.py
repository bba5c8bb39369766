"""How many trials does Optuna need to come within 3% of the exhaustive best?

Two steps, so the GPU time is spent once:
  measure (device):  python benchmarks/search_quality.py measure [--out DIR]
      runs the exhaustive policy on a few real keys and writes every trial (config, status,
      median ms) to DIR/search_quality.json (default: benchmarks/results/<gpu>/);
  simulate (anywhere): python benchmarks/search_quality.py simulate FILE [--seeds 20]
      replays Optuna (TPE) and random search against that measured table: each proposal is
      answered with its measured time, so policies are compared on identical numbers, free of
      timing noise, over many seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import harness
import torch

from autofuse import ops
from autofuse.configs import KernelConfig, SearchSpace
from autofuse.store import TrialRecord
from autofuse.tune.space import SearchProblem, candidates

# (label, op, N, K, M, activation, space): one small-M key in the full space, one large-M key in
# a space narrowed to large tiles (the full one holds ~2000 configs there: too long for a lease).
KEYS = [
    ("gemma-2b gated_up M=16", "gated_up", 16384, 2048, 16, "gelu_tanh", SearchSpace()),
    ("t5-v1.1-base gated_up M=4096", "gated_up", 2048, 768, 4096, "gelu_tanh",
     SearchSpace(block_m=(64, 128, 256), block_n=(64, 128, 256), block_k=(32, 64, 128), group_m=(1, 8),
                 num_warps=(4, 8), num_stages=(3, 4, 5))),
]


def measure(out: Path) -> None:
    from autofuse.key import Problem, current_environment
    from autofuse.store import Store
    from autofuse.tune.driver import Job, tune_key

    device = torch.device("cuda")
    store = Store(tempfile.mkdtemp())
    results = []
    for label, op, n, k, M, act, space in KEYS:
        key = Problem(op, n, k, M, torch.bfloat16, act).key(M, current_environment(device))
        start = time.perf_counter()
        result = tune_key(Job(key, M, label), store, device, policy="exhaustive", trials=None, space=space)
        trials = store.trials(key)
        results.append({
            "label": label, "op": op, "n": n, "k": k, "M": M, "activation": act,
            "space": space.dimensions(), "seconds": time.perf_counter() - start,
            "baseline_ms": result.winner.baseline_ms,
            "trials": [t.to_json() for t in trials],
        })
        ok = [t.time_ms for t in trials if t.status == "ok"]
        print(f"{label}: {len(trials)} configs in {results[-1]['seconds']:.0f} s, best {min(ok):.4f} ms, "
              f"baseline {result.winner.baseline_ms:.4f} ms", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    harness.write(out, "search_quality.json", {"keys": results})


def simulate(path: Path, seeds: int) -> None:
    from autofuse.tune.policies import OptunaPolicy, RandomPolicy

    data = json.loads(path.read_text())
    print(f"{data['gpu']}: trials until within 3% of the exhaustive best (over {seeds} seeds)\n")
    print("| key | configs (exhaustive) | exhaustive best ms | optuna median (min–max) | random median (min–max) |")
    print("|---|---:|---:|---:|---:|")
    for entry in data["keys"]:
        table = {KernelConfig.from_dict(t["config"]): TrialRecord.from_json(t) for t in entry["trials"]}
        best = min(t.time_ms for t in table.values() if t.status == "ok")
        target = 1.03 * best
        problem = SearchProblem(ops.get(entry["op"]).operand_tiles, entry["M"], entry["n"], entry["k"], torch.bfloat16)
        space = SearchSpace(**{k: tuple(v) for k, v in entry["space"].items()})
        found = candidates(space, problem, 232448, False)
        counts = {"optuna": [], "random": []}
        for seed in range(seeds):
            for name in counts:
                policy = (OptunaPolicy(space, problem, 232448, False, seed=seed) if name == "optuna"
                          else RandomPolicy(found, seed=seed))
                order: list[float] = []
                done: dict = {}

                def evaluate(config, order=order):
                    # A config outside the measured table (cannot happen with equal spaces) fails.
                    record = table.get(config, TrialRecord(config, "error", None, "not measured"))
                    order.append(record.time_ms if record.status == "ok" else float("inf"))
                    return record

                policy.run(evaluate, lambda: not order or min(order) > target, done)
                counts[name].append(len(order) if order and min(order) <= target else float("inf"))
        cells = [f"{statistics.median(v):.0f} ({min(v):.0f}–{max(v):.0f})" for v in counts.values()]
        print(f"| {entry['label']} | {len(table)} | {best:.4f} | {cells[0]} | {cells[1]} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", default=None, help="folder for the raw JSON (default: benchmarks/results/<gpu>/)")
    s = sub.add_parser("simulate")
    s.add_argument("file")
    s.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args()
    if args.command == "measure":
        measure(harness.out_dir(args.out))
    else:
        simulate(Path(args.file), args.seeds)


if __name__ == "__main__":
    main()
