"""benchmarks/search_quality.py's replay: the default policy and random search answered from a measured table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autofuse import ops, variants
from autofuse.tune.space import SearchProblem, candidates

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
search_quality = pytest.importorskip("search_quality")

LIMIT = 232448  # an H100's shared memory per block


def _measured(tmp_path) -> Path:
    """A measured file of the one-launch MLP's key at M = 1 (168 configs): made-up times with one best config, a
    failed config, and the heuristic's config among the trials, as measure writes it."""
    entry = next(e for e in search_quality.KEYS if e[2] == "mlp")
    _, label, op, M, _ = entry
    n, k, _ = search_quality._dims(op)
    spec = ops.get(op)
    space = spec.search_space(False)
    problem = SearchProblem(spec.operand_tiles, M, n, k, torch.bfloat16, (variants.TILE,))
    configs = candidates(space, problem, LIMIT, False)
    trials = []
    for i, config in enumerate(configs):
        ms = 1.0 + abs(config.block_n - 64) / 64 + abs(config.block_k - 128) / 256 + 0.05 * config.num_stages \
            + 0.01 * (i % 7)
        trials.append({"config": config.to_dict(), "status": "ok", "time_ms": ms, "detail": ""})
    trials[3] = {"config": configs[3].to_dict(), "status": "compile_error", "time_ms": None, "detail": "x"}
    document = {"run": {"gpu": "a made-up GPU"}, "keys": [{
        "group": "decode", "label": label, "op": op, "n": n, "k": k, "M": M, "activation": "silu",
        "space": space.dimensions(), "variants": ["tile"], "shared_memory_limit": LIMIT, "heuristic":
        configs[10].to_dict(), "tuned_speed_of_sweep_best": 0.98, "trials": trials}]}
    path = tmp_path / "search_quality.json"
    path.write_text(json.dumps(document))
    return path, {c: t["time_ms"] for c, t in zip(configs, trials)}


def test_the_replay_finds_what_the_sweep_found_given_the_whole_budget(tmp_path):
    path, times = _measured(tmp_path)
    best = min(ms for ms in times.values() if ms is not None)
    report = search_quality.simulate(path, seeds=2, budgets=[1, 4, 12])
    (label, row), = report.items()
    assert row["configs"] == 168 and row["best_ms"] == best
    for policy_name, numbers in row["policies"].items():
        regret = numbers["regret"]
        medians = [regret[b][0] for b in (1, 4, 12)]
        assert all(m >= 0 for m in medians) and medians == sorted(medians, reverse=True)  # more trials, no worse
        assert all(worst >= median for median, worst in regret.values())
    # The heuristic's config comes first: with one trial more, its time bounds the regret.
    heuristic = times[search_quality.Replay.of(json.loads(path.read_text())["keys"][0]).heuristic]
    assert row["policies"]["optuna"]["regret"][1][1] <= heuristic / best - 1
    # Random search with as many trials as configs has tried them all: the sweep's best, found by every seed.
    everything = search_quality.simulate(path, seeds=2, budgets=[167], policies=("random",))[label]
    assert everything["policies"]["random"]["regret"][167] == (0.0, 0.0)
    assert everything["policies"]["random"]["trials_to_within"][2] <= 168


def test_simulate_prints_a_table_and_measure_refuses_a_cpu(tmp_path):
    path, _ = _measured(tmp_path)
    out = subprocess.run([sys.executable, str(BENCHMARKS / "search_quality.py"), "simulate", str(path), "--seeds", "2",
                          "--budgets", "5,10"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "| mlp (one launch) M=1 | 168 | optuna |" in out.stdout and "a made-up GPU" in out.stdout
    if not torch.cuda.is_available():
        out = subprocess.run([sys.executable, str(BENCHMARKS / "search_quality.py"), "measure"], capture_output=True,
                             text=True)
        assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr


def test_early_stop_ends_at_the_trial_that_completes_the_patience():
    run = [10.0, 9.0, 8.95, 8.99, 9.5, 7.0, 7.2]
    # 8.95 is within 1% of 9.0: no gain; with 8.99 and 9.5, three trials in a row without one.
    assert search_quality.early_stop(run, 3) == [10.0, 9.0, 8.95, 8.99, 9.5]
    assert search_quality.early_stop(run, 4) == run
    assert search_quality.early_stop(run, None) == run
