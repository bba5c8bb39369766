"""First-use checks (autofuse/choose/check.py): no kernel config that neither tuning nor a check
compared on this GPU and key runs; the check's decision is stored once as a checked record and reused
by later processes; where no check can run (inside the torch.library ops, capturing, tracing) the eager
library path runs until a check has decided."""

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch

import autofuse
from autofuse import evaluator as objective
from autofuse import launch
from autofuse.choose import Choice, Source
from autofuse.choose import check as checked
from autofuse.choose import lookup as resolve
from autofuse.choose.policy import current as current_policy
from autofuse.choose.policy import use as use_policy
from autofuse.configs import KernelConfig, Library
from autofuse.key import Problem
from autofuse.reference import eager_mlp
from autofuse.store import Store, TrialRecord

D, F_, M = 48, 80, 5


@pytest.fixture(autouse=True)
def _checks_on(monkeypatch):
    monkeypatch.setenv("AUTOFUSE_CHECK", "1")
    resolve.invalidate()


def _fake_timer(monkeypatch, library_ms: float, kernel_ms: float, one_launch_ms: float = 100.0):
    """Times as a GPU would report them (the interpreter's mean nothing): every library candidate at
    library_ms, the kernel at kernel_ms (the one-launch MLP's at one_launch_ms) once it has been checked
    correct on the real run. On a GPU too: near ties keep these times where a check would time them again side by
    side (the library candidates, all at library_ms, are always near each other), and tables and two ops' records
    are not timed together, so the records decide."""
    monkeypatch.setattr(checked, "interpreting", lambda: False)
    real_evaluate = objective.Evaluator.evaluate
    monkeypatch.setattr(objective.Evaluator, "library_ms",
                        lambda self: {name: library_ms for name in self.spec.library_for(
                            self.key.activation, self.key.bias, self.key.residual)})
    monkeypatch.setattr(objective.Evaluator, "retimed_side_by_side",
                        lambda self, record, times, names, rivals=(): (record, times))
    monkeypatch.setattr(checked, "tables_side_by_side", lambda tables: None)

    def not_timed(self, fns):
        raise RuntimeError("not timed under a faked timer")  # faster_of then goes by the records
    monkeypatch.setattr(objective.Evaluator, "side_by_side_ms", not_timed)

    def evaluate(self, config):
        record = real_evaluate(self, config)  # compiled, verified and timed for real
        ms = one_launch_ms if self.key.op == "mlp" else kernel_ms
        return TrialRecord(config, record.status, ms if record.status == "ok" else None, record.detail)
    monkeypatch.setattr(objective.Evaluator, "evaluate", evaluate)


def _mlp(device, dtype=torch.float32):
    mlp = autofuse.get_mlp(D, F_, activation="silu", dtype=dtype, device=device, interleaved=False)
    return mlp, (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)


@pytest.mark.parametrize("library_faster", [True, False])
def test_the_first_eager_call_checks_and_keeps_the_faster(device, monkeypatch, library_faster):
    _fake_timer(monkeypatch, library_ms=1.0 if library_faster else 3.0, kernel_ms=2.0)
    mlp, w = _mlp(device)
    x = torch.randn(M, D, device=device)
    with torch.no_grad():
        out = mlp(x)
    torch.testing.assert_close(out, eager_mlp(x, *w, activation="silu"), rtol=1e-4, atol=1e-4)
    assert mlp.config_sources(M) == {"gated_up": "checked", "down": "checked"}
    chosen = mlp.config_for(M)
    if library_faster:
        assert chosen == {"gated_up": Library("eager"), "down": Library("eager")}
    else:
        assert all(isinstance(c, KernelConfig) for c in chosen.values())
    stored = {w.key.op: w for w in Store().winners()}
    # The one-launch MLP was checked too (it runs at M <= 64), and lost (100 ms on the fake timer).
    assert set(stored) == {"gated_up", "down", "mlp"} and all(w.policy == "checked" for w in stored.values())
    assert stored["down"].config == chosen["down"]
    # A library path's record keeps the kernel it beat, for un-graphed calls (plain.py); a kernel's keeps none.
    for op in ("gated_up", "down"):
        if library_faster:
            assert isinstance(stored[op].runner_up, KernelConfig) and stored[op].runner_up_ms == 2.0
        else:
            assert stored[op].runner_up is None
    assert mlp._config_table(M)["down"].runner_up == stored["down"].runner_up


def test_a_near_tie_goes_to_the_library_path(device, monkeypatch):
    # A check's brief timings cannot tell 2% apart: a kernel must beat the library by check_margin.
    _fake_timer(monkeypatch, library_ms=1.0, kernel_ms=1.0 - current_policy().check_margin / 2)
    mlp, _ = _mlp(device)
    with torch.no_grad():
        mlp(torch.randn(M, D, device=device))
    assert mlp.config_for(M) == {"gated_up": Library("eager"), "down": Library("eager")}


