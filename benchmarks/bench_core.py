"""First honest timings of get_mlp (heuristic configs) against eager PyTorch, on a GPU.

    python benchmarks/bench_core.py [--out DIR]

For d=2048, f=16384 (gemma-2b's MLP) at M in {1, 16, 128, 1024, 4096, 16384}, bf16, and a
Linear 4096->16384 + bias + GELU: every provider is checked against a float64 reference first,
then timed side by side in this process:
  - GPU time: triton.testing.do_bench median (L2 flushed between runs);
  - at M <= 128 also host time per call (un-graphed) and CUDA-graph replay time, since do_bench's
    cache flush hides launch overhead;
  - the roofline: max(FLOPs / measured bf16 cuBLAS rate, bytes / measured copy bandwidth).
Writes bench_core.json (all rows, versions) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import autofuse
from autofuse.reference import eager_linear, eager_mlp, linear_reference, mlp_reference
from autofuse.timing import gpu_median_ms, graph_replay_us, host_us_per_call

TOKENS = (1, 16, 128, 1024, 4096, 16384)
SMALL_M = 128


def measure_ceilings() -> dict:
    """Copy bandwidth (read + write bytes) and bf16 dense GEMM rate, measured here and now."""
    n = 1 << 30  # 1 GiB each way
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    copy_ms = gpu_median_ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_ms = gpu_median_ms(lambda: a @ b)
    return {"copy_GBps": 2 * n / copy_ms / 1e6, "bf16_TFLOPs": 2 * 8192**3 / mm_ms / 1e9}


def rel_error(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def bench_point(name, M, fused, eager, reference, flops, min_bytes, ceilings) -> dict:
    with torch.no_grad():
        ref = reference()
        errors = {"autofuse": rel_error(fused(), ref), "eager": rel_error(eager(), ref)}
        for provider, err in errors.items():
            if not err < 2e-2:  # NaN fails too
                raise SystemExit(f"{name} M={M}: {provider} is wrong (relative error {err})")
        row = {"shape": name, "M": M, "flops": flops, "min_bytes": min_bytes, "rel_error": errors}
        roofline_ms = max(flops / (ceilings["bf16_TFLOPs"] * 1e9), min_bytes / (ceilings["copy_GBps"] * 1e6))
        row["roofline_ms"] = roofline_ms
        for provider, fn in (("autofuse", fused), ("eager", eager)):
            row[f"{provider}_ms"] = gpu_median_ms(fn)
            if M <= SMALL_M:
                row[f"{provider}_host_us"] = host_us_per_call(fn)
                row[f"{provider}_graph_us"] = graph_replay_us(fn)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    ceilings = measure_ceilings()
    meta = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(), "autofuse": autofuse.__version__,
        **ceilings,
    }
    print(json.dumps(meta))
    rows = []
    d, f = 2048, 16384
    mlp = autofuse.get_mlp(d, f, activation="gelu_tanh", dtype=dtype, device="cuda")
    g, u, dn = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    for M in TOKENS:
        x = torch.randn(M, d, dtype=dtype, device="cuda")
        row = bench_point(
            "mlp 2048/16384 gelu_tanh", M,
            fused=lambda: mlp(x),
            eager=lambda: eager_mlp(x, g, u, dn, activation="gelu_tanh"),
            reference=lambda: mlp_reference(x, g, u, dn, activation="gelu_tanh", hidden_dtype=dtype),
            flops=2 * M * d * f * 3, min_bytes=2 * (3 * d * f + 2 * M * d), ceilings=ceilings,
        )
        row["configs"] = {k: v if isinstance(v, str) else v.to_dict() for k, v in mlp.config_for(M).items()}
        row["sources"] = mlp.config_sources(M)
        rows.append(row)
        print(json.dumps(row), flush=True)
    lin = autofuse.get_linear(4096, 16384, bias=True, activation="gelu", dtype=dtype, device="cuda")
    for M in (1, 16, 1024, 16384):
        x = torch.randn(M, 4096, dtype=dtype, device="cuda")
        row = bench_point(
            "linear 4096->16384 bias gelu", M,
            fused=lambda: lin(x),
            eager=lambda: eager_linear(x, lin.weight, lin.bias, None, "gelu"),
            reference=lambda: linear_reference(x, lin.weight, lin.bias, None, "gelu"),
            flops=2 * M * 4096 * 16384, min_bytes=2 * (4096 * 16384 + 16384 + M * (4096 + 16384)), ceilings=ceilings,
        )
        row["configs"] = {k: v if isinstance(v, str) else v.to_dict() for k, v in lin.config_for(M).items()}
        row["sources"] = lin.config_sources(M)
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_core.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    print(f"\n{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}; "
          f"measured copy {ceilings['copy_GBps']:.0f} GB/s, bf16 GEMM {ceilings['bf16_TFLOPs']:.0f} TFLOP/s\n")
    print("| shape | M | roofline ms | eager ms | autofuse ms | eager/autofuse | autofuse/roofline "
          "| eager host us | autofuse host us | eager graph us | autofuse graph us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        small = [f"{r[k]:.1f}" if k in r else "" for k in
                 ("eager_host_us", "autofuse_host_us", "eager_graph_us", "autofuse_graph_us")]
        print(f"| {r['shape']} | {r['M']} | {r['roofline_ms']:.4f} | {r['eager_ms']:.4f} | {r['autofuse_ms']:.4f} "
              f"| {r['eager_ms'] / r['autofuse_ms']:.2f} | {r['autofuse_ms'] / r['roofline_ms']:.2f} | "
              + " | ".join(small) + " |")


if __name__ == "__main__":
    main()
