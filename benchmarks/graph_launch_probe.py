"""Probe: the host cost of one CUDA-graph replay, autofuse's stack against the eager function (issue 15). One
gemma-2b MLP (compile_bench.py's model, 1 layer) at M=1 and a tiny one, each captured (timing.captured); per
graph the wall time of the replay() call alone with the GPU idle before it (synchronised, median of N), and
the same queued back to back.

  python benchmarks/graph_launch_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from autofuse.timing import captured

sys.path.insert(0, str(Path(__file__).parent))
from compile_bench import _models  # noqa: E402


def _capture(fn, x) -> tuple:
    """(fn(x) captured in a CUDA graph over a static copy of x (timing.captured: warmed up, replayed), that copy:
    the graph reads its address, so the caller keeps it alive while it replays)."""
    static = x.clone()
    return captured(lambda: fn(static), 1), static


def _replay_us(graph, calls: int) -> dict:
    idle = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        idle.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    queued = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(50):
            graph.replay()
        queued.append((time.perf_counter() - start) * 1e6 / 50)
        torch.cuda.synchronize()
    return {"idle_replay_us": statistics.median(idle), "queued_replay_us": statistics.median(queued)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args()
    torch.manual_seed(0)
    result = {}
    with torch.no_grad():
        for label, (d, f) in {"gemma-2b": (2048, 16384), "tiny": (64, 128)}.items():
            autofused, eager = _models(1, d_model=d, d_ff=f)
            x = torch.randn(1, d, device="cuda", dtype=torch.bfloat16)
            captures = {"eager": _capture(eager, x), "autofuse": _capture(autofused, x)}
            graphs = {name: graph for name, (graph, _) in captures.items()}
            for turn in range(3):  # in turn: neither always first
                for name, graph in (graphs.items() if turn % 2 == 0 else reversed(graphs.items())):
                    row = result.setdefault(f"{label} {name}", {"idle_replay_us": [], "queued_replay_us": []})
                    for key, value in _replay_us(graph, args.calls).items():
                        row[key].append(round(value, 2))
    for name, row in result.items():
        print(f"{name:20s} idle {row['idle_replay_us']} queued {row['queued_replay_us']}")
    Path(args.out, "graph_launch_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