@pytest.mark.parametrize("slower_by, kernel_in_steps",
                         [(current_policy().check_margin / 2, True), (2 * current_policy().check_margin, False)])
def test_where_host_time_counts_the_check_still_chooses_by_gpu_time(device, monkeypatch, slower_by, kernel_in_steps):
    # Under host_bound_ms of GPU time the check keeps the library path a graph replays faster, with the kernel as
    # its runner-up: un-graphed calls race the two (choose/race.py); a training step, never raced, runs the
    # kernel where it is within check_margin of the library path (one bound launch in place of PyTorch's ops).
    library_ms = current_policy().host_bound_ms / 10
    _fake_timer(monkeypatch, library_ms=library_ms, kernel_ms=library_ms * (1 + slower_by))
    mlp, (wg, _, _) = _mlp(device)
    with torch.no_grad():
        mlp(torch.randn(M, D, device=device))
    assert mlp.config_for(M) == {"gated_up": Library("eager"), "down": Library("eager")}
    down = mlp._config_table(M)["down"]
    assert isinstance(down.runner_up, KernelConfig)
    step = mlp._training_step(M, wg)
    assert step.down_config == (down.runner_up if kernel_in_steps else None)


def test_a_wrong_kernel_loses_its_check(device, monkeypatch):
    _fake_timer(monkeypatch, library_ms=5.0, kernel_ms=1.0)
    real = objective.Evaluator.evaluate
    monkeypatch.setattr(objective.Evaluator, "evaluate",
                        lambda self, config: TrialRecord(config, "wrong_result", None, "poisoned for the test"))
    mlp, _ = _mlp(device)
    with torch.no_grad():
        mlp(torch.randn(M, D, device=device))
    assert mlp.config_for(M) == {"gated_up": Library("eager"), "down": Library("eager")}
    monkeypatch.setattr(objective.Evaluator, "evaluate", real)


