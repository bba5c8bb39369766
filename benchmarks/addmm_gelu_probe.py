"""Which GELU does torch._addmm_activation(bias, x, W.T, use_gelu=True) compute on this GPU (issue 16:
the cuBLASLt epilogue may stand in for a Linear + GELU only where it computes the same function)?
In float32, where the two GELUs differ by far more than the rounding: its distance to F.gelu(addmm)
with approximate="none" (erf) and with approximate="tanh". Then its time against F.gelu(F.linear)
and F.linear alone, bf16, do_bench median, same process.

  python benchmarks/addmm_gelu_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton


def distances(M: int, K: int, N: int, dtype: torch.dtype) -> dict[str, float]:
    x = torch.randn(M, K, device="cuda", dtype=dtype) * 2  # pre-activations of order several units
    w = torch.randn(N, K, device="cuda", dtype=dtype) / K**0.5
    b = torch.randn(N, device="cuda", dtype=dtype)
    fused = torch._addmm_activation(b, x, w.t(), use_gelu=True).double()
    z = torch.addmm(b.double(), x.double(), w.double().t())
    out = {}
    for name in ("none", "tanh"):
        ref = F.gelu(z, approximate=name)
        out[f"rel_error_vs_{name}"] = ((fused - ref).norm() / ref.norm()).item()
    return out


def timing(M: int, K: int, N: int) -> dict[str, float]:
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    fns = {
        "addmm_activation": lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True),
        "gelu_tanh(linear)": lambda: F.gelu(F.linear(x, w, b), approximate="tanh"),
        "gelu(linear)": lambda: F.gelu(F.linear(x, w, b)),
        "linear": lambda: F.linear(x, w, b),
    }
    return {name: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") for name, fn in fns.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for M, K, N in ((1, 512, 1024), (77, 1000, 3000), (1024, 4096, 16384)):
            rows.append(dict(kind="function", dtype=str(dtype), M=M, K=K, N=N, **distances(M, K, N, dtype)))
            print(json.dumps(rows[-1]), flush=True)
    for M, K, N in ((1, 4096, 16384), (128, 4096, 16384), (1024, 4096, 16384), (4096, 2560, 10240),
                    (16384, 4096, 16384)):
        rows.append(dict(kind="time_ms", M=M, K=K, N=N, **timing(M, K, N)))
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out, "addmm_gelu_probe.json").write_text(json.dumps(dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), indent=1))


if __name__ == "__main__":
    main()
