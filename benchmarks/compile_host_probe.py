"""Probe: where the host time of one compiled call goes, autofuse's stack called from a function against the
eager function, both under torch.compile(mode="reduce-overhead") in one process (issue 15). One gemma-2b MLP
(compile_bench.py's model, 1 layer) at M=1. Per function: Python's profiler over N calls (µs per call of each
function's own time, with its calls per compiled call) and torch.profiler's CPU events (self time per call).

  python benchmarks/compile_host_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
from pathlib import Path

import torch

from autofuse.timing import plain_call_us

sys.path.insert(0, str(Path(__file__).parent))
from compile_bench import D_MODEL, _in_function, _models  # noqa: E402


def _python_profile(fn, calls: int, top: int) -> list:
    """[(function, calls per compiled call, own µs per compiled call)] of the `top` costliest functions."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profile).stats
    rows = [(f"{Path(file).name}:{line}:{name}", n / calls, own / calls * 1e6)
            for (file, line, name), (_, n, own, _, _) in stats.items()]
    rows.sort(key=lambda r: -r[2])
    return [(name, round(n, 2), round(us, 3)) for name, n, us in rows[:top]]


def _events(fn, calls: int, top: int) -> list:
    """[(event, calls per compiled call, self CPU µs per compiled call)] under torch.profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.count / calls, e.self_cpu_time_total / calls) for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[2])
    return [(name, round(n, 2), round(us, 3)) for name, n, us in rows[:top]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--top", type=int, default=45)
    args = parser.parse_args()
    torch.manual_seed(0)
    stack, eager = _models(1)
    fns = {"eager function": torch.compile(eager, mode="reduce-overhead"),
           "autofuse stack called from a function": torch.compile(_in_function(stack), mode="reduce-overhead")}
    x = torch.randn(1, D_MODEL, device="cuda", dtype=torch.bfloat16)
    result = {}
    with torch.no_grad():
        for fn in fns.values():
            for _ in range(5):  # compile, capture, warm up
                fn(x)
        calls = {name: (lambda fn=fn: fn(x)) for name, fn in fns.items()}
        result["per_call_us"] = plain_call_us(calls, rounds=15, warmup=0)
        for name, call in calls.items():
            result[name] = {"python": _python_profile(call, args.calls, args.top),
                            "events": _events(call, args.calls // 4, args.top)}
    print(json.dumps(result["per_call_us"]))
    for name in fns:
        for part in ("python", "events"):
            print(f"== {name}: {part}")
            for row in result[name][part]:
                print(f"  {row[2]:8.3f} us  {row[1]:6.2f}x  {row[0]}")
    Path(args.out, "compile_host_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
