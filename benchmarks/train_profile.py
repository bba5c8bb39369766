"""Which kernels one training step (forward + backward) of a gated MLP runs, and for how long, per provider:
torch.profiler's CUDA time per kernel, mean over STEPS steps after warm-up (autofuse's shipped or tuned
configs, else its first-use checks, run during warm-up), and the step's wall time (CUDA events, no
profiler: `wall_us`; what exceeds the kernels' sum is time between kernels). Where train_bench.py says a
step is slower, this says in which kernel (`kernels`), and through which PyTorch op at which shapes (`ops`: tells apart
the cuBLAS GEMMs that share a kernel name).

  python benchmarks/train_profile.py --out DIR [--point gemma-7b,16384 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_bench  # noqa: E402 - the providers and shapes of the step benchmark
from kernel_profile import _kernels, _ops  # noqa: E402

import autofuse  # noqa: E402

STEPS = 10


def _wall_us(step, repeats: int = 5) -> float:
    """µs per step from CUDA events around STEPS back-to-back steps (no profiler), the median of `repeats`:
    beside the kernels' sum, the time the GPU spends between kernels."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(STEPS):
            step()
        end.record()
        torch.cuda.synchronize()
        times.append(1000 * start.elapsed_time(end) / STEPS)
    return sorted(times)[len(times) // 2]


def steps(points: list[str] | None):
    """Yields (shape name, M, provider, step) for train_bench's shapes (those of `points`, "NAME,M", where
    given) and the providers gemm-only, torch.compile, Liger and autofuse: `step` runs one forward + backward
    and drops the gradients, on the module's training layout (plain parameters), as every provider sees it."""
    wanted = {tuple(p.split(",")) for p in points} if points else None
    for name, d, f, activation, M in train_bench.SHAPES:
        if wanted is not None and (name, str(M)) not in wanted:
            continue
        torch._dynamo.reset()
        torch.manual_seed(0)
        module = autofuse.get_mlp(d, f, activation=activation, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
        module(x).backward(dy)  # the training layout (plain parameters) before any provider sees them
        params = [module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight]
        providers = {
            "gemm-only": train_bench._gemm_only,
            "torch.compile": torch.compile(lambda x, wg, wu, wd, a=activation: train_bench._eager(x, wg, wu, wd, a)),
            "liger": lambda x, wg, wu, wd, a=activation: train_bench._liger(x, wg, wu, wd, a),
            "autofuse": lambda x, wg, wu, wd, m=module: m(x),
        }
        for provider, fn in providers.items():
            def step(fn=fn):
                fn(x, *params).backward(dy)
                for p in params:
                    p.grad = None
                x.grad = None

            yield name, M, provider, step


def run(script: str, measure) -> None:
    """The main of this script and of train_gaps.py: for each (shape, M, provider) step of `--point`
    (default: every shape and M of train_bench.SHAPES), a row of `measure(step)`'s fields printed as JSON,
    and all rows written to `--out`/<script>.json with the GPU and torch version."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--point", action="append", default=None, help="NAME,M of train_bench.SHAPES")
    args = parser.parse_args()
    rows = []
    for name, M, provider, step in steps(args.point):
        row = dict(shape=name, M=M, provider=provider, **measure(step))
        print(json.dumps(row), flush=True)
        rows.append(row)
    Path(args.out, f"{script}.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                                             "torch": torch.__version__, "rows": rows}))


def _profile_row(step) -> dict:
    kernels = _kernels(step, calls=STEPS, counts=True)
    return dict(total_us=round(sum(kernels.values()), 1), wall_us=round(_wall_us(step), 1), kernels=kernels,
                ops=_ops(step, calls=STEPS))


def main() -> None:
    run("train_profile", _profile_row)


if __name__ == "__main__":
    main()
