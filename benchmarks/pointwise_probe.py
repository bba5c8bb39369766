"""The training step's two pointwise passes against Inductor's, per tile shape (issue 16's training lead).

  python benchmarks/pointwise_probe.py --out DIR

At the training benchmark's shapes (gemma-7b GeGLU, Llama-3-8B SwiGLU; M = 4096, 16384; bf16) times, as
do_bench medians of CUDA-graph replays (L2 flushed by do_bench between replays is not done: every pass
moves several hundred MB, far past L2):
- gated_act (forward: H = act(G) * U from G and U, two buffers) and gated_grad (backward: dG, dU, and H,
  from dH) through autofuse's launcher at several (BLOCK_M, BLOCK_N, num_warps), the shipped one first;
- op gated_dgu where this build has it (the backward pass without H, for a forward that kept H);
- torch.compile's kernels for the same work, from the same two buffers: act * mul; the gradient pass
  with and without H.
Each row: µs, and GB/s counted from the bytes the pass must move (reads + writes, 2 bytes an element).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing
from in_turn import graph_us

from autofuse import launch as L
from autofuse import ops

SHAPES = [("gemma-7b", 24576, "gelu_tanh"), ("llama-3-8b", 14336, "silu")]
TOKENS = (4096, 16384)
TILES = [(4, 512, 4), (2, 1024, 4), (4, 1024, 4), (1, 2048, 8), (8, 1024, 8)]
ACT = {"gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}


def _act_grad(activation, dh, g, u):
    a = ACT[activation](g.float())
    if activation == "gelu_tanh":
        dg = torch.ops.aten.gelu_backward(dh.float() * u.float(), g.float(), approximate="tanh")
    else:
        s = torch.sigmoid(g.float())
        dg = dh.float() * u.float() * (s + g.float() * s * (1 - s))
    return dg.to(dh.dtype), (a * dh.float()).to(dh.dtype), a


def _ours(op_name, activation, tensors, M, N, tile):
    op = ops.get(op_name)
    block_m, block_n, warps = tile
    kernel = L.kernel_for(op, activation, L._POINTWISE.block_k, torch.bfloat16, L._POINTWISE, False)
    grid = (-(-M // block_m) * -(-N // block_n),)  # launch.pointwise_launch's 1-D grid
    return lambda: L.launch(kernel, grid, tensors, (M, N), dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    rows = []
    for name, N, activation in SHAPES:
        for M in TOKENS:
            torch.manual_seed(0)
            # G and U as two buffers, as the training forward that keeps H writes them.
            g, u = (torch.randn(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            dh = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            h = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            dg, du = torch.empty_like(g), torch.empty_like(u)
            mib = M * N * 2 / 1e9  # GB per [M, N] tensor
            act = ACT[activation]

            def row(kind, provider, us, tensors_moved, **extra):
                r = dict(shape=name, M=M, N=N, kind=kind, provider=provider, us=round(us, 1),
                         gbps=round(tensors_moved * mib / (us * 1e-6), 1), **extra)
                rows.append(r)
                print(json.dumps(r), flush=True)

            passes = {"act": ("gated_act", {"g": g, "u": u, "h": h}, 3),
                      "grad+h": ("gated_grad", {"dh": dh, "g": g, "u": u, "dg": dg, "du": du, "h": h}, 6),
                      "grad": ("gated_dgu", {"dh": dh, "g": g, "u": u, "dg": dg, "du": du}, 5)}
            for tile in TILES:
                for kind, (op_name, tensors, moved) in passes.items():
                    row(kind, "autofuse", graph_us(_ours(op_name, activation, tensors, M, N, tile)), moved,
                        tile=tile)
            torch._dynamo.reset()
            c_act = torch.compile(lambda g, u: act(g) * u)
            row("act", "torch.compile", graph_us(lambda g=g, u=u: c_act(g, u)), 3)

            def grad_h(dh, g, u):
                dg, du, a = _act_grad(activation, dh, g, u)
                return dg, du, (a * u.float()).to(dh.dtype)

            def grad(dh, g, u):
                return _act_grad(activation, dh, g, u)[:2]

            c_grad_h, c_grad = torch.compile(grad_h), torch.compile(grad)
            row("grad+h", "torch.compile", graph_us(lambda dh=dh, g=g, u=u: c_grad_h(dh, g, u)), 6)
            row("grad", "torch.compile", graph_us(lambda dh=dh, g=g, u=u: c_grad(dh, g, u)), 5)
            del g, u, dh, h, dg, du
    Path(args.out, "pointwise_probe.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                                                  "torch": torch.__version__,
                                                                  "triton": triton.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
