"""What the one-off probes share: do_bench of several calls taken in turn, round after round (a drift of
clocks during the minutes this takes falls on all of them alike), and their results file."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.testing


def rounds_us(fns: dict[str, Callable[[], object]], rounds: int, rep_ms: int = 150) -> dict[str, list[float]]:
    """µs of each call per round: the do_bench median (L2 flushed between calls), the calls taken in turn.
    A call that raises is reported and gets NaN, so one config that cannot run leaves the others' times."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            try:
                ms = triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                print(f"{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                ms = float("nan")
            samples[name].append(round(1000 * ms, 1))
    return samples


def graph_us(fn: Callable[[], object]) -> float:
    """µs per call: the do_bench median over CUDA-graph replays of one call (the pointwise probes' timer: their
    passes move hundreds of MB, so no L2 flush is needed between replays)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return 1000 * triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")


def write_results(out: str, name: str, rows: list) -> None:
    """DIR/name.json: the GPU, torch and Triton versions and the rows."""
    Path(out, f"{name}.json").write_text(json.dumps(
        {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
         "rows": rows}))
