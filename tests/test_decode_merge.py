"""benchmarks/decode.py: --merge keeps the parts' run, not the merging machine's; --tune tunes the shapes it runs;
--split-k's summary of the heuristic's split against each point's fastest."""

import json
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
decode = pytest.importorskip("decode")


def _part(tmp_path: Path, name: str, gpu: str, command: str, seed: int = 37, tuned: dict | None = None) -> str:
    row = dict(name="drawn-mlp-0", d_model=64, d_ff=128, activation="silu", M=1, ratio=1.05, best_peer="eager",
               us={"eager": 10.5, "autofuse": 10.0}, plain_ratio=1.1, roofline_us=9.0,
               over_roofline={"eager": 10.5 / 9, "autofuse": 10.0 / 9}, weight_bytes=2 * 3 * 64 * 128)
    path = tmp_path / name
    path.write_text(json.dumps(dict(run=dict(gpu=gpu, commit="abc1234", command=command), seed=seed, ceilings={},
                                    liger=True, rows=[row], seconds=1.0, tuned=tuned)))
    return str(path)


def test_a_merge_keeps_the_parts_gpu_and_commands(tmp_path):
    a = _part(tmp_path, "a.json", "NVIDIA H200", "python benchmarks/decode.py --only 0")
    tuned = dict(keys=80, seconds=198.0, trials=30, time_budget_s=1.8)
    b = _part(tmp_path, "b.json", "NVIDIA H200", "python benchmarks/decode.py --only 1", tuned=tuned)
    decode.merge([a, b], str(tmp_path / "out"))
    merged = json.loads((tmp_path / "out" / "decode.json").read_text())
    assert merged["run"]["gpu"] == "NVIDIA H200" and merged["run"]["commit"] == "abc1234"
    assert merged["run"]["command"] == "python benchmarks/decode.py --only 0 ; python benchmarks/decode.py --only 1"
    assert len(merged["rows"]) == 2 and merged["summary"]["points"] == 2
    assert merged["tuned"] == [None, tuned]  # each part's tuning run, where it had one


def test_a_merge_refuses_parts_of_different_gpus(tmp_path):
    a = _part(tmp_path, "a.json", "NVIDIA H200", "x")
    b = _part(tmp_path, "b.json", "NVIDIA H100 80GB HBM3", "y")
    with pytest.raises(SystemExit, match="different GPUs"):
        decode.merge([a, b], str(tmp_path / "out"))


def test_tune_runs_autofuse_tune_of_the_selected_shapes_at_every_op(monkeypatch):
    driver = pytest.importorskip("autofuse.tune.driver")
    seen = {}

    def tune_shapes(shapes, device, options=None, *, train=False, only=None, progress=None, **overrides):
        seen.update(shapes=shapes, train=train, only=only, overrides=overrides, progress=progress)
        return [None] * 5

    monkeypatch.setattr(driver, "tune_shapes", tune_shapes)
    gated, _ = decode.draw_shapes(37, 3, 0)
    tuned = decode.tune_drawn(gated, [0, 2], [32, 64], 30, 1.8, decode.torch.device("cpu"))
    shapes = seen["shapes"]
    assert [m.name for m in shapes.mlps] == ["drawn-mlp-0", "drawn-mlp-2"]
    assert [(m.d_model, m.d_ff, m.activation) for m in shapes.mlps] == [
        (g["d_model"], g["d_ff"], g["activation"]) for g in (gated[0], gated[2])]
    assert tuple(shapes.tokens) == (32, 64) and not shapes.linears
    # Every op, as `autofuse tune --shapes` runs them by default; the inference ops only.
    assert seen["only"] is None and seen["train"] is False and seen["progress"] is not None
    assert seen["overrides"] == dict(trials=30, time_budget_s=1.8)
    assert tuned["keys"] == 5 and tuned["trials"] == 30 and tuned["time_budget_s"] == 1.8


def test_tune_without_trials_takes_autofuse_tunes_default(monkeypatch):
    driver = pytest.importorskip("autofuse.tune.driver")
    seen = {}
    monkeypatch.setattr(driver, "tune_shapes", lambda shapes, device, **overrides: seen.update(overrides) or [])
    gated, _ = decode.draw_shapes(37, 1, 0)
    tuned = decode.tune_drawn(gated, [0], [32], None, None, decode.torch.device("cpu"))
    assert seen["trials"] == driver.DEFAULT_TRIALS == tuned["trials"] and seen["time_budget_s"] is None


def _split_row(op, heuristic, covering, us):
    return dict(op=op, N=576, K=2688, M=16, tile="16x64x128", tiles=9, heuristic_split=heuristic,
                covering_split=covering, us={str(s): u for s, u in us.items()})


def test_the_summary_compares_each_rule_with_the_fastest_split():
    rows = [_split_row("linear", 8, 16, {1: 8.0, 8: 5.0, 16: 6.0}),
            _split_row("linear", 4, 8, {1: 9.0, 4: 6.0, 8: 12.0}),
            _split_row("gated_up", 1, 2, {1: 4.0, 2: 6.0}), _split_row("gated_pairs", 1, 2, {1: 5.0, 2: 4.5})]
    summary = decode.summarize_splits(rows)
    assert summary["linear"]["points"] == 2
    assert summary["linear"]["heuristic_split"] == dict(geomean=1.0, worst=1.0, over_1_10=0)
    covering = summary["linear"]["covering_split"]
    assert math.isclose(covering["geomean"], math.sqrt(6.0 / 5.0 * 12.0 / 6.0)) and covering["worst"] == 2.0
    assert covering["over_1_10"] == 2
    assert summary["gated"]["unsplit_fastest"] == 1  # gated_pairs' split 2 ran faster there
    assert math.isclose(summary["gated"]["heuristic_split"]["worst"], 5.0 / 4.5)


@pytest.mark.parametrize("op", ["linear", "gated_up", "gated_pairs"])
def test_a_split_point_runs_the_heuristic_tile_at_each_split_it_keeps(op):
    # The GPU's heuristic (split-K within one wave) on a small problem, its kernels run on this machine (the
    # interpreter without a GPU); every split computes the unsplit tile's output.
    from autofuse.configs import Device

    outputs = {}

    def timer(runs):
        for split, run in runs.items():
            outputs[split] = run().float()
        return {split: 1.0 + split / 100 for split in runs}

    device = "cuda" if decode.torch.cuda.is_available() else "cpu"
    row = decode.split_point(op, 64, 512, 16, Device(False, 227 * 1024, 132, (9, 0)), tensors_on=device, timer=timer)
    assert set(row["us"]) == {"1", "2"}  # 512 / 128: four K blocks, two a program at split 2
    assert row["heuristic_split"] == (2 if op == "linear" else 1) and row["covering_split"] == 2
    assert row["us"]["1"] == 1010.0
    for split, out in outputs.items():
        # bf16 output: split-K adds float32 partial sums in another order, a rounding of the output apart at most
        assert decode.torch.allclose(out, outputs[1], rtol=2e-2, atol=2e-2), split
