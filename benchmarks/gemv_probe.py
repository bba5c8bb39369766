"""Probe: how close can a dot-free (GEMV-style) Triton kernel stream weights to the read ceiling at M=1?

  python benchmarks/gemv_probe.py --out DIR

The tile kernels (tl.dot, shared-memory pipeline) reach 3.5-3.7 TB/s on an H200 at M=1 against a
4.26 TB/s read ceiling (explore_variants.py). This times a register-only GEMV for the gated
up-projection and the down projection of gemma-2b, for a few block shapes, checked against torch.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from autofuse.tools.measure import graph_replay_us


@triton.jit
def _gemv_gated(x_ptr, wg_ptr, wu_ptr, h_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + k + offs_k).to(tl.float32)
        wg = tl.load(wg_ptr + rows[:, None] * K + k + offs_k[None, :]).to(tl.float32)
        wu = tl.load(wu_ptr + rows[:, None] * K + k + offs_k[None, :]).to(tl.float32)
        acc_g += wg * x[None, :]
        acc_u += wu * x[None, :]
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    h = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g)) * u
    tl.store(h_ptr + offs_n, h.to(h_ptr.dtype.element_ty), mask=offs_n < N)


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_len = K // SPLIT_K
    k0 = tl.program_id(1) * k_len
    for k in range(k0, k0 + k_len, BLOCK_K):
        x = tl.load(x_ptr + k + offs_k).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * K + k + offs_k[None, :]).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        tl.store(y_ptr + offs_n, y, mask=offs_n < N)
    else:
        tl.atomic_add(y_ptr + offs_n, y, mask=offs_n < N, sem="relaxed")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    d, f = 2048, 16384
    g = torch.Generator(device="cuda").manual_seed(0)
    wg = (torch.randn(f, d, generator=g, device="cuda") / d**0.5).bfloat16()
    wu = (torch.randn(f, d, generator=g, device="cuda") / d**0.5).bfloat16()
    wd = (torch.randn(d, f, generator=g, device="cuda") / f**0.5).bfloat16()
    x = torch.randn(1, d, generator=g, device="cuda").bfloat16()
    hx = torch.randn(1, f, generator=g, device="cuda").bfloat16()
    gate_ref = torch.nn.functional.gelu(x.float() @ wg.float().T, approximate="tanh") * (x.float() @ wu.float().T)
    down_ref = hx.float() @ wd.float().T
    rows = []
    for bn in (4, 8, 16, 32):
        for bk in (128, 256, 512):
            for warps in (2, 4, 8):
                for stages in (1, 3):
                    h = torch.empty(1, f, device="cuda", dtype=torch.bfloat16)

                    def run(bn=bn, bk=bk, warps=warps, stages=stages, h=h):
                        _gemv_gated[(f // bn,)](x, wg, wu, h, f, d, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                                num_stages=stages)
                    try:
                        run()
                        err = ((h.float() - gate_ref).norm() / gate_ref.norm()).item()
                        us = graph_replay_us(run)
                        rows.append(dict(kernel="gated", bn=bn, bk=bk, warps=warps, stages=stages, us=us, err=err,
                                         gbs=2 * wg.nbytes / us / 1e3))
                        print(f"gated bn={bn} bk={bk} w={warps} s={stages}: {us:.1f} us "
                              f"{2 * wg.nbytes / us / 1e3:.0f} GB/s err {err:.1e}", flush=True)
                    except Exception as e:  # noqa: BLE001
                        print(f"gated bn={bn} bk={bk} w={warps}: {type(e).__name__}", flush=True)
    for bn in (4, 8, 16):
        for bk in (256, 512, 1024):
            for warps in (4, 8):
                for split in (1, 2, 4):
                    y = torch.zeros(1, d, device="cuda", dtype=torch.float32)

                    def run(bn=bn, bk=bk, warps=warps, split=split, y=y):
                        _gemv[(d // bn, split)](hx, wd, y, d, f, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                                                num_warps=warps)
                    try:
                        y.zero_()
                        run()
                        err = ((y - down_ref).norm() / down_ref.norm()).item()
                        us = graph_replay_us(run)
                        rows.append(dict(kernel="down", bn=bn, bk=bk, warps=warps, split=split, us=us, err=err,
                                         gbs=wd.nbytes / us / 1e3))
                        print(f"down bn={bn} bk={bk} w={warps} split={split}: {us:.1f} us "
                              f"{wd.nbytes / us / 1e3:.0f} GB/s err {err:.1e}", flush=True)
                    except Exception as e:  # noqa: BLE001
                        print(f"down bn={bn} bk={bk} w={warps}: {type(e).__name__} {e}", flush=True)
    Path(args.out, "gemv_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
