"""The tuner end to end under the interpreter: CLI, store, resume, concurrency, export/import."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from _helpers import write_json
from click.testing import CliRunner

import autofuse
from autofuse.choose import lookup as resolve
from autofuse.choose.policy import current as current_policy
from autofuse.cli import main
from autofuse.configs import KernelConfig, Library
from autofuse.key import Problem, TuningKey, current_environment
from autofuse.layout import input_width
from autofuse.store import Store, Winner

TINY = {"dtype": "bfloat16", "tokens": [3, 37],
        "mlps": [{"name": "tiny", "d_model": 48, "d_ff": 72, "activation": "silu"}],
        "linears": [{"name": "lin", "in_features": 40, "out_features": 56, "activation": "gelu"}]}


@pytest.fixture(autouse=True)
def _fresh_index():
    resolve.invalidate()
    yield
    resolve.invalidate()


def _tune(args):
    result = CliRunner().invoke(main, ["tune", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_tune_end_to_end_and_modules_use_the_winners(tmp_path):
    shapes = write_json(tmp_path / "s.json", TINY)
    out = _tune(["--shapes", str(shapes), "--trials", "3"])
    # Per M: gated_up, gated_pairs, down, the one-launch mlp (M <= 64 for both token counts) and the Linear.
    assert "tuning 10 keys (bfloat16) with optuna" in out
    table = [line for line in out.splitlines() if line.startswith(("tiny ", "lin "))]
    assert len(table) == 10, out
    store = Store()
    winners = {(w.key.op, w.key.m_bucket): w for w in store.winners()}
    assert set(winners) == {(op, m) for op in ("gated_up", "gated_pairs", "down", "mlp", "linear") for m in (3, 37)}
    assert all(w.trials == 3 and w.config is not None for w in winners.values())

    mlp = autofuse.get_mlp(48, 72, activation="silu", dtype=torch.bfloat16, device="cpu")
    # The module takes whichever tuning timed faster: gated_pairs or gated_up for H, then the pair
    # against the one-launch kernel, which the pair must beat by one_launch_margin (choose/plans.py).
    up_op = "gated_pairs" if winners["gated_pairs", 37].time_ms < winners["gated_up", 37].time_ms else "gated_up"
    pair_ms = winners[up_op, 37].time_ms + winners["down", 37].time_ms
    if winners["mlp", 37].time_ms < pair_ms * (1 + current_policy().one_launch_margin):
        assert mlp.config_sources(37) == {"mlp": "user-cache"}
        assert mlp.config_for(37) == {"mlp": winners["mlp", 37].config}
    else:
        assert mlp.config_sources(37) == {up_op: "user-cache", "down": "user-cache"}
        assert mlp.config_for(37) == {up_op: winners[up_op, 37].config, "down": winners["down", 37].config}
    lin = autofuse.get_linear(40, 56, activation="gelu", dtype=torch.bfloat16, device="cpu")
    assert lin.config_for(3) == {"linear": winners["linear", 3].config}
    # M=20 was not tuned: its pow2 bucket 32 neither, so the nearest tuned bucket (37) serves it.
    assert lin.config_sources(20)["linear"].startswith("nearest:") and "m_bucket=37" in lin.config_sources(20)["linear"]


@pytest.mark.parametrize("fused_faster", [True, False])
def test_mlp_takes_the_one_launch_kernel_only_where_it_was_timed_faster(fused_faster):
    env = current_environment(torch.device("cpu"))
    store = Store()
    pair = KernelConfig(16, 16, 16, num_stages=1)
    fused = KernelConfig(16, 32, 32, group_m=1, num_stages=1)
    store.put_winner(Winner(Problem("gated_up", 80, 48, 4, torch.float32, "silu").key(4, env), pair, 1.0, 2.0))
    store.put_winner(Winner(Problem("down", 48, 80, 4, torch.float32, "none").key(4, env), pair, 1.0, 2.0))
    store.put_winner(Winner(Problem("mlp", 80, 48, 4, torch.float32, "silu").key(4, env), fused,
                            1.5 if fused_faster else 2.5, 4.0))
    mlp = autofuse.get_mlp(48, 80, activation="silu", dtype=torch.float32, device="cpu")
    expected = {"mlp": fused} if fused_faster else {"gated_up": pair, "down": pair}
    assert mlp.config_for(4) == expected
    assert mlp.config_for(128) != {"mlp": fused}  # above MLP_MAX_M the one-launch kernel never runs
    x = torch.randn(4, 48)
    with torch.no_grad():
        out = mlp(x)
    args = (x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    from autofuse.reference import eager_mlp, mlp_reference, relative_error

    ref = mlp_reference(*args, activation="silu")
    assert relative_error(out, ref) <= 1.25 * relative_error(eager_mlp(*args, activation="silu"), ref) + 1e-6


def test_bad_shapes_and_tokens_are_one_line_errors(tmp_path):
    bad = write_json(tmp_path / "bad.json", {"mlps": [{"d_model": 8, "d_ff": 0}]})
    result = CliRunner().invoke(main, ["tune", "--shapes", str(bad)])
    message = "bad.json.mlps[0].d_ff: must be a positive integer up to 2147483647, got 0"
    assert result.exit_code == 2 and message in result.output
    good = write_json(tmp_path / "s.json", TINY)
    result = CliRunner().invoke(main, ["tune", "--shapes", str(good), "--tokens", "1,x"])
    assert result.exit_code == 2 and "--tokens must be comma-separated" in result.output


def test_export_import_round_trip_into_a_fresh_cache(tmp_path, monkeypatch):
    _tune(["--shapes", str(write_json(tmp_path / "s.json", TINY)), "--trials", "2", "--tokens", "37"])
    exported = tmp_path / "h.json"
    result = CliRunner().invoke(main, ["cache", "export", "-o", str(exported)])
    assert result.exit_code == 0 and "exported 5 configs" in result.output
    tuned = {w.key.id(): w for w in Store().winners()}

    monkeypatch.setenv("AUTOFUSE_CACHE_DIR", str(tmp_path / "fresh"))
    resolve.invalidate()
    result = CliRunner().invoke(main, ["cache", "import", str(exported)])
    assert result.exit_code == 0 and "imported 5 configs" in result.output
    assert {w.key.id(): w for w in Store().winners()} == tuned
    mlp = autofuse.get_mlp(48, 72, activation="silu", dtype=torch.bfloat16, device="cpu")
    assert set(mlp.config_sources(37).values()) == {"user-cache"}
    chosen = mlp.config_for(37)  # the one-launch kernel or the pair, whichever was timed faster
    assert chosen == {op: next(w.config for w in tuned.values() if w.key.op == op) for op in chosen}
    x = torch.randn(37, 48, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.isfinite(mlp(x)).all()


def _exported(tmp_path):
    _tune(["--shapes", str(write_json(tmp_path / "s.json", TINY)), "--trials", "2", "--tokens", "3"])
    path = tmp_path / "e.json"
    assert CliRunner().invoke(main, ["cache", "export", "-o", str(path)]).exit_code == 0
    return path


@pytest.mark.parametrize("damage, message", [
    (lambda t: t[: len(t) // 2], "not valid JSON, truncated or damaged"),
    (lambda t: t.replace('"trials": 2', '"trials": 7', 1), "checksum mismatch"),
    (lambda t: t.replace('"format": "autofuse-configs"', '"format": "other"'), "not an autofuse config export"),
    (lambda t: t.replace('"schema_version": 1', '"schema_version": 9'), "schema version 9 is not supported"),
])
def test_damaged_import_is_rejected_and_writes_nothing(tmp_path, monkeypatch, damage, message):
    path = _exported(tmp_path)
    path.write_text(damage(path.read_text()))
    monkeypatch.setenv("AUTOFUSE_CACHE_DIR", str(tmp_path / "fresh"))
    result = CliRunner().invoke(main, ["cache", "import", str(path)])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) <= 3  # usage line + one error line
    assert list(Store().winners()) == []


def test_import_rejects_a_bad_record_even_with_a_valid_checksum(tmp_path, monkeypatch):
    from autofuse.configfile import _checksum

    path = _exported(tmp_path)
    document = json.loads(path.read_text())
    document["records"][1]["config"]["block_m"] = 48  # not a power of two
    document["sha256"] = _checksum(document["records"])
    path.write_text(json.dumps(document))
    monkeypatch.setenv("AUTOFUSE_CACHE_DIR", str(tmp_path / "fresh"))
    result = CliRunner().invoke(main, ["cache", "import", str(path)])
    assert result.exit_code == 2 and "record 1: block_m must be one of" in result.output
    assert list(Store().winners()) == []  # record 0 was valid, and still nothing was written


def _key(op="linear", n=56, k=40, m=37, activation="gelu", env=None):
    # get_linear(40, 56)'s key: rows of both sizes are 16-byte aligned, so it runs unpadded (layout.linear_width).
    env = env or current_environment(torch.device("cpu"))
    return Problem(op, n, k, m, torch.bfloat16, activation, True).key(m, env)


def test_stale_keys_are_never_reused():
    import dataclasses

    store = Store()
    config = KernelConfig(16, 16, 16, group_m=1, num_warps=4, num_stages=1)
    fresh = _key()
    for stale in (dataclasses.replace(fresh, template_hash="0" * 16), dataclasses.replace(fresh, triton="0.0.1")):
        store.put_winner(Winner(stale, config, 1.0, 2.0))
    resolve.invalidate()
    lin = autofuse.get_linear(40, 56, activation="gelu", dtype=torch.bfloat16, device="cpu")
    assert lin.config_sources(37) == {"linear": "heuristic"}
    assert lin.config_for(37)["linear"] != config
    store.put_winner(Winner(fresh, config, 1.0, 2.0))
    resolve.invalidate()
    lin = autofuse.get_linear(40, 56, activation="gelu", dtype=torch.bfloat16, device="cpu")
    assert lin.config_for(37) == {"linear": config} and lin.config_sources(37) == {"linear": "user-cache"}


def test_shipped_files_and_a_bad_one(tmp_path, monkeypatch, caplog):
    path = _exported(tmp_path)
    ship = tmp_path / "ship"
    ship.mkdir()
    (ship / "gpu.json").write_text(path.read_text())
    (ship / "broken.json").write_text("{")
    monkeypatch.setenv("AUTOFUSE_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("AUTOFUSE_CACHE_PATH", str(ship))
    resolve.invalidate()
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        lin = autofuse.get_linear(40, 56, activation="gelu", dtype=torch.bfloat16, device="cpu")
        assert lin.config_sources(3) == {"linear": "shipped:gpu.json"}
    assert [r.getMessage() for r in caplog.records if "ignoring 1 file(s) in" in r.getMessage()
            and "broken.json: not valid JSON" in r.getMessage()]


def test_baseline_winner_runs_eager_and_is_correct():
    from autofuse.reference import linear_reference

    store = Store()
    store.put_winner(Winner(_key(m=4), Library("eager"), 2.0, 1.0))
    resolve.invalidate()
    lin = autofuse.get_linear(40, 56, activation="gelu", dtype=torch.float32, device="cpu")
    assert lin.config_for(4) == {"linear": KernelConfig(16, 64, 64, group_m=8, num_warps=4, num_stages=1)}
    # The library record was keyed for bfloat16: a bf16 module picks it up and runs eagerly.
    lin16 = autofuse.get_linear(40, 56, activation="gelu", dtype=torch.bfloat16, device="cpu")
    assert lin16.config_for(4) == {"linear": Library("eager")}
    x = torch.randn(4, 40, dtype=torch.bfloat16)
    with torch.no_grad():
        out = lin16(x)
    ref = linear_reference(x, lin16.weight, lin16.bias, None, "gelu")
    assert ((out.double() - ref).norm() / ref.norm()).item() < 4 * 2**-8


def _tune_process(shapes, cache, *extra):
    env = dict(os.environ, AUTOFUSE_CACHE_DIR=str(cache), TRITON_INTERPRET="1")
    return subprocess.Popen([sys.executable, "-m", "autofuse.cli", "tune", "--shapes", str(shapes), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_four_processes_tuning_into_one_cache_lose_nothing(tmp_path):
    cache = tmp_path / "shared"
    files = []
    for i in range(4):
        # Each file has its own MLP plus one Linear shared by all four: both kinds of overlap.
        files.append(write_json(tmp_path / f"s{i}.json", {
            "tokens": [5], "mlps": [{"name": f"m{i}", "d_model": 16 + 8 * i, "d_ff": 48}],
            "linears": [{"in_features": 24, "out_features": 40}]}))
    procs = [_tune_process(f, cache, "--trials", "3") for f in files]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    winners = list(Store(cache).winners())
    # d_model 24 and 40 run padded to 64 (layout.input_width): their up and down projections share one key
    # each, and the one-launch kernel, which their modules never plan, gets none.
    expected = {(op, 48, input_width(16 + 8 * i)) for op in ("gated_up", "gated_pairs") for i in range(4)}
    expected |= {("down", input_width(16 + 8 * i), 48) for i in range(4)} | {("mlp", 48, 16), ("mlp", 48, 32)}
    expected |= {("linear", 40, 24)}  # aligned rows: the Linear runs unpadded (layout.linear_width)
    assert {(w.key.op, w.key.n, w.key.k) for w in winners} == expected
    assert all(len(Store(cache).trials(w.key)) >= 3 for w in winners)


def test_a_killed_run_resumes_without_repeating_work(tmp_path):
    cache = tmp_path / "c"
    shapes = write_json(tmp_path / "one.json", {"tokens": [64], "mlps": [{"d_model": 64, "d_ff": 128}]})

    def key_trials():
        return sum(len(Store(cache).trials(w)) for w in _keys(cache, shapes))

    proc = _tune_process(shapes, cache, "--trials", "6", "--policy", "random")
    deadline = time.time() + 120
    while time.time() < deadline and key_trials() < 2 and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed; make it slower"
    before = key_trials()
    assert 2 <= before < 24 and len(list(Store(cache).winners())) < 2  # trials kept, the run unfinished

    resumed = _tune_process(shapes, cache, "--trials", "6", "--policy", "random")
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    assert key_trials() == 24  # 6 per key (gated_up, gated_pairs, down, mlp), the killed run's included
    rows = [line.split() for line in out.splitlines() if line.startswith("mlp0 ")]
    resumed_counts = [int(row[-2]) for row in rows]
    assert sum(resumed_counts) == before, out  # every trial of the killed run was reused, none re-run


def _keys(cache, shapes_path):
    from autofuse.shapes import load_shapes
    from autofuse.tune.driver import jobs_for_shapes

    return [job.key for job in jobs_for_shapes(load_shapes(shapes_path), torch.device("cpu"))]


def test_cache_show_clear_and_kernel(tmp_path):
    _tune(["--shapes", str(write_json(tmp_path / "s.json", TINY)), "--trials", "2", "--tokens", "3"])
    ls = CliRunner().invoke(main, ["cache", "ls"])
    assert ls.exit_code == 0 and "5 tuned keys" in ls.output
    row = next(line.split() for line in ls.output.splitlines() if " gated_up " in line and "user-cache" in line)
    short = row[0]
    for given in (short, short[:6]):  # the short id `cache ls` prints, or a unique prefix of it
        show = CliRunner().invoke(main, ["cache", "show", given])
        assert show.exit_code == 0 and json.loads(show.output)["key"]["op"] == "gated_up"
    full_id = TuningKey.from_dict(json.loads(show.output)["key"]).id()  # the whole key id still works
    kernel = CliRunner().invoke(main, ["kernel", full_id])
    # The winner of two trials under the interpreter is the tile or the GEMV variant (autofuse_gated_up_silu_gemv),
    # as CPU timing falls: the kernel named for the op and activation either way.
    assert kernel.exit_code == 0 and re.search(r"^def autofuse_gated_up_silu(_\w+)?\(", kernel.output, re.M)
    assert CliRunner().invoke(main, ["cache", "show", "op=nonsense"]).exit_code == 2
    assert "at least 4 characters" in CliRunner().invoke(main, ["cache", "show", "ab"]).output
    clear = CliRunner().invoke(main, ["cache", "clear", "--yes"])
    assert clear.exit_code == 0 and "removed 5 tuned keys and 0 checked keys" in clear.output
    assert list(Store().winners()) == []


def test_every_shipped_file_is_valid():
    from autofuse.configfile import read_export
    from autofuse.render import template_hash
    from autofuse.resources import shipped_cache_dir

    files = sorted(shipped_cache_dir().glob("*.json"))
    for path in files:
        winners = read_export(path)  # raises on anything malformed
        assert winners, f"{path.name} is empty"
        stale = [w.key.id() for w in winners if w.key.template_hash != template_hash(w.key.spec)]
        assert not stale, f"{path.name} was tuned for other template versions: regenerate it ({stale[0]})"


def test_train_flag_tunes_the_backward_and_training_uses_it(tmp_path):
    shapes = write_json(tmp_path / "s.json", {"dtype": "float32", "tokens": [37],
                                         "mlps": [{"name": "m", "d_model": 40, "d_ff": 72, "activation": "silu"}]})
    out = _tune(["--shapes", str(shapes), "--trials", "2", "--train"])
    assert "m gated_bwd" in out
    winner = next(w for w in Store().winners() if w.key.op == "gated_bwd")
    assert winner.config is not None and winner.trials == 2  # under the interpreter any correct config wins
    mlp = autofuse.get_mlp(40, 72, activation="silu", dtype=torch.float32, device="cpu")
    assert mlp._training_step(37, mlp.gate_proj.weight).backward_config == winner.config
    # d_ff 72 and d_model 40 are multiples of 8, not of 16: inference runs the down projection padded (64 x 128),
    # a training step unpadded (40 x 72); --train tunes both, and the training step runs the second.
    downs = {(w.key.n, w.key.k): w for w in Store().winners() if w.key.op == "down"}
    assert set(downs) == {(64, 128), (40, 72)}
    assert mlp._training_step(37, mlp.gate_proj.weight).down_config == downs[(40, 72)].config
    x = torch.randn(37, 40, requires_grad=True)
    mlp(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_backward_falls_back_to_pytorch_where_tuning_found_it_faster():
    env = current_environment(torch.device("cpu"))
    key = Problem("gated_bwd", 72, 40, 8, torch.float32, "silu").key(8, env)
    Store().put_winner(Winner(key, Library("eager"), 1.0, 1.0))  # the library path won
    mlp = autofuse.get_mlp(40, 72, activation="silu", dtype=torch.float32, device="cpu")
    assert mlp._training_step(8, mlp.gate_proj.weight).backward_config == Library("eager")
    x = torch.randn(8, 40, requires_grad=True)
    mlp(x).sum().backward()
    ref = x.detach().clone().requires_grad_()
    w = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    from autofuse.reference import eager_mlp

    eager_mlp(ref, *w, activation="silu").sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=1e-5, atol=1e-6)


def test_ops_option_tunes_only_the_named_ops(tmp_path):
    shapes = write_json(tmp_path / "s.json", {"dtype": "float32", "tokens": [37],
                                         "mlps": [{"name": "m", "d_model": 40, "d_ff": 72, "activation": "silu"}]})
    _tune(["--shapes", str(shapes), "--trials", "1", "--train", "--ops", "gated_bwd"])
    assert {w.key.op for w in Store().winners()} == {"gated_bwd"}


@pytest.mark.parametrize("ops, message", [("gated_up,wrong", "unknown op(s) wrong"), ("gated_bwd", "add --train")])
def test_ops_option_rejects_bad_selections_without_a_traceback(tmp_path, ops, message):
    shapes = write_json(tmp_path / "s.json", TINY)
    result = CliRunner().invoke(main, ["tune", "--shapes", str(shapes), "--ops", ops])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_a_gpu_without_tuned_configs_warns_once_and_runs_the_heuristic(monkeypatch, caplog):
    # A deployment on another GPU / Triton than the shipped files were tuned for: heuristic, one warning.
    from autofuse import key as key_module
    from autofuse.choose import lookup as resolve_module

    elsewhere = key_module.Environment("NVIDIA H100 80GB HBM3", "9.0", "9.9.9", "13.0")
    monkeypatch.setattr(key_module, "current_environment", lambda device: elsewhere)
    monkeypatch.setattr(resolve_module, "_warned_environments", set())
    resolve_module.invalidate()
    with caplog.at_level(logging.WARNING, logger="autofuse"):
        choices = [resolve_module.resolve(key_module.Problem("gated_up", 96, 64, M, torch.bfloat16, "gelu_tanh"))
                   for M in (1, 4096)]
        resolve_module.resolve(key_module.Problem("down", 64, 96, 8, torch.bfloat16, "none"))
    assert [c.source for c in choices] == ["heuristic", "heuristic"] and choices[0].config is not None
    caught = [r.getMessage() for r in caplog.records if "no tuned configs" in r.getMessage()]
    assert len(caught) == 1 and "no tuned configs for NVIDIA H100 80GB HBM3 / triton 9.9.9" in caught[0]
    assert "NVIDIA H200 / triton 3.6.0" in caught[0]  # names what the shipped file covers
