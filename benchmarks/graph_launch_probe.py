"""Probe: the host cost of one CUDA-graph replay, autofuse's stack against the eager function (issue 15). One
gemma-2b MLP (compile_bench.py's model, 1 layer) at M=1 and a tiny one, each captured with torch.cuda.graph; per
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

import autofuse
from autofuse.reference import eager_mlp

sys.path.insert(0, str(Path(__file__).parent))
from compile_bench import ACTIVATION  # noqa: E402


def _model(d: int, f: int):
    mlp = autofuse.get_mlp(d, f, activation=ACTIVATION, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    w = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    return (lambda x: x + mlp(x)), (lambda x: x + eager_mlp(x, *w, activation=ACTIVATION))


def _capture(fn, x):
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(static)
    return graph


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
            autofused, eager = _model(d, f)
            x = torch.randn(1, d, device="cuda", dtype=torch.bfloat16)
            graphs = {"eager": _capture(eager, x), "autofuse": _capture(autofused, x)}
            for name, graph in graphs.items():
                graph.replay()
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
