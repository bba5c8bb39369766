"""Probe: does cuBLASLt's GELU epilogue (`library:cublaslt_gelu_tanh`) cost more per plain call when other ops
run between its calls than when it runs back to back, as the race times it (plain.py)? The thirteenth session's
decode sweep read the H100 Linear 5416->5365 M=2 at 62.2 us in its round-robin and 44.0 alone (RESULTS.md).

  python benchmarks/lt_interleave_probe.py [--out DIR]

µs per plain call (timing.plain_call_us: 200 calls back to back, 7 rounds in turn, rotated) of each library path
alone, and of pairs (one call of each, a pair per iteration), bf16, one process.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from autofuse import ops
from autofuse.timing import plain_call_us


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--shape", default="5416,5365", help="in_features,out_features")
    args = parser.parse_args()
    k, n = (int(v) for v in args.shape.split(","))
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    w = torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5
    b = torch.randn(n, device=dev, dtype=dt)
    library = ops.get("linear").library
    compiled = torch.compile(lambda x: F.gelu(F.linear(x, w, b), approximate="tanh"))
    rows = {}
    with torch.no_grad():
        for M in (1, 2):
            x = torch.randn(M, k, device=dev, dtype=dt)
            operands = {"x": x, "w": w, "b": b, "r": None}
            single = {
                "cublaslt_gelu_tanh": lambda: library["cublaslt_gelu_tanh"](operands, "gelu_tanh"),
                "eager path": lambda: library["eager"](operands, "gelu_tanh"),
                "cublas_bias_act": lambda: library["cublas_bias_act"](operands, "gelu_tanh"),
                "F.gelu(F.linear)": lambda: F.gelu(F.linear(x, w, b), approximate="tanh"),
                "torch.compile": lambda: compiled(x),
            }
            peer = single["F.gelu(F.linear)"]
            fns = dict(single)
            for name in ("cublaslt_gelu_tanh", "eager path", "cublas_bias_act", "F.gelu(F.linear)"):
                fns[f"{name} + F.gelu(F.linear)"] = lambda f=single[name]: (f(), peer())
                fns[f"{name} + torch.compile"] = lambda f=single[name]: (f(), compiled(x))
            rows[M] = plain_call_us(fns, rotate=True)
            for name, us in rows[M].items():
                print(f"M={M} {name:45s} {us:7.1f} us", flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "k": k, "n": n}
    Path(args.out, "lt_interleave_probe.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
