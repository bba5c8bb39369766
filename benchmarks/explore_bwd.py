"""Which epilogue makes the gated backward kernel (dH = dY Wd, then dG | dU | H from the saved G | U)
fast on Hopper? Variants of templates/gated_bwd_tma.py.jinja, timed side by side with the same
mainloop storing dH alone (the floor for this mainloop) and with cuBLAS's dY @ Wd. (Issue 5.)

  python benchmarks/explore_bwd.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor

from autofuse.ops.gated_bwd import gated_backward_eager
from autofuse.render import load_source

HEAD = '''
import triton
import triton.language as tl


@triton.jit
def _act(x):
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x * tl.sigmoid(2.0 * u)


@triton.jit
def _act_grad(x):
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    s = tl.sigmoid(2.0 * u)
    du = 0.7978845608028654 * (1.0 + 0.134145 * x * x)
    return s + 2.0 * x * s * (1.0 - s) * du


@triton.jit
def _grads(acc, g, u):
    a = _act(g)
    return _act_grad(g) * acc * u, a * acc, a * u


@triton.jit
def kernel(dy_desc, wd_desc, gu_ptr, h_ptr, g_desc, u_desc, h_desc, M, N, K, stride_gum, stride_hm,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
           NUM_SMS: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=True):
        group_id = tile // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((tile % num_pid_in_group) % group_size_m)
        pid_n = (tile % num_pid_in_group) // group_size_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = (offs_m % M).to(tl.int64)
        cols = (offs_n % N).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_tiles):
            dy = dy_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            wd = wd_desc.load([k * BLOCK_K, pid_n * BLOCK_N])
            acc = tl.dot(dy, wd, acc)
'''

EPILOGUES = {
    # what the template does now: pointer loads and stores with int64 addresses
    "pointers": '''
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        g_ptrs = gu_ptr + rows[:, None] * stride_gum + cols[None, :]
        g = tl.load(g_ptrs).to(tl.float32)
        u = tl.load(g_ptrs + N).to(tl.float32)
        dg, du, h = _grads(acc, g, u)
        tl.store(g_ptrs, dg.to(tl.bfloat16), mask=mask)
        tl.store(g_ptrs + N, du.to(tl.bfloat16), mask=mask)
        tl.store(h_ptr + rows[:, None] * stride_hm + cols[None, :], h.to(tl.bfloat16), mask=mask)
''',
    # G, U in and dG, dU, H out through tensor descriptors over the [M, N] views
    "descriptors": '''
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        g = g_desc.load([m0, n0]).to(tl.float32)
        u = u_desc.load([m0, n0]).to(tl.float32)
        dg, du, h = _grads(acc, g, u)
        g_desc.store([m0, n0], dg.to(tl.bfloat16))
        u_desc.store([m0, n0], du.to(tl.bfloat16))
        h_desc.store([m0, n0], h.to(tl.bfloat16))
''',
    # descriptors, the tile in two column halves (fewer live registers)
    "descriptors-split2": '''
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        acc = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        acc0, acc1 = tl.split(acc)
        g = g_desc.load([m0, n0]).to(tl.float32)
        u = u_desc.load([m0, n0]).to(tl.float32)
        dg, du, h = _grads(acc0, g, u)
        g_desc.store([m0, n0], dg.to(tl.bfloat16))
        u_desc.store([m0, n0], du.to(tl.bfloat16))
        h_desc.store([m0, n0], h.to(tl.bfloat16))
        g = g_desc.load([m0, n0 + BLOCK_N // 2]).to(tl.float32)
        u = u_desc.load([m0, n0 + BLOCK_N // 2]).to(tl.float32)
        dg, du, h = _grads(acc1, g, u)
        g_desc.store([m0, n0 + BLOCK_N // 2], dg.to(tl.bfloat16))
        u_desc.store([m0, n0 + BLOCK_N // 2], du.to(tl.bfloat16))
        h_desc.store([m0, n0 + BLOCK_N // 2], h.to(tl.bfloat16))
''',
    # the mainloop's floor: dH stored alone
    "dH only": '''
        h_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(tl.bfloat16))
''',
}


def _reference(dy, gu, wd):
    dgu, h = gated_backward_eager(dy.float(), gu.float(), wd.float(), "gelu_tanh")  # the variants' [dG | dU | H]
    return torch.cat([dgu, h], dim=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for shape, d, f, M in (("gemma-2b", 2048, 16384, 4096), ("gemma-7b", 3072, 24576, 16384)):
        torch.manual_seed(0)
        dy = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
        wd = (torch.randn(d, f, device="cuda") / f**0.5).bfloat16()
        gu0 = torch.randn(M, 2 * f, device="cuda", dtype=torch.bfloat16)
        ref = _reference(dy, gu0, wd)
        cublas = triton.testing.do_bench(lambda: dy @ wd, warmup=25, rep=200, return_mode="median")
        rows.append(dict(shape=shape, M=M, variant="cuBLAS dY @ Wd", ms=cublas))
        print(json.dumps(rows[-1]), flush=True)
        for name, epilogue in EPILOGUES.items():
            kernel = load_source(HEAD + epilogue, "kernel")
            for bm, bn, bk, warps, stages in ((128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4)):
                row = dict(shape=shape, M=M, variant=name, block=[bm, bn, bk], warps=warps, stages=stages)
                try:
                    gu = gu0.clone()
                    h = torch.empty(M, f, device="cuda", dtype=torch.bfloat16)
                    half = bn // 2 if "split2" in name else bn
                    descs = [TensorDescriptor(dy, [M, d], [d, 1], [bm, bk]),
                             TensorDescriptor(wd, [d, f], [f, 1], [bk, bn]), gu, h,
                             TensorDescriptor(gu[:, :f], [M, f], [2 * f, 1], [bm, half]),
                             TensorDescriptor(gu[:, f:], [M, f], [2 * f, 1], [bm, half]),
                             TensorDescriptor(h, [M, f], [f, 1], [bm, half])]
                    tiles = triton.cdiv(M, bm) * triton.cdiv(f, bn)

                    def run():
                        kernel[(min(sms, tiles),)](*descs, M, f, d, 2 * f, f, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                                   GROUP_M=8, NUM_SMS=sms, num_warps=warps, num_stages=stages)

                    run()
                    torch.cuda.synchronize()
                    if name != "dH only":
                        got = torch.cat([gu, h], dim=1).float()
                        row["rel_error"] = ((got - ref).norm() / ref.norm()).item()
                    row["ms"] = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
                    row["tflops"] = 2 * M * d * f / row["ms"] / 1e9
                except Exception as e:  # noqa: BLE001 - a variant that fails is reported
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "explore_bwd.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       rows=rows), f)


if __name__ == "__main__":
    main()
