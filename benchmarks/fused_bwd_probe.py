"""Is the fused backward kernel (op gated_bwd: dH = dY Wd as a persistent TMA GEMM whose epilogue writes dG, dU
and H) faster than cuBLAS dH + one pointwise pass at the training shapes? Issue 16/17's training lead: a fused
epilogue saves the [M, F] dH's write and read, if its mainloop runs near cuBLAS's speed.

  python benchmarks/fused_bwd_probe.py --out DIR

bf16, do_bench medians (L2 flushed), providers in turn for --rounds rounds, the median round, µs:
- cuBLAS dH alone (the GEMM's floor); cuBLAS dH + op gated_grad (dG, dU, H: the lean path's library
  choice); cuBLAS dH + op gated_dgu (dG, dU: the path that keeps H);
- gated_bwd's TMA kernel at several configs (dG, dU and H from the epilogue), with its TFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from in_turn import rounds_us, write_results

from autofuse.configs import KernelConfig
from autofuse.ops.gated_bwd import gated_backward
from autofuse.ops.gated_grad import gated_gradient, gated_gradient_kept

SHAPES = [("gemma-7b", 3072, 24576, "gelu_tanh", 16384), ("llama-3-8b", 4096, 14336, "silu", 16384),
          ("llama-3-8b", 4096, 14336, "silu", 4096)]
CONFIGS = [KernelConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=True),
           KernelConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4, tma=True),
           KernelConfig(128, 256, 64, group_m=1, num_warps=8, num_stages=3, tma=True),
           KernelConfig(128, 128, 64, group_m=8, num_warps=4, num_stages=4, tma=True)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for name, d, f, activation, M in SHAPES:
        torch.manual_seed(0)
        dy = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
        wd = torch.randn(d, f, device="cuda", dtype=torch.bfloat16) / f**0.5
        gu = torch.randn(M, 2 * f, device="cuda", dtype=torch.bfloat16)
        g, u = gu[:, :f].contiguous(), gu[:, f:].contiguous()
        out_gu, out_h = torch.empty_like(gu), torch.empty(M, f, device="cuda", dtype=torch.bfloat16)
        dg, du = torch.empty_like(g), torch.empty_like(u)
        fns = {
            "cuBLAS dH": lambda: dy @ wd,
            "cuBLAS dH + gated_grad": lambda: gated_gradient((dh := dy @ wd), g, u, activation, out=(dg, du, dh)),
            "cuBLAS dH + gated_dgu": lambda: gated_gradient_kept(dy @ wd, g, u, activation, out=(dg, du)),
        }
        for c in CONFIGS:
            fns[f"fused {c.short()}"] = lambda c=c: gated_backward(dy, gu, wd, activation, c, out=(out_gu, out_h))
        us = {k: statistics.median(v) for k, v in rounds_us(fns, args.rounds).items()}
        flop = 2 * M * d * f
        tflops = {k: round(flop / (v * 1e-6) / 1e12, 1) for k, v in us.items()}
        row = dict(shape=name, M=M, d=d, f=f, us=us, tflops=tflops)
        print(json.dumps(row), flush=True)
        rows.append(row)
    write_results(args.out, "fused_bwd_probe", rows)


if __name__ == "__main__":
    main()
