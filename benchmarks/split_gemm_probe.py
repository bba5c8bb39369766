"""The training step's GEMMs over the gate and up halves: one GEMM over the stacked [Wg; Wu] (one [M, 2F]
buffer for G | U and dG | dU) against two GEMMs over separate G and U buffers (what lets a backward free dG
before its last GEMM, as torch.compile's does). Issue 16's training peak lead.

  python benchmarks/split_gemm_probe.py --out DIR

At train_bench's shapes (bf16), do_bench medians (L2 flushed between calls), the variants taken in turn for
--rounds rounds, the median round reported, µs:
- forward: G | U = x [Wg; Wu]^T (one) | G = x Wg^T, U = x Wu^T (two);
- dX: dGU [Wg; Wu] (one) | dG Wg, then += dU Wu (two: mm + addmm_);
- dW: dGU^T x (one) | dG^T x, dU^T x (two).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from in_turn import rounds_us, write_results

SHAPES = [("gemma-7b", 3072, 24576, 4096), ("gemma-7b", 3072, 24576, 16384),
          ("llama-3-8b", 4096, 14336, 4096), ("llama-3-8b", 4096, 14336, 16384)]


def _variants(d: int, f: int, M: int) -> dict:
    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    x, w_gu = rand(M, d), rand(2 * f, d) / d**0.5
    wg, wu = w_gu[:f], w_gu[f:]
    gu = rand(M, 2 * f)
    g, u = rand(M, f), rand(M, f)
    dx = torch.empty(M, d, device="cuda", dtype=torch.bfloat16)
    return {
        "forward one": lambda: torch.mm(x, w_gu.t(), out=gu),
        "forward two": lambda: (torch.mm(x, wg.t(), out=g), torch.mm(x, wu.t(), out=u)),
        "dX one": lambda: torch.mm(gu, w_gu, out=dx),
        "dX two": lambda: (torch.mm(g, wg, out=dx), dx.addmm_(u, wu)),
        "dW one": lambda: gu.t() @ x,
        "dW two": lambda: (g.t() @ x, u.t() @ x),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for name, d, f, M in SHAPES:
        fns = _variants(d, f, M)
        samples = rounds_us(fns, args.rounds)
        row = dict(shape=name, d=d, f=f, M=M, us={k: statistics.median(v) for k, v in samples.items()})
        one = sum(row["us"][f"{p} one"] for p in ("forward", "dX", "dW"))
        two = sum(row["us"][f"{p} two"] for p in ("forward", "dX", "dW"))
        row.update(one_total_us=round(one, 1), two_total_us=round(two, 1), two_over_one=round(two / one, 4))
        print(json.dumps(row), flush=True)
        rows.append(row)
    write_results(args.out, "split_gemm_probe", rows)


if __name__ == "__main__":
    main()
