"""Why a gated MLP whose d_ff is not a multiple of 8 is slow at small M (issue 16, item 3).

  python benchmarks/unaligned_probe.py --out DIR

Hypothesis: the down projection's weight [d_model, d_ff] then has rows that are not 16-byte aligned,
so Triton cannot prove its loads aligned (it specialises on strides divisible by 16), loads element
by element, and at decode sizes reading the weight is all the kernel does. Test: the same linear
kernel and config on W [2048, F] for F = 8192 (aligned), 8191 (unaligned rows) and 8191 stored with
a row stride of 8192 (a view of padded storage: the same values, aligned rows); and the gated
up-projection with d_model 2047 against 2047 in padded storage. do_bench medians, bf16, M = 1 and 77.

Then the fix (autofuse/layout.py): whole gated MLPs 2048 -> F at the heuristic's configs (tuned=False, no
first-use check, so the Triton kernels run whatever their speed): F = 8192, and F = 8191 as get_mlp lays it
out (padded storage, run at 8256) and on plain parameters (the layout given up), beside eager PyTorch
on plain 8191 parameters.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import triton

import autofuse
from autofuse import ops
from autofuse.ops.gated_up import gated_up
from autofuse.ops.linear import linear
from autofuse.reference import eager_mlp
from autofuse.resolve import heuristic_for


def _weight(rows: int, cols: int, padded_cols: int | None = None) -> torch.Tensor:
    storage = torch.randn(rows, padded_cols or cols, device="cuda", dtype=torch.bfloat16) / cols**0.5
    return storage[:, :cols]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    rows = []
    device = torch.device("cuda")
    for M in (1, 77):
        for label, F_, padded in (("aligned 8192", 8192, None), ("unaligned 8191", 8191, None),
                                  ("8191 in rows of 8192", 8191, 8192)):
            w = _weight(2048, F_, padded)
            h = _weight(M, F_, padded)
            config = heuristic_for(ops.get("down"), M, 2048, F_, torch.bfloat16, device)
            ms = triton.testing.do_bench(lambda: linear(h, w, None, None, "none", config), return_mode="median")
            cublas = triton.testing.do_bench(lambda: torch.nn.functional.linear(h, w), return_mode="median")
            rows.append(dict(op="down", M=M, weight=label, config=config.short(), kernel_us=ms * 1e3,
                             cublas_us=cublas * 1e3))
            print(json.dumps(rows[-1]), flush=True)
        for label, D, padded in (("aligned 2048", 2048, None), ("unaligned 2047", 2047, None),
                                 ("2047 in rows of 2048", 2047, 2048)):
            wg, wu = _weight(8192, D, padded), _weight(8192, D, padded)
            x = _weight(M, D, padded)
            config = heuristic_for(ops.get("gated_up"), M, 8192, D, torch.bfloat16, device)
            ms = triton.testing.do_bench(lambda: gated_up(x, wg, wu, None, None, "silu", config),
                                         return_mode="median")
            rows.append(dict(op="gated_up", M=M, weight=label, config=config.short(), kernel_us=ms * 1e3))
            print(json.dumps(rows[-1]), flush=True)
    for M in (1, 77):
        for label, F_ in (("mlp 2048->8192", 8192), ("mlp 2048->8191 padded", 8191),
                          ("mlp 2048->8191 plain", 8191)):
            module = autofuse.get_mlp(2048, F_, activation="silu", tuned=False)
            if label.endswith("plain"):
                with torch.no_grad():
                    for p in module.parameters():
                        p.data = p.detach().contiguous()
            x = torch.randn(M, 2048, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                module(x)
                ms = triton.testing.do_bench(lambda: module(x), return_mode="median")
                params = [p.detach().contiguous() for p in (module.gate_proj.weight, module.up_proj.weight,
                                                            module.down_proj.weight)]
                eager = triton.testing.do_bench(lambda: eager_mlp(x, *params, activation="silu"),
                                                return_mode="median")
            rows.append(dict(op="mlp", M=M, weight=label, d_ff_run=module.d_ff_run, module_us=ms * 1e3,
                             eager_plain_us=eager * 1e3, configs={k: str(v) for k, v in module.config_for(M).items()}))
            print(json.dumps(rows[-1]), flush=True)
    Path(args.out, "unaligned_probe.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(),
                                                                      rows=rows), indent=1))


if __name__ == "__main__":
    main()
