"""Markdown table and geometric means from an `autofuse bench` JSON file (for RESULTS.md).

  python benchmarks/bench_table.py results/....json

GPU time per provider is the CUDA-graph replay time where the bench measured one (M <= 128 or
under 0.5 ms), else the do_bench median, exactly as the bench's own table ranks them.
"""

from __future__ import annotations

import json
import math
import sys

PEERS = ("eager", "eager-merged", "torch.compile", "liger")


def _us(row: dict) -> float:
    return (row["graph_us"] if row.get("graph_us") else row["ms"] * 1e3)


def main(path: str) -> None:
    data = json.load(open(path))
    cases: dict[tuple, dict] = {}
    for row in data["rows"]:
        if row["status"] == "ok":
            cases.setdefault((row["shape"], row["M"]), {})[row["provider"]] = row
    print("| shape | M | roofline µs | best peer | peer µs | eager µs | autofuse-tuned µs | tuned / roofline | "
          "best peer / tuned | heuristic µs | tuned host µs | eager host µs |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    small, large = [], []
    for (shape, M), rows in cases.items():
        tuned = rows["autofuse-tuned"]
        peers = {p: rows[p] for p in PEERS if p in rows}
        best = min(peers, key=lambda p: _us(peers[p]))
        ratio = _us(peers[best]) / _us(tuned)
        (small if M <= 128 else large).append(ratio)
        roof = tuned["roofline_ms"] * 1e3
        heur = rows.get("autofuse-heuristic")

        def host(r):
            return f"{r['host_us']:.0f}" if r and r.get("host_us") else "–"
        print(f"| {shape} | {M} | {roof:.1f} | {best} | {_us(peers[best]):.1f} | {_us(rows['eager']):.1f} | "
              f"{_us(tuned):.1f} | {_us(tuned) / roof:.2f} | {ratio:.2f} | {_us(heur) if heur else float('nan'):.1f} | "
              f"{host(tuned)} | {host(rows['eager'])} |")
    meta = data["meta"]
    any_row = next(iter(next(iter(cases.values())).values()))
    print(f"\n{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}. Ceilings measured "
          f"in the run: copy {any_row['copy_GBps']:.0f} GB/s, bf16 GEMM {any_row['gemm_TFLOPs']:.0f} TFLOP/s.")
    for name, ratios in (("M <= 128", small), ("M >= 1024", large)):
        g = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        print(f"Geometric mean of best peer / autofuse-tuned at {name}: {g:.3f} (lowest {min(ratios):.2f}, "
              f"highest {max(ratios):.2f}, {len(ratios)} points)")


if __name__ == "__main__":
    main(sys.argv[1])
