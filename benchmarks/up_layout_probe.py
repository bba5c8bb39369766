"""Where the library up-projection loses its last few percent, and what a training step holds.

  python benchmarks/up_layout_probe.py --out DIR [--memory] [--layouts] [--training]

--layouts: per (d_model, d_ff, M) of the sweep's misses and the training shapes (bf16), graph-replayed GPU
time side by side (timing.graph_side_by_side_ms) of the ways cuBLAS can produce G and U, with and without
the pointwise act(G) * U that follows: into the two halves of one [M, 2F] buffer (what
pre_activations / cublas_gated_act do), into two separate buffers (eager, torch.compile, Liger), into
[2, M, F], as one GEMM over a stacked or interleaved weight; then autofuse's gated_act pass against
Inductor's fused pointwise kernel on the same inputs.
--training: forward time (do_bench median, L2 flushed) of the training forward (x requires grad) of
autofuse's module against torch.compile of the eager function at the training shapes.
--memory: the CUDA caching allocator's live blocks (>= 4 MiB, with the Python frames that allocated
them) after autofuse's training steps at gemma-7b M=4096: what the module holds that the step's inputs,
parameters and gradients do not explain.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

import autofuse
from autofuse.ops.gated_act import gated_activation, pairs_activation
from autofuse.ops.gated_up import pre_activations
from autofuse.timing import graph_side_by_side_ms

ACT = {"gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}
# The never-slower sweeps' misses (RESULTS.md, fourth session) and the training shapes.
LAYOUT_POINTS = [(3072, 5184, "silu", 77), (3328, 20256, "silu", 77), (512, 3200, "gelu_tanh", 48),
                 (4288, 24824, "gelu_tanh", 128), (3456, 12736, "silu", 1000), (6475, 21061, "silu", 128),
                 (3072, 24576, "gelu_tanh", 4096), (3072, 24576, "gelu_tanh", 16384),
                 (4096, 14336, "silu", 16384)]
TRAIN_POINTS = [(3072, 24576, "gelu_tanh", 4096), (3072, 24576, "gelu_tanh", 16384),
                (4096, 14336, "silu", 4096), (4096, 14336, "silu", 16384)]


def _halves_act(gu, act):
    """Op gated_act over the halves of one [M, 2F] buffer."""
    f = gu.shape[1] // 2
    return gated_activation(gu[:, :f], gu[:, f:], act)


def layouts(d, f, act, M):
    torch.manual_seed(0)
    x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    wg = torch.randn(f, d, device="cuda", dtype=torch.bfloat16) * d**-0.5
    wu = torch.randn(f, d, device="cuda", dtype=torch.bfloat16) * d**-0.5
    stacked = torch.cat([wg, wu])
    pairs = torch.stack([wg, wu], 1).reshape(2 * f, d)  # row 2j gate j, row 2j + 1 up j
    wg_view, wu_view = pairs[0::2], pairs[1::2]
    halves = torch.empty(M, 2 * f, device="cuda", dtype=torch.bfloat16)
    g_sep = torch.empty(M, f, device="cuda", dtype=torch.bfloat16)
    u_sep = torch.empty_like(g_sep)
    two = torch.empty(2, M, f, device="cuda", dtype=torch.bfloat16)
    one = torch.empty(M, 2 * f, device="cuda", dtype=torch.bfloat16)
    fn = ACT[act]
    pointwise = torch.compile(lambda g, u: fn(g) * u, dynamic=False)
    compiled_up = torch.compile(lambda x, wg, wu: fn(F.linear(x, wg)) * F.linear(x, wu), dynamic=False)
    g_c, u_c = F.linear(x, wg), F.linear(x, wu)
    gemms = {
        "mm into halves of [M, 2F]": lambda: (torch.mm(x, wg.t(), out=halves[:, :f]),
                                               torch.mm(x, wu.t(), out=halves[:, f:])),
        "mm into separate [M, F]": lambda: (torch.mm(x, wg.t(), out=g_sep), torch.mm(x, wu.t(), out=u_sep)),
        "mm into [2, M, F]": lambda: (torch.mm(x, wg.t(), out=two[0]), torch.mm(x, wu.t(), out=two[1])),
        "one mm over stacked [2F, d]": lambda: torch.mm(x, stacked.t(), out=one),
        "one mm over interleaved [2F, d]": lambda: torch.mm(x, pairs.t(), out=one),
        "mm of the interleaved views into separate": lambda: (torch.mm(x, wg_view.t(), out=g_sep),
                                                               torch.mm(x, wu_view.t(), out=u_sep)),
    }
    whole = {
        "cublas_gated_act (halves + gated_act)": lambda: _halves_act(pre_activations(x, wg, None, wu, None), act),
        "separate + Inductor pointwise": lambda: pointwise(F.linear(x, wg), F.linear(x, wu)),
        "torch.compile of act(xWg) * xWu": lambda: compiled_up(x, wg, wu),
        "eager act(xWg) * xWu": lambda: fn(F.linear(x, wg)) * F.linear(x, wu),
        "interleaved GEMM + eager act*mul": lambda: (lambda gu: fn(gu[:, 0::2]) * gu[:, 1::2])(
            F.linear(x, pairs)),
        "cublas_pairs (interleaved GEMM + pairs_act)": lambda: pairs_activation(F.linear(x, pairs), act),
        "views: halves + gated_act": lambda: _halves_act(pre_activations(x, wg_view, None, wu_view, None), act),
    }
    passes = {
        "gated_act on [M, 2F]": lambda: _halves_act(halves, act),
        "pairs_act on [M, 2F]": lambda: pairs_activation(one, act),
        "Inductor pointwise on separate": lambda: pointwise(g_c, u_c),
    }
    budget = 60.0 if M <= 1024 else 300.0
    return {name: {k: v * 1e3 for k, v in graph_side_by_side_ms(fns, budget_ms=budget).items()}
            for name, fns in (("gemms_us", gemms), ("up_us", whole), ("pointwise_us", passes))}


def training(d, f, act, M):
    torch.manual_seed(0)
    module = autofuse.get_mlp(d, f, activation=act, dtype=torch.bfloat16, device="cuda")
    wg, wu, wd = module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight
    x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fn = ACT[act]
    eager = lambda x, wg, wu, wd: F.linear(fn(F.linear(x, wg)) * F.linear(x, wu), wd)  # noqa: E731
    compiled = torch.compile(eager)
    wg_c, wu_c, wd_c = (w.detach().clone().requires_grad_() for w in (wg, wu, wd))
    module(x).sum().backward()  # lays the parameters out for training, runs the checks
    fns = {"autofuse": lambda: module(x), "torch.compile": lambda: compiled(x, wg_c, wu_c, wd_c),
           "eager": lambda: eager(x, wg_c, wu_c, wd_c)}
    out = {}
    for _ in range(2):  # two rounds, alternating, so drift falls on all alike
        for name, g in fns.items():
            out.setdefault(name, []).append(triton.testing.do_bench(g, warmup=25, rep=150, return_mode="median"))
    return {name: min(v) for name, v in out.items()}


def memory(out_dir):
    torch.cuda.memory._record_memory_history(max_entries=200000)
    d, f, act, M = 3072, 24576, "gelu_tanh", 4096
    stages = {}
    module = autofuse.get_mlp(d, f, activation=act, dtype=torch.bfloat16, device="cuda")
    stages["module built"] = torch.cuda.memory_allocated()
    x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    stages["x, dy"] = torch.cuda.memory_allocated()
    module(x).backward(dy)
    torch.cuda.synchronize()
    stages["first step (checks)"] = torch.cuda.memory_allocated()
    module(x).backward(dy)
    torch.cuda.synchronize()
    stages["second step"] = torch.cuda.memory_allocated()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    from autofuse import workspaces
    blocks = []
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated" and block["size"] >= 4 << 20:
                frames = [f"{fr['filename'].split('/')[-1]}:{fr['line']} {fr['name']}" for fr in block.get("frames", [])
                          if "python" not in fr["filename"] or "autofuse" in fr["filename"]]
                blocks.append({"MiB": block["size"] / 2**20, "frames": frames[:8]})
    expected = {"params": 3 * f * d * 2 / 2**20, "param grads": 3 * f * d * 2 / 2**20,
                "x, x.grad, dy": 3 * M * d * 2 / 2**20}
    result = {"stages_GiB": {k: v / 2**30 for k, v in stages.items()}, "expected_MiB": expected,
              "workspaces_MiB": {str(k): [t.numel() * t.element_size() / 2**20 for t in v]
                                 for k, v in workspaces._workspaces.items()},
              "retired_MiB": [[t.numel() * t.element_size() / 2**20 for t in v] for v in workspaces._retired],
              "blocks": sorted(blocks, key=lambda b: -b["MiB"])}
    return result


def _each(points, probe) -> list[dict]:
    """`probe` at each point, a row each, printed as it comes (the cache emptied between points)."""
    rows = []
    for point in points:
        rows.append({"point": point, **probe(*point)})
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--layouts", action="store_true")
    parser.add_argument("--training", action="store_true")
    args = parser.parse_args()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    if args.memory:
        result["memory"] = memory(args.out)
        print(json.dumps(result["memory"], indent=1), flush=True)
    if args.layouts:
        result["layouts"] = _each(LAYOUT_POINTS, layouts)
    if args.training:
        result["training_forward_ms"] = _each(TRAIN_POINTS, training)
    Path(args.out, "up_layout_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