def test_a_second_process_reuses_the_decision_without_checking(device, monkeypatch, tmp_path):
    _fake_timer(monkeypatch, library_ms=1.0, kernel_ms=2.0)
    mlp, _ = _mlp(device)
    with torch.no_grad():
        mlp(torch.randn(M, D, device=device))
    script = textwrap.dedent(f"""
        import os, torch
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
        os.environ["AUTOFUSE_CHECK"] = "1"
        import autofuse
        from autofuse import evaluator as objective
        def refuse(*args, **kwargs):
            raise SystemExit("a second check ran")
        objective.Evaluator.__init__ = refuse
        mlp = autofuse.get_mlp({D}, {F_}, activation="silu", dtype=torch.float32, device="{device}", interleaved=False)
        with torch.no_grad():
            mlp(torch.randn({M}, {D}, device="{device}"))
        print(sorted(mlp.config_sources({M}).values()), sorted(c.to_json() for c in mlp.config_for({M}).values()))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['checked', 'checked'] ['library:eager', 'library:eager']"


def test_no_kernel_runs_for_an_unchecked_key_inside_the_library_ops(device, monkeypatch):
    """Inside torch.ops.autofuse.* (what torch.compile and CUDA-graph trees run) no check can run:
    the eager library path runs, no Triton kernel is launched, nothing is stored; the ops keep that
    table (no resolve per call) until the next eager call checks, and then run what it decided."""
    from autofuse import custom_ops

    launches, resolved = [], []
    real_launch, real_select = launch.launch, custom_ops.select
    monkeypatch.setattr(launch, "launch", lambda *a, **k: launches.append(a[0]) or real_launch(*a, **k))
    monkeypatch.setattr(custom_ops, "select", lambda *a: resolved.append(1) or real_select(*a))
    mlp, w = _mlp(device)
    x = torch.randn(M, D, device=device)
    with torch.no_grad():
        for _ in range(2):
            out = torch.ops.autofuse.mlp(x, [w[0], None, w[1], None, w[2], None], "silu", True)
    torch.testing.assert_close(out, eager_mlp(x, *w, activation="silu"), rtol=1e-4, atol=1e-4)
    assert launches == [] and list(Store().winners()) == []
    assert len(resolved) == 1  # the waiting table is kept: not resolved again on every call
    with checked.no_checks():
        assert mlp.config_sources(M) == {"gated_up": Source.PENDING, "down": Source.PENDING}
    _fake_timer(monkeypatch, library_ms=3.0, kernel_ms=2.0)
    with torch.no_grad():
        mlp(x)  # eager: checked now, and the kernels win
    assert mlp.config_sources(M) == {"gated_up": "checked", "down": "checked"}
    launches.clear()
    with torch.no_grad():
        torch.ops.autofuse.mlp(x, [w[0], None, w[1], None, w[2], None], "silu", True)
    assert len(launches) == 2 and len(resolved) == 2  # resolved again after the check: the checked kernels


def test_checks_can_be_switched_off(device, monkeypatch):
    monkeypatch.setenv("AUTOFUSE_CHECK", "0")
    mlp, _ = _mlp(device)
    with torch.no_grad():
        mlp(torch.randn(M, D, device=device))
    assert set(mlp.config_sources(M).values()) == {"heuristic"} and list(Store().winners()) == []


def test_untuned_modules_are_not_checked(device):
    mlp = autofuse.get_mlp(D, F_, activation="silu", dtype=torch.float32, device=device, tuned=False, interleaved=False)
    with torch.no_grad():
        mlp(torch.randn(M, D, device=device))
    assert set(mlp.config_sources(M).values()) == {"heuristic"} and list(Store().winners()) == []


def test_a_nearest_keys_library_choice_is_checked_again_at_another_bucket(device, monkeypatch):
    """Which path is fastest depends on M: a decision made at one bucket is a neighbour's, not this
    bucket's, so it is compared again here (with the heuristic's kernel beside the library paths)."""
    _fake_timer(monkeypatch, library_ms=1.0, kernel_ms=2.0)
    mlp, _ = _mlp(device)
    with torch.no_grad():
        mlp(torch.randn(M, D, device=device))
    assert mlp.config_for(M)["down"] == Library("eager")
    _fake_timer(monkeypatch, library_ms=3.0, kernel_ms=2.0)
    with torch.no_grad():
        mlp(torch.randn(100, D, device=device))
    assert mlp.config_sources(100) == {"gated_up": "checked", "down": "checked"}
    assert all(isinstance(c, KernelConfig) for c in mlp.config_for(100).values())
    assert len(list(Store().winners())) == 5  # two ops at two buckets, and the one-launch MLP at M <= 64


@pytest.mark.parametrize("nearest_faster", [True, False])
def test_a_nearest_keys_kernel_is_checked_beside_this_buckets_heuristic(device, monkeypatch, nearest_faster):
    """A nearest key may be the same shape at another M (a small-M split-K config at M = 256): its kernel
    competes with this bucket's heuristic config and the library paths, and the fastest of the three is stored."""
    from autofuse.choose.heuristics import heuristic_for

    problem = Problem("linear", 56, 40, 100, torch.float32, "gelu", True, device=torch.device(device))
    own = heuristic_for(problem.replace(M=problem.bucket))
    nearest = KernelConfig(16, 32, 32, group_m=1, num_warps=4, num_stages=1)
    assert nearest != own
    monkeypatch.setattr(checked, "interpreting", lambda: False)
    monkeypatch.setattr(objective.Evaluator, "library_ms", lambda self: {"eager": 10.0})
    timed = []

    def evaluate(self, config):
        timed.append(config)
        ms = (1.0 if nearest_faster else 3.0) if config == nearest else 2.0
        return TrialRecord(config, "ok", ms, "")
    monkeypatch.setattr(objective.Evaluator, "evaluate", evaluate)
    choice = checked.checked(problem, Choice(nearest, Source.NEAREST, detail="a neighbour"))
    assert sorted(timed, key=str) == sorted([nearest, own], key=str)
    assert choice.source == "checked" and choice.config == (nearest if nearest_faster else own)
    assert Store().get_winner(problem.key()).config == choice.config


def _tuned_neighbour(device, op: str, n: int, k: int, bucket: int, config, policy: str = "tpe",
                     activation: str = "none") -> None:
    from autofuse.key import current_environment
    from autofuse.store import Winner

    key = Problem(op, n, k, bucket, torch.float32, activation, False).key(
        bucket, current_environment(torch.device(device)))
    Store().put_winner(Winner(key, config, 2.0, 2.0, trials=30, policy=policy))


_TILE = KernelConfig(16, 32, 32, group_m=1, num_warps=4, num_stages=1)


