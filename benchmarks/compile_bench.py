"""autofuse inside torch.compile(mode="reduce-overhead") at decode size, against autofuse alone and
eager PyTorch with and without the same compile mode. (Issue 8.)

  python benchmarks/compile_bench.py --out DIR

Per call: the wall time of 200 back-to-back calls divided by 200 (one synchronisation at the end,
so whichever of host or GPU is slower sets it), median of 7 repetitions; and host time per call
(timing.host_us_per_call). gemma-2b MLP, bf16, M = 1 and 16. Beside them, for reference: the op
called from a plain function under reduce-overhead, a torch.cuda.graph replay of the module; and a
profiler table of 50 compiled reduce-overhead calls at each M (compile_profile_M*.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import triton

import autofuse
from autofuse.reference import eager_mlp
from autofuse.timing import host_us_per_call


def _per_call_us(fn, calls: int = 200, repeats: int = 7) -> float:
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def _graphed(module, x):
    """module(x) captured once in a torch.cuda.graph with x as its static input; the returned
    function copies its argument in and replays (the floor for any CUDA-graph mode)."""
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up off the capture: configs resolved, kernels compiled, workspaces made
            module(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = module(static_x)

    def replay(x):
        static_x.copy_(x)
        graph.replay()
        return static_y
    return replay


def _profile_calls(fn, x, path: Path, calls: int = 50) -> None:
    """What one compiled call does on the host and the GPU: torch.profiler's table over `calls` calls
    (e.g. whether it is one graph launch, and where the host time goes)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(x)
        torch.cuda.synchronize()
    path.write_text(f"{calls} calls\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    torch.manual_seed(0)
    mlp = autofuse.get_mlp(2048, 16384, activation="gelu_tanh", dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    w = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)

    def eager(x):
        return eager_mlp(x, *w, activation="gelu_tanh")

    def op(x):  # the custom op straight from a function over the weights, as `eager` is written
        return torch.ops.autofuse.mlp(x, w[0], None, w[1], None, w[2], None, "gelu_tanh", True)

    providers = {
        "eager": eager,
        "eager, compile reduce-overhead": torch.compile(eager, mode="reduce-overhead"),
        "autofuse": mlp,
        "autofuse, compile reduce-overhead": torch.compile(mlp, mode="reduce-overhead", fullgraph=True),
        "autofuse, compile reduce-overhead, dynamic=False": torch.compile(mlp, mode="reduce-overhead",
                                                                           fullgraph=True, dynamic=False),
        "autofuse op in a function, compile reduce-overhead": torch.compile(op, mode="reduce-overhead",
                                                                            fullgraph=True),
    }
    rows = []
    with torch.no_grad():
        for M in (1, 16):
            x = torch.randn(M, 2048, device="cuda", dtype=torch.bfloat16)
            ref = eager(x).float()
            for name, fn in [*providers.items(), ("autofuse, torch.cuda.graph replay", _graphed(mlp, x))]:
                for _ in range(5):  # compile, capture, warm up
                    out = fn(x)
                row = dict(M=M, provider=name, rel_error=((out.float() - ref).norm() / ref.norm()).item(),
                           per_call_us=_per_call_us(lambda fn=fn: fn(x)), host_us=host_us_per_call(lambda fn=fn: fn(x)))
                rows.append(row)
                print(json.dumps(row), flush=True)
            compiled = providers["autofuse, compile reduce-overhead"]
            _profile_calls(compiled, x, Path(args.out, f"compile_profile_M{M}.txt"))
    Path(args.out, "compile_bench.json").write_text(json.dumps(dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows)))


if __name__ == "__main__":
    main()
