"""The training forward's down projection: the shipped record's Triton kernel against cuBLAS, side by side, at
train_bench's M = 16384 points (issue 16: on the H100 the forward with the tuned kernel ran slower than
torch.compile's, although the record says the kernel beat cuBLAS by 3-10%).

  python benchmarks/down_probe.py --out DIR

bf16, do_bench medians (L2 flushed), the two in turn for --rounds rounds; each round's µs is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F
from in_turn import rounds_us, write_results

from autofuse.configs import KernelConfig
from autofuse.ops.linear import linear

POINTS = [("gemma-7b", 3072, 24576, 16384), ("llama-3-8b", 4096, 14336, 16384)]
CONFIG = KernelConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rows = []
    for name, d, f, M in POINTS:
        torch.manual_seed(0)
        h = torch.randn(M, f, device="cuda", dtype=torch.bfloat16)
        wd = torch.randn(d, f, device="cuda", dtype=torch.bfloat16) / f**0.5
        y = torch.empty(M, d, device="cuda", dtype=torch.bfloat16)
        fns = {"cuBLAS": lambda: torch.mm(h, wd.t(), out=y),
               f"triton {CONFIG.short()}": lambda: linear(h, wd, None, None, "none", CONFIG, out=y)}
        samples = rounds_us(fns, args.rounds, rep_ms=200)
        row = dict(shape=name, M=M, d=d, f=f, rounds_us=samples,
                   median_us={k: statistics.median(v) for k, v in samples.items()})
        err = (linear(h, wd, None, None, "none", CONFIG).float() - F.linear(h.float(), wd.float())).norm()
        row["rel_error"] = (err / F.linear(h.float(), wd.float()).norm()).item()
        print(json.dumps(row), flush=True)
        rows.append(row)
    write_results(args.out, "down_probe", rows)


if __name__ == "__main__":
    main()