@pytest.mark.parametrize("neighbours, bucket, kernels_timed", [
    ([(48, 80, 128, "library", "tpe")], 128, False),
    ([(48, 80, 128, "library", "checked")], 128, True),  # a first-use check's decision is no prior
    ([(48, 80, 16, "library", "tpe")], 128, True),  # another bucket's
    ([(48, 80, 1024, "library", "tpe")], 1024, True),  # above PRIOR_MAX_M
    # the nearest chose a kernel, the two after it a library path: most of the three decide
    ([(60, 90, 128, "tile", "tpe"), (32, 200, 128, "library", "tpe"), (200, 300, 128, "library", "tpe")], 128, False),
    ([(60, 90, 128, "library", "tpe"), (32, 200, 128, "tile", "tpe"), (200, 300, 128, "tile", "tpe")], 128, True),
    # a fourth, farther record does not vote
    ([(60, 90, 128, "library", "tpe"), (32, 200, 128, "tile", "tpe"), (200, 300, 128, "tile", "tpe"),
      (4000, 9000, 128, "library", "tpe")], 128, True),
])
def test_where_most_nearby_tuned_records_chose_a_library_path_the_check_times_the_library_paths_alone(
        device, monkeypatch, neighbours, bucket, kernels_timed):
    """Where most of the PRIOR_NEIGHBOURS tuned records nearest this problem at its M bucket (up to PRIOR_MAX_M)
    chose a library path, the check compiles and times no kernel: the library paths alone decide. A first-use
    check's record, another bucket's, or a larger M leaves this bucket's kernels checked beside them."""
    assert checked.PRIOR_MAX_M == 256 and checked.PRIOR_NEIGHBOURS == 3
    problem = Problem("down", 64, 96, bucket, torch.float32, "none", False, device=torch.device(device))
    for n, k, at, kind, policy in neighbours:
        _tuned_neighbour(device, "down", n, k, at, Library("eager") if kind == "library" else _TILE, policy)
    resolve.invalidate()
    nearest = resolve.resolve(problem)
    assert nearest.source is Source.NEAREST
    monkeypatch.setattr(checked, "interpreting", lambda: False)
    monkeypatch.setattr(objective.Evaluator, "library_ms", lambda self: {"eager": 2.0})
    timed, compiled = [], []

    def evaluate(self, config):
        timed.append(config)
        return TrialRecord(config, "ok", 1.0, "")
    monkeypatch.setattr(objective.Evaluator, "evaluate", evaluate)
    monkeypatch.setattr(checked, "_compile_one",
                        lambda problem, kernel, background=False: compiled.append(kernel) if kernel else None)
    monkeypatch.setattr(checked, "_times_on_gpu", lambda device: True)
    monkeypatch.setattr(objective.Evaluator, "retimed_side_by_side",
                        lambda self, record, library_ms, names, rivals=(): (record, library_ms))
    checked.precompile([(problem, nearest), (problem, nearest)])  # what a plan's first forward compiles
    choice = checked.checked(problem, nearest)
    assert bool(timed) == kernels_timed and bool(compiled) == kernels_timed
    assert choice.source == "checked" and isinstance(choice.config, KernelConfig) == kernels_timed
    if not kernels_timed:  # the library paths alone: no runner-up kernel for un-graphed calls
        assert choice.runner_up is None and Store().get_winner(problem.key()).config == Library("eager")


@pytest.mark.parametrize("gemv_votes", [3, 2, 1])
def test_where_most_nearby_tuned_records_at_one_row_chose_the_gemv_the_check_times_gemv_configs_alone(
        device, monkeypatch, gemv_votes):
    """At M = 1, where most nearby tuned records chose the GEMV, the check leaves out the tile configs (nearest's
    and heuristic's) it would otherwise compile beside the GEMV."""
    from autofuse import variants
    from autofuse.choose import heuristics
    from autofuse.choose.heuristics import alternatives_for, heuristic_for
    from autofuse.configs import Device

    # An H100 as the heuristics see it (the interpreter has no GEMV alternative).
    monkeypatch.setattr(heuristics, "device_info", lambda device: Device(False, 232448, 132, (9, 0)))
    problem = Problem("down", 4096, 8192, 1, torch.float32, "none", False, device=torch.device(device))
    gemv = next(c for c in (heuristic_for(problem), *alternatives_for(problem)) if variants.get(c.variant).static_k)
    for i, (n, k) in enumerate([(4000, 9000), (2048, 16384), (8192, 4096)]):
        _tuned_neighbour(device, "down", n, k, 1, gemv if i < gemv_votes else _TILE)
    resolve.invalidate()
    choice = resolve.resolve(problem)
    assert choice.source is Source.NEAREST
    kernels = checked._kernels_to_check(problem, choice, heuristic_for(problem))
    assert gemv in kernels and len(kernels) >= 2 - (gemv_votes >= 2)
    assert all(k.variant == "gemv" for k in kernels) == (gemv_votes >= 2)


