"""Which kernels one call runs, and for how long: torch.profiler's CUDA time per kernel of an autofuse MLP
(get_mlp, empty cache unless AUTOFUSE_CACHE_DIR holds one) beside eager PyTorch's, at given points.

  python benchmarks/kernel_profile.py --out DIR --point 6475,21061,silu,128 [--point ...]

Per point: the module's choices (config_for), then per provider the kernels of 20 calls (after warm-up
and the first-use checks), with their mean CUDA time per call, as JSON lines and in kernel_profile.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import autofuse

ACT = {"gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu, "gelu": F.gelu}
CALLS = 20


def _profiled(fn, calls: int, activities: list, **options):
    """torch.profiler's record of `calls` calls of `fn`, after three unrecorded ones (compiles, first-use
    checks and allocations stay out of it)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=activities, **options) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def _kernels(fn, calls: int = CALLS, counts: bool = False) -> dict:
    """Kernel name -> mean CUDA µs per call of `fn` over `calls` calls after warm-up (with `counts`, each
    name ends in " xN": how many times one call launches it)."""
    rows = {}
    for event in _profiled(fn, calls, [ProfilerActivity.CUDA]).key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if us > 0 and event.count >= calls:
            name = f"{event.key[:80]} x{event.count // calls}" if counts else event.key[:90]
            rows[name] = round(us / calls, 2)
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def _ops(fn, calls: int = CALLS) -> dict:
    """"aten op [input shapes]" -> mean device µs per call of `fn`: the same time as _kernels', attributed to
    the PyTorch ops that launched it (with their shapes), so that of several cuBLAS GEMMs of one name one can
    tell which is which. Ops that launch nothing (device time 0) are left out."""
    rows = {}
    prof = _profiled(fn, calls, [ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True)
    for event in prof.key_averages(group_by_input_shape=True):
        us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if us > 0 and event.key.startswith("aten::") and event.count >= calls:
            rows[f"{event.key} {event.input_shapes} x{event.count // calls}"[:160]] = round(us / calls, 1)
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--point", action="append", required=True, help="d_model,d_ff,activation,M")
    args = parser.parse_args()
    results = []
    for text in args.point:
        d, f, act, M = text.split(",")
        d, f, M = int(d), int(f), int(M)
        torch.manual_seed(0)
        module = autofuse.get_mlp(d, f, activation=act, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
        wg, wu, wd = module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight
        with torch.no_grad():
            module(x)  # first use: the checks
            row = {"point": [d, f, act, M],
                   "choices": {op: str(c) for op, c in module.config_for(M).items()},
                   "autofuse_us": _kernels(lambda: module(x)),
                   "eager_us": _kernels(lambda: F.linear(ACT[act](F.linear(x, wg)) * F.linear(x, wu), wd))}
        results.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out, "kernel_profile.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                                                 "rows": results}, indent=1))


if __name__ == "__main__":
    main()
