"""Issue 17's first measurement: op gated_pairs (one GEMM over interleaved gate/up weights, act(G) * U in
the epilogue) beside cuBLAS's plain GEMM of the same size, the library paths and op gated_up.

  python benchmarks/pairs_probe.py --out DIR [--tokens 1024,2048,4096,8192,16384]

Per shape and M (bf16, do_bench medians with L2 flushed, same process): cuBLAS's [M, d] x [d, 2F] GEMM
alone (the mainloop's ceiling: what one GEMM over the stacked weight costs, nothing after it), the
library paths (one cuBLAS GEMM over the interleaved weight + PyTorch's act * mul; cuBLAS for G and U +
autofuse's gated_act pass; eager's two GEMMs + two pointwise ops), op gated_up at its heuristic config,
and op gated_pairs at a few configs around the 128x256x64 tile that reached cuBLAS's speed in a plain
Triton GEMM (issue 17's table). TFLOP/s count the GEMM's 2 * M * 2F * d. Every kernel output is checked
against the float64 reference first (rel_error).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import triton

from autofuse import ops
from autofuse.configs import KernelConfig
from autofuse.ops.gated_pairs import gate_and_up, gated_pairs, interleave
from autofuse.ops.gated_up import gated_up
from autofuse.reference import gated_reference, relative_error
from autofuse.resolve import heuristic_for

# gemma-7b's gate/up (public), and two shapes of the seeded held-out draw (benchmarks/never_slower.py).
SHAPES = ((3072, 24576, "gelu_tanh"), (3456, 12736, "silu"), (6912, 15360, "gelu_tanh"))
PAIRS_CONFIGS = (
    KernelConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=True),
    KernelConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=4, tma=True),
    KernelConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4, tma=True),
    KernelConfig(128, 128, 64, group_m=8, num_warps=4, num_stages=4, tma=True),
    KernelConfig(256, 128, 64, group_m=8, num_warps=8, num_stages=3, tma=True),
    KernelConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3),
)


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tokens", default="1024,2048,4096,8192,16384")
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="the first N shapes only")
    parser.add_argument("--configs", type=int, default=len(PAIRS_CONFIGS), help="the first N gated_pairs configs only")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    gated_act_library = ops.get("gated_up").library["cublas_gated_act"]
    eager_library = ops.get("gated_up").library["eager"]
    with torch.no_grad():
        for d, f, act in SHAPES[:args.shapes]:
            wg, wu = (torch.randn(f, d, device="cuda", dtype=torch.bfloat16) / d**0.5 for _ in range(2))
            w = interleave(wg, wu)
            wg_view, wu_view = gate_and_up(w)
            for M in map(int, args.tokens.split(",")):
                x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
                flops = 2 * M * 2 * f * d
                ref = gated_reference(x[:256], wg, wu, None, None, act)  # the first rows: float64 is slow
                row = dict(d_model=d, d_ff=f, activation=act, M=M, us={}, tflops={}, rel_error={})

                def record(name, fn, out=None):
                    ms = _ms(fn)
                    row["us"][name], row["tflops"][name] = ms * 1e3, flops / ms / 1e9
                    if out is not None:
                        row["rel_error"][name] = relative_error(out[:256], ref)

                record("cuBLAS GEMM [M, d] x [d, 2F] alone", lambda: torch.mm(x, w.t()))
                operands = {"x": x, "wg": wg, "wu": wu, "bg": None, "bu": None}
                record("library: cuBLAS G, U + gated_act pass", lambda: gated_act_library(operands, act),
                       gated_act_library(operands, act))
                record("library: eager", lambda: eager_library(operands, act), eager_library(operands, act))
                pairs_ops = {"x": x, "w": w, "b": None}
                cublas_pairs = ops.get("gated_pairs").library["cublas_pairs"]
                record("library: cuBLAS over interleaved W + act * mul", lambda: cublas_pairs(pairs_ops, act),
                       cublas_pairs(pairs_ops, act))
                up = heuristic_for(ops.get("gated_up"), M, f, d, x.dtype, x.device)
                record(f"gated_up {up.short()}", lambda: gated_up(x, wg, wu, None, None, act, up),
                       gated_up(x, wg, wu, None, None, act, up))
                record(f"gated_up {up.short()} on the interleaved views",
                       lambda: gated_up(x, wg_view, wu_view, None, None, act, up))
                for config in PAIRS_CONFIGS[:args.configs]:
                    try:
                        out = gated_pairs(x, w, None, act, config)
                        record(f"gated_pairs {config.short()}", lambda c=config: gated_pairs(x, w, None, act, c), out)
                    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: recorded, not fatal
                        row["us"][f"gated_pairs {config.short()}"] = f"{type(e).__name__}: {e}"[:200]
                rows.append(row)
                best = min((k for k, v in row["us"].items() if isinstance(v, float) and k.startswith("gated_pairs")),
                           key=row["us"].get, default=None)
                print(json.dumps(dict(shape=f"{d}->{f} {act}", M=M, gemm_tflops=round(
                    row["tflops"]["cuBLAS GEMM [M, d] x [d, 2F] alone"], 1), best_pairs=best,
                    best_pairs_tflops=round(row["tflops"][best], 1) if best else None,
                    library_us={k: round(v, 1) for k, v in row["us"].items() if k.startswith("library")},
                    best_pairs_us=round(row["us"][best], 1) if best else None)), flush=True)
                Path(args.out, "pairs_probe.json").write_text(json.dumps(dict(
                    gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    rows=rows), indent=1))


if __name__ == "__main__":
    main()