@pytest.mark.parametrize("one_launch_ms", [3.0, 4.1, 5.0])
def test_beside_two_checked_ops_the_one_launch_mlp_is_checked_too(device, monkeypatch, one_launch_ms):
    """At small M the one-launch MLP runs unless the two checked ops together (2 + 2 here) beat it by
    one_launch_margin (4.1 is within it: one launch saves a plain call a launch's host time), and where its
    check timed it faster than eager's MLP (10 here)."""
    _fake_timer(monkeypatch, library_ms=10.0, kernel_ms=2.0, one_launch_ms=one_launch_ms)
    mlp, w = _mlp(device)
    x = torch.randn(M, D, device=device)
    with torch.no_grad():
        out = mlp(x)
    torch.testing.assert_close(out, eager_mlp(x, *w, activation="silu"), rtol=1e-4, atol=1e-4)
    if one_launch_ms < 4.0 * (1 + current_policy().one_launch_margin):
        assert list(mlp.config_for(M)) == ["mlp"] and mlp.config_sources(M) == {"mlp": "checked"}
    else:
        assert list(mlp.config_for(M)) == ["gated_up", "down"]
    assert {w.key.op for w in Store().winners()} == {"gated_up", "down", "mlp"}


@pytest.mark.parametrize("pair_us, one_launch_us, expected", [(2.5, 3.5, ["gated_up", "down"]),
                                                             (3.5, 3.45, ["mlp"]), (3.5, 2.5, ["mlp"])])
def test_where_a_gpu_can_time_the_pair_and_the_one_launch_kernel_are_timed_together_side_by_side(
        device, monkeypatch, pair_us, one_launch_us, expected):
    """The records say one launch (3.5 against 2 + 2); the two tables timed side by side decide, each op of the
    pair called after the other as the module calls them, one_launch_margin still going to one launch."""
    _fake_timer(monkeypatch, library_ms=10.0, kernel_ms=2.0, one_launch_ms=3.5)
    asked = []

    def side_by_side(tables):
        asked.append({name: [(problem.op, choice.source.value) for problem, choice in table]
                      for name, table in tables.items()})
        return {"pair": pair_us, "mlp": one_launch_us}
    monkeypatch.setattr(checked, "tables_side_by_side", side_by_side)
    mlp, w = _mlp(device)
    x = torch.randn(M, D, device=device)
    with torch.no_grad():
        out = mlp(x)
    torch.testing.assert_close(out, eager_mlp(x, *w, activation="silu"), rtol=1e-4, atol=1e-4)
    assert asked == [{"pair": [("gated_up", "checked"), ("down", "checked")], "mlp": [("mlp", "checked")]}]
    assert list(mlp.config_for(M)) == expected


def test_tables_side_by_side_call_each_tables_ops_in_turn_and_need_a_gpu(device, monkeypatch):
    problem = Problem("down", 48, 80, 4, torch.float32, "none", False, device=torch.device(device))
    table = [(problem, Choice(Library("eager"), Source.CHECKED))]
    # Where no GPU times (the interpreter's times mean nothing), the records decide.
    monkeypatch.setattr(checked, "_times_on_gpu", lambda device: False)
    assert checked.tables_side_by_side({"a": table, "b": table}) is None
    monkeypatch.setattr(checked, "_times_on_gpu", lambda device: True)
    calls = []
    monkeypatch.setattr(objective.Evaluator, "runner", lambda self, config: lambda: calls.append(self.key.op))
    monkeypatch.setattr(objective.Evaluator, "side_by_side_ms",
                        lambda self, fns: {name: (fn(), float(len(calls)))[1] for name, fn in fns.items()})
    up = problem.replace(op="gated_up", n=80, k=48, activation="silu")
    times = checked.tables_side_by_side({"pair": [(up, table[0][1]), *table], "one": table})
    assert calls == ["gated_up", "down", "down"] and times == {"pair": 2.0, "one": 3.0}


def test_a_large_mlp_s_first_use_checks_the_pair_alone(device, monkeypatch):
    """Above one_launch_check_max_mb of weights the one-launch kernel, which lost every first-use check measured
    there, is neither checked nor run at first use, even where its fake time would win."""
    _fake_timer(monkeypatch, library_ms=10.0, kernel_ms=2.0, one_launch_ms=1.0)
    mlp, w = _mlp(device)
    x = torch.randn(M, D, device=device)
    with torch.no_grad(), use_policy(dataclasses.replace(current_policy(), one_launch_check_max_mb=1e-6)):
        out = mlp(x)
    torch.testing.assert_close(out, eager_mlp(x, *w, activation="silu"), rtol=1e-4, atol=1e-4)
    assert list(mlp.config_for(M)) == ["gated_up", "down"]
    assert {w.key.op for w in Store().winners()} == {"gated_up", "down"}


