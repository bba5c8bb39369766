"""Where a training step's peak memory is reached, per provider (issue 16's "peak <= theirs").

  python benchmarks/train_memory.py --out DIR [--point llama-3-8b,4096]

For each provider of train_bench.py at one point: one step to warm up, then one step under PyTorch's memory
history (torch.cuda.memory._record_memory_history). From the trace, the moment the allocated bytes peak,
the allocation that reached it (its Python frames in this repository and autofuse), and the blocks alive
then (size and the frame that allocated each). Prints one JSON line per provider; writes train_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import autofuse
from benchmarks.train_bench import SHAPES, _eager, _gemm_only, autofuse_provider

_OURS = ("autofuse/", "benchmarks/")


def _where(frames: list) -> str:
    for f in frames:
        name = f.get("filename", "")
        if any(part in name for part in _OURS) and "train_memory" not in name:
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
    return frames[0].get("name", "?") if frames else "?"


def _peak_of(step) -> dict:
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = [e for trace in snapshot["device_traces"] for e in trace]
    live, total, peak, at_peak = {}, 0, 0, None
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames", [])))
            total += e["size"]
            if total > peak:
                peak, at_peak = total, (dict(live), _where(e.get("frames", [])))
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])[0]
    blocks, reached_by = at_peak if at_peak else ({}, "")
    alive = sorted(((size / 2**20, where) for size, where in blocks.values()), reverse=True)
    return dict(above_start_mib=round(peak / 2**20, 1), base_mib=round(base / 2**20, 1), reached_by=reached_by,
                alive_mib=[(round(s, 1), w) for s, w in alive[:12]])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--point", default="llama-3-8b,4096")
    args = parser.parse_args()
    name, M = args.point.split(",")
    _, d, f, activation, _ = next(s for s in SHAPES if s[0] == name)
    torch.manual_seed(0)
    module = autofuse.get_mlp(d, f, activation=activation, dtype=torch.bfloat16, device="cuda")
    params = [module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight]
    x = torch.randn(int(M), d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(int(M), d, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(lambda x, wg, wu, wd: _eager(x, wg, wu, wd, activation))

    providers = {"gemm-only": _gemm_only, "torch.compile": compiled, "autofuse": autofuse_provider(module, True),
                 "autofuse save_hidden=False": autofuse_provider(module, False)}
    rows = []
    for provider, fn in providers.items():
        for p in params:
            p.grad = None
        x.grad = None
        row = dict(shape=name, M=int(M), provider=provider, **_peak_of(lambda fn=fn: fn(x, *params).backward(dy)))
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out, "train_memory.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}))


if __name__ == "__main__":
    main()
