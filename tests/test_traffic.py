"""Traffic recording (autofuse/traffic.py) and tuning from it (autofuse/tune/traffic.py, `tune --traffic`):
counts that match the calls made, traces that merge across processes, exact keys for the hot M values, the
trial budget spread by time share, and an expected-saving table that adds up."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _helpers import write_json
from click.testing import CliRunner

import autofuse
from autofuse import traffic
from autofuse.cli import main
from autofuse.key import current_environment
from autofuse.tune import traffic as from_traffic
from autofuse.tune.driver import TuneOptions

D, F_ = 40, 72


def _trace(entries, gpu="NVIDIA H100 80GB HBM3"):
    return {"format": "autofuse-traffic", "version": 1, "gpu": gpu, "time": "GPU ms (CUDA events)",
            "entries": entries}


def _mlp_entry(tokens, train=False, dims=(D, F_)):
    return {"kind": "mlp", "dims": list(dims), "activation": "silu", "bias": False, "dtype": "float32",
            "train": train, "tokens": tokens}


def test_recorded_counts_match_the_calls_made(tmp_path):
    mlp = autofuse.get_mlp(D, F_, activation="silu", dtype=torch.float32, device="cpu")
    lin = autofuse.get_linear(D, 56, activation="gelu", dtype=torch.float32, device="cpu")
    calls = {1: 7, 3: 3, 20: 1}
    with autofuse.record_traffic(tmp_path / "t.json", sample_every=3) as recorder:
        with torch.no_grad():
            for M, n in calls.items():
                for _ in range(n):
                    mlp(torch.randn(M, D))
                    lin(torch.randn(2, M, D))  # rows of a 3-d input: 2 M
            mlp(torch.randn(0, D))  # an empty batch: nothing to count
        mlp(torch.randn(4, D))  # a forward that builds a graph: recorded as training traffic
    assert traffic.recorder is None and not list(tmp_path.glob("*.tmp"))  # written, renamed, none left behind
    recorded = traffic.load(tmp_path / "t.json")
    by_shape = {shape.kind + (" train" if shape.train else ""): by_m for shape, by_m in recorded.counts.items()}
    assert {M: c.calls for M, c in by_shape["mlp"].items()} == calls
    assert {M: c.calls for M, c in by_shape["linear"].items()} == {2 * M: n for M, n in calls.items()}
    assert {M: c.calls for M, c in by_shape["mlp train"].items()} == {4: 1}
    # Timed per module: its second call at each M, then every third; never its first (resolves and binds).
    assert {M: c.sampled for M, c in by_shape["mlp"].items()} == {1: 3, 3: 2, 20: 0}
    assert all(c.sampled_ms > 0 for c in by_shape["mlp"].values() if c.sampled)
    assert recorder.calls(mlp, 1) == 7 and recorder.calls(lin, 40) == 1


def test_a_dtype_change_while_recording_keeps_each_call_under_its_dtype(tmp_path):
    mlp = autofuse.get_mlp(D, F_, activation="silu", dtype=torch.float32, device="cpu")
    with autofuse.record_traffic(tmp_path / "t.json", sample_every=2) as recorder:
        with torch.no_grad():
            for _ in range(3):
                mlp(torch.randn(2, D))
            mlp.to(torch.float16)
            for _ in range(2):
                mlp(torch.randn(2, D, dtype=torch.float16))
        assert recorder.calls(mlp, 2) == 2  # counted since the change
    recorded = traffic.load(tmp_path / "t.json")
    assert {shape.dtype: {M: c.calls for M, c in by_m.items()} for shape, by_m in recorded.counts.items()} == {
        "float32": {2: 3}, "float16": {2: 2}}


def test_a_module_freed_while_recording_passes_nothing_to_the_next(tmp_path):
    # Modules are counted by object, not id(): a new module may be allocated where a freed one was.
    with autofuse.record_traffic(tmp_path / "t.json") as recorder:
        with torch.no_grad():
            for width in (D, 2 * D):
                lin = autofuse.get_linear(width, 56, activation="gelu", dtype=torch.float32, device="cpu")
                lin(torch.randn(3, width))
                assert recorder.calls(lin, 3) == 1
                del lin
    recorded = traffic.load(tmp_path / "t.json")
    assert {shape.dims: {M: c.calls for M, c in by_m.items()} for shape, by_m in recorded.counts.items()} == {
        (D, 56): {3: 1}, (2 * D, 56): {3: 1}}


def test_recording_off_costs_no_trace_and_a_bad_input_keeps_its_error(tmp_path):
    mlp = autofuse.get_mlp(D, F_, activation="silu", dtype=torch.float32, device="cpu")
    with autofuse.record_traffic(tmp_path / "t.json"):
        with pytest.raises(autofuse.AutofuseError, match="expected input of shape"):
            mlp(torch.randn(3, D + 1))
        with pytest.raises(autofuse.AutofuseError, match="already being recorded"):
            with autofuse.record_traffic(tmp_path / "u.json"):
                pass
    assert traffic.load(tmp_path / "t.json").counts == {}


_RECORD = textwrap.dedent("""
    import sys, torch, autofuse
    mlp = autofuse.get_mlp(40, 72, activation="silu", dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for M in [1] * int(sys.argv[1]) + [5] * int(sys.argv[2]):
            mlp(torch.randn(M, 40))
""")


def test_two_processes_write_one_folder_and_their_traces_merge(tmp_path):
    folder = tmp_path / "traces"
    env = dict(os.environ, AUTOFUSE_TRAFFIC=str(folder), TRITON_INTERPRET="1")
    for ones, fives in ((4, 1), (2, 3)):
        done = subprocess.run([sys.executable, "-c", _RECORD, str(ones), str(fives)], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    files = sorted(folder.glob("traffic-*.json"))
    assert len(files) == 2
    merged = traffic.load(folder)
    ((shape, by_m),) = merged.counts.items()
    assert shape.kind == "mlp" and {M: c.calls for M, c in by_m.items()} == {1: 6, 5: 4}
    assert merged.gpus == {"cpu"} and len(merged.sources) == 2
    out = CliRunner().invoke(main, ["traffic", "show", str(folder)])
    assert out.exit_code == 0, out.output
    assert "2 trace(s)" in out.output and "mlp 40->72 silu float32: 10 calls" in out.output


@pytest.mark.parametrize("document, problem", [
    ({"format": "other"}, "not an autofuse traffic trace"),
    (_trace([_mlp_entry([[0, 1, 0, 0.0]])]), "tokens[0] must be an integer >= 1"),
    (_trace([_mlp_entry([[4, 1, 2, 0.5]])]), "within the calls"),
    (_trace([{**_mlp_entry([]), "kind": "conv"}]), "kind must be one of"),
    (_trace([_mlp_entry([[4, 1, 1, float("nan")]])]), "within the calls"),
])
def test_a_bad_trace_is_one_line_naming_the_problem(tmp_path, document, problem):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    out = CliRunner().invoke(main, ["traffic", "show", str(path)])
    assert out.exit_code == 2 and problem in out.output and len(out.output.strip().splitlines()) == 1, out.output


# A skewed decode trace: M = 1 and M = 8 carry the time; M = 2..7 and 9..30 are a tail.
SKEWED = _trace([_mlp_entry([[1, 9000, 500, 50.0], [8, 3000, 200, 40.0], *[[m, 10, 1, 0.2] for m in range(2, 8)],
                             *[[m, 5, 1, 0.3] for m in range(9, 31)]])])


def test_tuning_from_a_skewed_trace_tunes_exactly_its_hot_m_values(tmp_path):
    recorded = traffic.parse(SKEWED, "skewed")
    planned = from_traffic.plan(recorded)
    exact = sorted(p.run_m for p in planned.points if p.exact)
    assert exact == [1, 8]  # 900 ms and 600 ms of 1500 + tail
    buckets = {p.key_m: p for p in planned.points if not p.exact}
    # 2..7 go to buckets 2, 4 and 8; bucket 8's key is M = 8's exact one, which serves 5..7 too.
    assert set(buckets) == {2, 4, 16, 32}
    assert buckets[4].tokens == (3, 4) and buckets[16].tokens == tuple(range(9, 17))
    assert 9 <= buckets[16].run_m <= 16 and buckets[16].run_m != 16  # the traffic's median, not the edge
    eight = next(p for p in planned.points if p.exact and p.run_m == 8)
    assert eight.tokens == (5, 6, 7, 8)
    jobs = from_traffic.jobs(planned.points, torch.device("cpu"))
    keyed = {(job.key.op, job.key.m_bucket, job.M) for job, _ in jobs}
    assert ("down", 1, 1) in keyed and ("down", 8, 8) in keyed and ("down", 16, buckets[16].run_m) in keyed
    assert all(job.key.gpu == current_environment(torch.device("cpu")).gpu for job, _ in jobs)
    assert not any(job.key.op == "gated_bwd" for job, _ in jobs)  # inference traffic: no backward keys


def test_training_traffic_keys_the_down_projection_at_the_training_steps_sizes_too():
    """d_model 40 and d_ff 72 are multiples of 8, not of 16: inference runs the down projection at 64 x 128 (padded
    storage), a training step at 40 x 72 (training.Padding leaves them); recorded training traffic keys both, and
    the backward at the training step's sizes; inference traffic keys the inference sizes only."""
    for train, expected in ((True, {(64, 128), (40, 72)}), (False, {(64, 128)})):
        recorded = traffic.parse(_trace([_mlp_entry([[37, 100, 10, 9.0]], train=train)]), "fake timer")
        jobs = from_traffic.jobs(from_traffic.plan(recorded).points, torch.device("cpu"))
        assert {(job.key.n, job.key.k) for job, _ in jobs if job.key.op == "down"} == expected
        backward = {(job.key.n, job.key.k) for job, _ in jobs if job.key.op == "gated_bwd"}
        assert backward == ({(72, 40)} if train else set())


def test_the_trial_budget_is_spread_by_time_share():
    recorded = traffic.parse(_trace([_mlp_entry([[1, 100, 10, 9.0], [64, 100, 10, 1.0]])]), "fake timer")
    planned = from_traffic.plan(recorded)
    keyed = from_traffic.jobs(planned.points, torch.device("cpu"), only={"down"})
    runs = from_traffic.budgets(keyed, TuneOptions(trials=20))
    trials = {job.M: options.trials for job, options in runs}
    # 40 trials over 2 keys: 3 each, and the 34 left 9 : 1 by time (90 ms against 10).
    assert trials == {1: 3 + round(34 * 0.9), 64: 3 + round(34 * 0.1)}
    timed = from_traffic.budgets(keyed, TuneOptions(trials=None, time_budget_s=10.0))
    seconds = {job.M: options.time_budget_s for job, options in timed}
    assert seconds[1] == pytest.approx(1.0 + 18.0 * 0.9) and seconds[64] == pytest.approx(1.0 + 18.0 * 0.1)


def test_the_expected_saving_table_adds_up(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOFUSE_CACHE_DIR", str(tmp_path / "cache"))
    trace = write_json(tmp_path / "trace.json", _trace([_mlp_entry([[1, 50, 5, 5.0], [3, 20, 2, 2.4]])], gpu="cpu"))
    out = CliRunner().invoke(main, ["tune", "--traffic", str(trace), "--trials", "3"])
    assert out.exit_code == 0, out.output
    table = out.output.split("expected saving over the recorded traffic")[1].splitlines()[2:]
    rows = [line.split() for line in table if line.startswith("mlp ")]
    total = next(line.split() for line in table if line.startswith("total"))
    assert len(rows) == 2
    for column in (-4, -3, -2):  # recorded, tuned, saved
        assert float(total[column]) == pytest.approx(sum(float(r[column]) for r in rows), abs=2e-3)
    assert float(rows[0][-4]) == pytest.approx(50.0) and float(rows[1][-4]) == pytest.approx(24.0)


def test_tune_traffic_refuses_what_it_cannot_do(tmp_path):
    trace = write_json(tmp_path / "trace.json", SKEWED)
    out = CliRunner().invoke(main, ["tune", "--traffic", str(trace), "--devices", "cpu,cpu"])
    assert out.exit_code == 2 and "leave out --devices" in out.output
    out = CliRunner().invoke(main, ["tune", "--traffic", str(trace), "--tokens", "1,2"])
    assert out.exit_code == 2 and "leave out --tokens" in out.output


def test_fp8_modules_are_recorded_under_their_format_and_tuned_with_its_ops(tmp_path):
    mlp = autofuse.get_mlp(D, F_, activation="silu", dtype=torch.float32, device="cpu", weights="fp8")
    lin = autofuse.get_linear(D, 56, activation="gelu", dtype=torch.float32, device="cpu", weights="w8a8")
    dense = autofuse.get_mlp(D, F_, activation="silu", dtype=torch.float32, device="cpu")
    with autofuse.record_traffic(tmp_path / "t.json", sample_every=2):
        with torch.no_grad():
            for _ in range(3):
                mlp(torch.randn(2, D))
                lin(torch.randn(2, D))
                dense(torch.randn(2, D))
    recorded = traffic.load(tmp_path / "t.json")
    by_format = {(shape.kind, shape.weights): {M: c.calls for M, c in by_m.items()}
                 for shape, by_m in recorded.counts.items()}
    assert by_format == {("mlp", "fp8"): {2: 3}, ("linear", "w8a8"): {2: 3}, ("mlp", "dense"): {2: 3}}
    document = json.loads((tmp_path / "t.json").read_text())
    assert sorted(e.get("weights", "dense") for e in document["entries"]) == ["dense", "fp8", "w8a8"]
    planned = from_traffic.plan(recorded)
    ops_of = {}
    for job, point in from_traffic.jobs(planned.points, torch.device("cpu")):
        ops_of.setdefault(point.shape.weights, set()).add(job.key.op)
    assert ops_of["fp8"] == {"gated_up_fp8", "down_fp8"} and ops_of["w8a8"] == {"linear_w8a8"}
    assert "gated_up" in ops_of["dense"] and not any(op.endswith(("_fp8", "_w8a8")) for op in ops_of["dense"])
    assert sorted(shape.label() for shape in recorded.counts) == sorted([
        f"mlp {D}->{F_} silu float32", f"mlp {D}->{F_} silu float32 fp8", f"linear {D}->56 gelu bias float32 w8a8"])