def test_a_check_that_fails_runs_the_library_path_once_and_stores_nothing(device, monkeypatch, caplog):
    """A check that cannot run (here: no memory for its operands) must not fail the forward, nor be
    retried on every forward: the eager library path runs for the rest of the process."""
    from autofuse.errors import AutofuseError

    attempts = []

    def no_memory(*args, **kwargs):
        attempts.append(1)
        raise AutofuseError("gated_up with n=72, k=40 at M=5 needs about 9.0 GiB to tune; 1.0 GiB are free")
    monkeypatch.setattr(objective.Evaluator, "__init__", no_memory)
    # The checks' attempts alone: on a GPU the plan first compiles the checks' kernels, each through an Evaluator.
    monkeypatch.setattr(checked, "precompile", lambda jobs: None)
    mlp, w = _mlp(device)
    x = torch.randn(M, D, device=device)
    with torch.no_grad():
        for _ in range(3):
            out = mlp(x)
    torch.testing.assert_close(out, eager_mlp(x, *w, activation="silu"), rtol=1e-4, atol=1e-4)
    assert mlp.config_sources(M) == {"gated_up": Source.CHECK_FAILED, "down": Source.CHECK_FAILED}
    assert len(attempts) == 2 and list(Store().winners()) == []  # once per op, never stored
    assert any("could not check" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("times, expected", [((1.0, 2.0), "gated_pairs"), ((2.0, 1.0), "gated_up"),
                                             ((1.0, 1.05), "gated_pairs")])
def test_the_faster_of_two_ops_goes_by_their_records_where_nothing_can_time(times, expected):
    # On the CPU (and while capturing or tracing) nothing is timed again: the recorded times decide, a
    # near tie included. On a GPU a near tie is timed side by side (tests/test_gpu.py).
    pairs, up = (Choice(Library("eager"), Source.CHECKED, t) for t in times)
    problem = Problem("gated_up", 72, 40, 16, torch.float32, "silu")
    assert checked.faster_of(("gated_pairs", pairs), ("gated_up", up), problem) == expected


@dataclasses.dataclass
class _Record:
    config: object
    time_ms: float
    status: str = "ok"


class _SideBySideEvaluator:
    """The evaluator's real retimed_side_by_side over fake runners and side-by-side times (`times(name)`)."""

    def __init__(self, times):
        self.times = times
        self.asked = []  # the side-by-side timings asked for, by the names timed

    def runner(self, config):
        return config

    def side_by_side_ms(self, fns):
        self.asked.append(sorted(fns))
        return {name: self.times(name) for name in fns}

    retimed_side_by_side = objective.Evaluator.retimed_side_by_side  # the real one, over the fakes above


def test_a_near_tie_is_timed_again_side_by_side_with_every_near_library_path():
    """Checks time the kernel and each library path on its own; where the fastest of them are within near_tie,
    the kernel and every library path that near are timed again in turn, and those times decide."""
    kernel = _Record(KernelConfig(16, 64, 64, group_m=8, num_warps=4, num_stages=3), 1.0)
    evaluator = _SideBySideEvaluator(lambda name: 0.5 if name == "library:cublas_gated_act" else 0.9)
    record, library = checked._side_by_side_if_near(evaluator, kernel, {"eager": 0.95, "cublas_gated_act": 1.03,
                                                                        "far": 2.0})
    assert evaluator.asked == [["kernel", "library:cublas_gated_act", "library:eager"]]
    assert record.time_ms == 0.9 and library == {"eager": 0.9, "cublas_gated_act": 0.5, "far": 2.0}
    assert isinstance(evaluator.runner(Library("eager")), Library)
    # No near tie: nothing is timed again.
    record, library = checked._side_by_side_if_near(evaluator, kernel, {"eager": 3.0})
    assert len(evaluator.asked) == 1 and record is kernel and library == {"eager": 3.0}
    # A kernel far behind (or one that failed its check) leaves the library paths' near tie to be timed again
    # among themselves; the kernel's record is kept as it was.
    for far_kernel in (kernel, _Record(kernel.config, float("nan"), status="wrong")):
        record, library = checked._side_by_side_if_near(evaluator, far_kernel, {"eager": 0.4, "cublas_gated_act": 0.41,
                                                                                "far": 2.0})
        assert evaluator.asked[-1] == ["library:cublas_gated_act", "library:eager"]
        assert record is far_kernel and library == {"eager": 0.9, "cublas_gated_act": 0.5, "far": 2.0}
    # A single library path near the fastest, kernel far: nothing to decide, nothing timed.
    asked = len(evaluator.asked)
    checked._side_by_side_if_near(evaluator, kernel, {"eager": 0.4, "far": 2.0})
    assert len(evaluator.asked) == asked


def test_kernels_near_the_fastest_are_timed_again_side_by_side_and_the_fastest_so_timed_is_kept():
    """Two kernels of a check (the fp8 decode tiles' pair) timed one after the other within near_tie of each other
    are timed again in turn beside the near library paths, and the one fastest in those rounds is kept."""
    first = _Record(KernelConfig(16, 64, 256, group_m=8, num_warps=4, num_stages=2), 1.00)
    second = _Record(KernelConfig(16, 64, 128, group_m=8, num_warps=4, num_stages=6), 1.05)
    evaluator = _SideBySideEvaluator({"kernel": 1.10, "kernel 2": 0.95, "library:eager": 1.2}.get)
    record, library = checked._side_by_side_if_near(evaluator, first, {"eager": 1.08}, [second])
    assert evaluator.asked == [["kernel", "kernel 2", "library:eager"]]
    assert record.config == second.config and record.time_ms == 0.95 and library == {"eager": 1.2}
    # A rival near the fastest kernel is timed again even where no library path is near.
    record, library = checked._side_by_side_if_near(evaluator, first, {"eager": 3.0}, [second])
    assert evaluator.asked[-1] == ["kernel", "kernel 2"] and record.config == second.config


def test_a_plans_kernels_are_compiled_at_once_before_their_checks(monkeypatch):
    """On a GPU a check's time is mostly its kernel's compile: the plan's unchecked ops (and the one-launch
    kernel about to be checked beside them) are compiled on threads at once, before the checks run in turn."""
    import threading

    from autofuse.choose import MLPPlan, plans

    compiled = []

    backgrounds = []

    def precompile(self, config, background=False):
        compiled.append((self.key.op, config, threading.current_thread().name))
        backgrounds.append(background)

    monkeypatch.setattr(objective.Evaluator, "precompile", precompile)
    libraries = []
    monkeypatch.setattr(objective.Evaluator, "precompile_library", lambda self: libraries.append(self.key.op))
    monkeypatch.setattr(checked, "_times_on_gpu", lambda device: True)
    monkeypatch.setattr(checked, "_compare", lambda key, M, kernels, device, heuristic=None: (_ for _ in ()).throw(
        RuntimeError("the test stops at the checks")))
    plan = MLPPlan(D, F_, "silu", False, pairs=True)
    plans._precompile(plan, 4, torch.float32, torch.device("cpu"))
    assert sorted(op for op, _, _ in compiled) == ["down", "gated_pairs", "gated_up", "mlp"]
    # the library paths that launch a Triton pass of autofuse's (cuBLAS + gated_act, cublas_pairs + pairs_act)
    problems = [plan.problem(op, 4, torch.float32, torch.device("cpu")) for op in ("down", "gated_pairs", "gated_up")]
    with_passes = [p.op for p in problems if set(p.spec.library_for(p.activation, p.bias, p.residual)) - {"eager"}]
    assert "gated_pairs" in with_passes and sorted(libraries) == sorted(with_passes)
    assert {name for _, _, name in compiled} == {"autofuse-precompile"}
    assert all(isinstance(config, KernelConfig) for _, config, _ in compiled)
    # Checks' kernels: a compile worker may finish them while the checks before theirs time.
    assert backgrounds and all(backgrounds)
    compiled.clear()
    plans._precompile(MLPPlan(D, F_, "silu", False), 128, torch.float32, torch.device("cpu"))  # no one launch
    assert sorted(op for op, _, _ in compiled) == ["down", "gated_up"]


def test_a_plans_tuned_kernels_are_compiled_at_once_too(device, monkeypatch):
    """Tuned choices have nothing to check, but their kernels compile on the module's first forward all the same:
    the plan compiles them on threads at once, the one-launch kernel's record among them; library choices
    compile nothing."""
    from autofuse.choose import MLPPlan, plans
    from autofuse.configs import Library

    compiled = []
    backgrounds = []

    def precompile(self, config, background=False):
        compiled.append((self.key.op, config))
        backgrounds.append(background)
    monkeypatch.setattr(objective.Evaluator, "precompile", precompile)
    monkeypatch.setattr(objective.Evaluator, "precompile_library", lambda self: None)
    monkeypatch.setattr(checked, "_times_on_gpu", lambda device: True)
    plan = MLPPlan(D, F_, "silu", False)
    _tuned_neighbour(device, "gated_up", F_, D, 4, _TILE, activation="silu")
    _tuned_neighbour(device, "down", D, F_, 4, _TILE)
    _tuned_neighbour(device, "mlp", F_, D, 4, _TILE, activation="silu")
    resolve.invalidate()
    plans._precompile(plan, 4, torch.float32, torch.device(device))
    assert sorted(compiled) == [("down", _TILE), ("gated_up", _TILE), ("mlp", _TILE)]
    assert backgrounds and not any(backgrounds)  # the module runs tuned kernels itself: compiled before it goes on
    compiled.clear()
    _tuned_neighbour(device, "down", D, F_, 4, Library("eager"))
    resolve.invalidate()
    plans._precompile(plan, 4, torch.float32, torch.device(device))
    assert sorted(compiled) == [("gated_up", _TILE), ("mlp", _TILE)]


@pytest.mark.parametrize("pairs_tuned", [False, True])
def test_at_one_row_a_gemv_up_projection_leaves_the_unchecked_gated_pairs_out(device, monkeypatch, pairs_tuned):
    """gated_pairs has no GEMV variant: where the gated up-projection's check times (and chooses) a GEMV at M = 1,
    gated_pairs's kernels are neither compiled nor checked, unless a record of it exists: its library paths alone
    (their passes compiled ahead, a job without a choice)."""
    from autofuse.choose import MLPPlan, heuristics, plans
    from autofuse.configs import Device

    monkeypatch.setattr(heuristics, "device_info", lambda device: Device(False, 232448, 132, (9, 0)))
    plan = MLPPlan(4096, 14336, "silu", False, pairs=True)
    pairs = plan.problem("gated_pairs", 1, torch.float32, torch.device(device))
    if pairs_tuned:
        _tuned_neighbour(device, "gated_pairs", 14336, 4096, 1, _TILE, activation="silu")
        resolve.invalidate()
    gemv = heuristics.heuristic_for(plan.problem("gated_up", 1, torch.float32, torch.device(device)))
    assert gemv.variant == "gemv"
    pairs_choice = resolve.resolve(pairs)
    assert plans._pairs_left_out(pairs_choice, gemv) == (not pairs_tuned)
    assert not plans._pairs_left_out(pairs_choice, _TILE) and not plans._pairs_left_out(pairs_choice, None)
    jobs = []
    monkeypatch.setattr(checked, "precompile", lambda work: jobs.extend((p.op, c is None) for p, c in work))
    plans._precompile(plan, 1, torch.float32, torch.device(device))
    assert ("gated_pairs", not pairs_tuned) in jobs and {("gated_up", False), ("down", False)} <= set(jobs)


def test_a_check_of_the_library_paths_alone_compiles_no_kernel(device, monkeypatch):
    _fake_timer(monkeypatch, library_ms=1.0, kernel_ms=0.5)
    evaluated = []
    monkeypatch.setattr(objective.Evaluator, "evaluate", lambda self, config: evaluated.append(config))
    problem = Problem("gated_pairs", F_, D, 1, torch.float32, "silu")
    choice = checked.checked(problem, resolve.resolve(problem), libraries_only=True)
    assert evaluated == [] and isinstance(choice.config, Library) and choice.runner_up is None
    assert choice.source is Source.CHECKED and choice.time_ms == 1.0
    assert [w.key.op for w in Store().winners()] == ["gated_pairs"]  # stored: the next process reads it


def test_the_forward_after_the_checks_does_not_resolve_again(device, monkeypatch):
    """Each stored decision moves lookup.generation(); the module keeps the table its first forward resolved
    under the generation its own checks moved to, so the next forward resolves nothing (a near tie between two
    ops would otherwise be timed again)."""
    from autofuse import fused_module

    _fake_timer(monkeypatch, library_ms=3.0, kernel_ms=2.0)
    mlp, _ = _mlp(device)
    x = torch.randn(M, D, device=device)
    selected = []
    real = fused_module.select
    monkeypatch.setattr(fused_module, "select", lambda *a: selected.append(1) or real(*a))
    with torch.no_grad():
        mlp(x)
        mlp(x)
        mlp(x)
    assert len(selected) == 1


def test_a_first_forward_that_checked_ends_with_one_garbage_collection_and_later_ones_with_none(device,
                                                                                                monkeypatch):
    """A check's compiles and timings fill Python's young generations; their collection runs inside the first
    forward (plans.select), once, not 50-100 un-graphed calls later, and not the full collection (0.13 s on a GPU
    host). A forward that resolves without a check collects nothing."""
    from autofuse.choose import plans

    _fake_timer(monkeypatch, library_ms=3.0, kernel_ms=2.0)
    collected = []
    monkeypatch.setattr(plans.gc, "collect", lambda *a: collected.append(a) or 0)
    mlp, _ = _mlp(device)
    x = torch.randn(M, D, device=device)
    with torch.no_grad():
        mlp(x)
    assert mlp.config_sources(M) == {"gated_up": "checked", "down": "checked"} and collected == [(1,)]
    again, _ = _mlp(device)  # a second module of the same shape: the checked records decide, nothing is checked
    with torch.no_grad():
        again(x)
        mlp(x)
    assert len(collected) == 1
