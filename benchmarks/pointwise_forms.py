"""Where autofuse's pointwise passes lose 2-3% to Inductor's (issue 16's training step): the same two passes
written in several forms, timed beside autofuse's own launch and torch.compile's kernels.

  python benchmarks/pointwise_forms.py --out DIR

Forms (standalone kernels here, not templates): a 1-D flat index over contiguous [M, N] buffers (Inductor's
form) with and without a mask, with and without streaming (evict_first) loads, at 1024 and 2048 elements a
program; autofuse's 2-D tile (4, 512) through its launcher. Passes: act (H = act(G) * U, G and U two buffers)
and grad (dG, dU = act'(G) dH U, act(G) dH, written over G and U as the training backward does). Times: µs, the
median of do_bench over CUDA-graph replays; GB/s from the bytes each pass must move. Inductor's generated
source goes to DIR/inductor_pointwise.txt.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing
from in_turn import graph_us

from autofuse import launch as L
from autofuse import ops

SHAPES = [("gemma-7b", 24576, "gelu_tanh"), ("llama-3-8b", 14336, "silu")]
TOKENS = (4096, 16384)


@triton.jit
def _gelu_tanh(x):
    return x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))


@triton.jit
def _act_flat(g_ptr, u_ptr, h_ptr, numel, BLOCK: tl.constexpr, MASKED: tl.constexpr, EVICT: tl.constexpr,
              GELU: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    if MASKED:
        if EVICT:
            g = tl.load(g_ptr + offs, mask=mask, eviction_policy="evict_first").to(tl.float32)
            u = tl.load(u_ptr + offs, mask=mask, eviction_policy="evict_first").to(tl.float32)
        else:
            g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
            u = tl.load(u_ptr + offs, mask=mask).to(tl.float32)
    else:
        if EVICT:
            g = tl.load(g_ptr + offs, eviction_policy="evict_first").to(tl.float32)
            u = tl.load(u_ptr + offs, eviction_policy="evict_first").to(tl.float32)
        else:
            g = tl.load(g_ptr + offs).to(tl.float32)
            u = tl.load(u_ptr + offs).to(tl.float32)
    if GELU:
        a = _gelu_tanh(g)
    else:
        a = g * tl.sigmoid(g)
    if MASKED:
        tl.store(h_ptr + offs, (a * u).to(h_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(h_ptr + offs, (a * u).to(h_ptr.dtype.element_ty))


@triton.jit
def _grad_flat(dh_ptr, g_ptr, u_ptr, numel, BLOCK: tl.constexpr, EVICT: tl.constexpr, GELU: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if EVICT:
        dh = tl.load(dh_ptr + offs, eviction_policy="evict_first").to(tl.float32)
        g = tl.load(g_ptr + offs, eviction_policy="evict_first").to(tl.float32)
        u = tl.load(u_ptr + offs, eviction_policy="evict_first").to(tl.float32)
    else:
        dh = tl.load(dh_ptr + offs).to(tl.float32)
        g = tl.load(g_ptr + offs).to(tl.float32)
        u = tl.load(u_ptr + offs).to(tl.float32)
    if GELU:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * g * g)
    else:
        s = tl.sigmoid(g)
        a = g * s
        da = s + g * s * (1.0 - s)
    tl.store(g_ptr + offs, (da * dh * u).to(g_ptr.dtype.element_ty))
    tl.store(u_ptr + offs, (a * dh).to(u_ptr.dtype.element_ty))


def _autofuse(op_name, activation, tensors, M, N):
    op = ops.get(op_name)
    kernel = L.kernel_for(op, activation, L._POINTWISE.block_k, torch.bfloat16, L._POINTWISE, False)
    grid = (-(-M // 4) * -(-N // 512),)
    return lambda: L.launch(kernel, grid, tensors, (M, N), dict(BLOCK_M=4, BLOCK_N=512, num_warps=4))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    torch._logging.set_logs(output_code=True)
    import logging
    handler = logging.FileHandler(Path(args.out, "inductor_pointwise.txt"))
    logging.getLogger("torch._inductor").addHandler(handler)
    rows = []
    act_fns = {"gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}
    for name, N, activation in SHAPES:
        gelu = activation == "gelu_tanh"
        for M in TOKENS:
            torch.manual_seed(0)
            g, u, dh = (torch.randn(M, N, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            h = torch.empty_like(g)
            gb = M * N * 2 / 1e9
            numel = M * N

            def row(kind, form, us, moved):
                r = dict(shape=name, M=M, N=N, kind=kind, form=form, us=round(us, 1),
                         gbps=round(moved * gb / (us * 1e-6), 1))
                rows.append(r)
                print(json.dumps(r), flush=True)

            row("act", "autofuse 2-D (4, 512) w4", graph_us(_autofuse("gated_act", activation,
                                                                           {"g": g, "u": u, "h": h}, M, N)), 3)
            for block, warps in ((1024, 4), (2048, 4), (2048, 8)):
                for masked in (True, False):
                    for evict in (False, True):
                        grid = (triton.cdiv(numel, block),)
                        fn = lambda: _act_flat[grid](g, u, h, numel, BLOCK=block, MASKED=masked, EVICT=evict,  # noqa: E731
                                                     GELU=gelu, num_warps=warps)
                        row("act", f"flat {block} w{warps} mask={masked} evict={evict}", graph_us(fn), 3)
            # The backward pass in place over copies (dG over G, dU over U), as training runs it.
            g2, u2 = g.clone(), u.clone()
            row("grad", "autofuse 2-D (4, 512) w4",
                graph_us(_autofuse("gated_dgu", activation, {"dh": dh, "g": g2, "u": u2, "dg": g2, "du": u2},
                                      M, N)), 5)
            for block, warps in ((1024, 4), (2048, 4), (2048, 8)):
                for evict in (False, True):
                    grid = (triton.cdiv(numel, block),)
                    fn = lambda: _grad_flat[grid](dh, g2, u2, numel, BLOCK=block, EVICT=evict, GELU=gelu,  # noqa: E731
                                                  num_warps=warps)
                    row("grad", f"flat {block} w{warps} evict={evict}", graph_us(fn), 5)
            torch._dynamo.reset()
            act = act_fns[activation]
            c_act = torch.compile(lambda g, u: act(g) * u)
            row("act", "torch.compile", graph_us(lambda: c_act(g, u)), 3)
    Path(args.out, "pointwise_forms.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                                                  "torch": torch.__version__,
                                                                  "triton": triton.__version__, "rows": rows}))


if __name__ == "__main__":
    main()
