"""`autofuse bench`: every provider checked before timing, rows written, wrong providers flagged."""

import json

import torch
from click.testing import CliRunner

import autofuse
from autofuse.cli import main
from autofuse.tools import bench

SHAPES = {"dtype": "float16", "tokens": [5],
          "mlps": [{"name": "m", "d_model": 32, "d_ff": 48, "activation": "silu"}],
          "linears": [{"name": "l", "in_features": 32, "out_features": 40, "activation": "gelu"}]}


def _run(tmp_path, *extra):
    shapes = tmp_path / "s.json"
    shapes.write_text(json.dumps(SHAPES))
    return CliRunner().invoke(main, ["bench", "--shapes", str(shapes), "--out", str(tmp_path / "out"), *extra])


def test_bench_checks_and_times_every_available_provider(tmp_path):
    result = _run(tmp_path)
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "out" / "bench.json").read_text())["rows"]
    by = {(r["shape"], r["provider"]): r for r in rows}
    assert len(rows) == 2 * len(bench.PROVIDERS)
    for provider in ("eager", "eager-merged", "autofuse-heuristic", "autofuse-tuned"):
        row = by["m", provider]
        assert row["status"] == "ok" and row["ms"] > 0 and row["rel_error"] < 4 * 2**-11
    assert by["l", "eager-merged"]["status"] == "unavailable"
    assert by["m", "torch.compile"]["status"] == "unavailable"  # GPU only
    assert "interpreter" in result.output


def test_a_wrong_provider_is_reported_and_fails_the_run(tmp_path, monkeypatch):
    def broken(case):
        good = bench._eager(case)
        return lambda: good() * 1.01

    monkeypatch.setitem(bench.PROVIDERS, "eager", broken)
    result = _run(tmp_path, "--providers", "eager,autofuse-tuned")
    assert result.exit_code == 1
    assert "eager               wrong: relative error" in result.output


def test_unknown_provider_is_a_one_line_error(tmp_path):
    result = _run(tmp_path, "--providers", "eager,cublas")
    assert result.exit_code == 2 and "unknown provider(s) cublas" in result.output


def test_untuned_modules_ignore_the_cache(tmp_path):
    from autofuse.choose import lookup as resolve
    from autofuse.configs import KernelConfig
    from autofuse.key import Problem, current_environment
    from autofuse.store import Store, Winner

    key = Problem("linear", 48, 32, 5, torch.float16, "gelu", True).key(5, current_environment(torch.device("cpu")))
    Store().put_winner(Winner(key, KernelConfig(16, 16, 16, num_stages=1), 1.0, 2.0))
    resolve.invalidate()
    tuned = autofuse.get_linear(32, 48, activation="gelu", dtype=torch.float16, device="cpu")
    plain = autofuse.get_linear(32, 48, activation="gelu", dtype=torch.float16, device="cpu", tuned=False)
    assert tuned.config_sources(5) == {"linear": "user-cache"}
    assert plain.config_sources(5) == {"linear": "heuristic"}
    resolve.invalidate()


def test_plain_call_timing_calls_each_function_in_turn_and_returns_medians(monkeypatch):
    from autofuse.tools import measure as timing

    order = []
    clock = iter(range(10**6))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))  # each reading one "second" later
    fns = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    result = timing.plain_call_us(fns, calls=4, rounds=3, warmup=2)
    assert order[:4] == ["a", "a", "b", "b"]  # warm-up, then rounds in turn
    assert order[4:] == (["a"] * 4 + ["b"] * 4) * 3
    assert result == {"a": 1e6 / 4, "b": 1e6 / 4}  # start and stop one reading apart: 1 s / 4 calls


def test_plain_call_timing_rotated_starts_each_round_one_function_later(monkeypatch):
    from autofuse.tools import measure as timing

    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in "abc"}
    result = timing.plain_call_us(fns, calls=1, rounds=4, warmup=0, rotate=True)
    assert "".join(order) == "abc" + "bca" + "cab" + "abc"
    assert set(result) == set("abc") and all(t > 0 for t in result.values())


def test_round_robin_samples_each_function_in_turn_and_returns_medians():
    from autofuse.tools import measure as timing

    order = []
    samples = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 9.0, 4.0])}
    fns = {name: (lambda name=name: name) for name in "ab"}

    def sample(fn):
        name = fn()
        order.append(name)
        return next(samples[name])
    assert timing.round_robin(fns, sample, rounds=3) == {"a": 3.0, "b": 4.0}
    assert "".join(order) == "ababab"


def test_launch_hooks_counts_the_hooks_triton_holds():
    from triton import knobs

    from autofuse.tools import measure

    before = measure.launch_hooks()
    assert set(before) == {"launch_enter_hook", "launch_exit_hook"}

    def hook(metadata):
        return None
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert measure.launch_hooks() == {**before, "launch_enter_hook": before["launch_enter_hook"] + 1}
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert measure.launch_hooks() == before
