"""Time hand-picked configs of the new kernel variants (split-K, persistent TMA) on the device.

  python benchmarks/explore_variants.py [--only decode|prefill|ceilings|fused] --out DIR

For each key below: every config is compiled, verified on fresh random inputs (the tuner's own
Evaluator: NaN-poisoned output, float64 reference) and timed twice: do_bench's median (L2
flushed; what the tuner ranks by) and, at small M, CUDA-graph replay (launch gaps removed; what a
decode step pays). The eager baseline is timed the same two ways. Ceilings measured in the same
run: device-to-device copy and a read-only stream, both over 1 GiB. Rows go to DIR/explore.json.
This picks the search space and heuristics; the tuner then searches that space per key.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from autofuse.configs import KernelConfig as C  # noqa: E402

GEMMA_2B = dict(d=2048, f=16384)


def _decode_down(M):
    bm = 16 if M <= 16 else 64
    return [C(bm, bn, bk, 8, 4, st, split_k=sk) for bn in (32, 64) for bk in (128, 256) for st in (4,)
            for sk in (4, 8, 16)] + [C(16 if M <= 16 else 64, 16, 128, 8, 4, 4)]


def _decode_gated(M):
    bm = 16 if M <= 16 else 64
    return [C(bm, bn, bk, 8, 4, st, split_k=sk) for bn in (32, 64) for bk in (128, 256) for st in (3, 5)
            for sk in (1, 2)]


def _prefill(tma_only_sizes):
    out = []
    for bm, bn, bk, w, st in tma_only_sizes:
        out += [C(bm, bn, bk, 8, w, st, tma=True), C(bm, bn, bk, 8, w, st)]
    return out


# (label, op, N, K, M, activation, bias, configs)
DECODE = [
    ("gemma-2b down", "down", 2048, 16384, 1, "none", False, _decode_down(1)),
    ("gemma-2b down", "down", 2048, 16384, 16, "none", False, _decode_down(16)),
    ("gemma-2b down", "down", 2048, 16384, 128, "none", False, _decode_down(128)),
    ("gemma-2b gated_up", "gated_up", 16384, 2048, 1, "gelu_tanh", False, _decode_gated(1)),
]
PREFILL = [
    ("gemma-2b gated_up", "gated_up", 16384, 2048, 4096, "gelu_tanh", False,
     _prefill([(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (64, 256, 64, 8, 3), (128, 256, 64, 16, 3)])),
    ("linear 4096->16384 gelu", "linear", 16384, 4096, 4096, "gelu", True,
     _prefill([(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (256, 128, 64, 8, 3)])),
    ("gemma-2b down", "down", 2048, 16384, 4096, "none", False,
     _prefill([(128, 256, 64, 8, 3), (128, 128, 64, 8, 4)])),
]


# (label, d_model, d_ff, activation, M, configs) for the one-launch decode MLP
def _fused(M):
    bm = 16 if M <= 16 else 32 if M <= 32 else 64
    return [C(bm, bf, bd, 8, w, st) for bf in (32, 64, 128) for bd in (64, 128, 256) for w in (4, 8)
            for st in (3, 4)]


FUSED = [
    ("gemma-2b", 2048, 16384, "gelu_tanh", 1, _fused(1)),
    ("gemma-2b", 2048, 16384, "gelu_tanh", 16, _fused(16)),
    ("gemma-2b", 2048, 16384, "gelu_tanh", 128, _fused(128)),
    ("t5-v1.1-base", 768, 2048, "gelu_tanh", 1, [C(16, bf, bd, 8, w, st) for bf in (16, 32, 64) for bd in (64, 128, 256)
                                                  for w in (2, 4) for st in (2, 3)]),
    ("t5-v1.1-base", 768, 2048, "gelu_tanh", 128, _fused(128)),
    ("llama-swiglu", 4096, 14336, "silu", 1, _fused(1)),
]


def explore_fused(shapes) -> list[dict]:
    from autofuse import workspaces
    from autofuse.ops.mlp import mlp_decode
    from autofuse.reference import ERROR_BOUNDS, eager_gated, gated_reference, linear_reference, relative_error
    from autofuse.tools.measure import gpu_median_ms, graph_replay_us

    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for label, d, f, act, M, configs in shapes:
        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

        wg, wu = rnd(f, d, scale=d**-0.5), rnd(f, d, scale=d**-0.5)
        wd = rnd(d, f, scale=f**-0.5)
        x = rnd(M, d)
        ref = linear_reference(gated_reference(x, wg, wu, None, None, act), wd, None, None, "none")

        def eager():
            return torch.nn.functional.linear(eager_gated(x, wg, wu, None, None, act), wd)

        weight_bytes = 3 * wg.nbytes
        with torch.no_grad():
            base_ms, base_graph = gpu_median_ms(eager), graph_replay_us(eager)
        print(f"{label} fused MLP M={M}: eager {base_ms * 1e3:.1f} us graph {base_graph:.1f} us "
              f"(weights at the read ceiling would take {weight_bytes / 4.26e6:.1f} us)", flush=True)
        for config in configs:
            start = time.perf_counter()
            row = dict(label=label, op="mlp_decode", d=d, f=f, M=M, config=config.to_dict(), short=config.short(),
                       baseline_ms=base_ms, baseline_graph_us=base_graph, weight_bytes=weight_bytes)
            try:
                out = torch.full((M, d), float("nan"), dtype=torch.bfloat16, device="cuda")
                mlp_decode(x, wg, wu, wd, None, None, None, act, config, out=out)
                err = relative_error(out, ref)
                if not (err <= ERROR_BOUNDS[torch.bfloat16] and torch.isfinite(out).all()):
                    row.update(status="wrong_result", detail=f"error {err}")
                else:
                    def run(c=config):
                        return mlp_decode(x, wg, wu, wd, None, None, None, act, c)
                    row.update(status="ok", error=err, ms=gpu_median_ms(run), graph_us=graph_replay_us(run))
            except Exception as e:  # noqa: BLE001 - record and go on
                row.update(status=type(e).__name__, detail=str(e)[:200])
                workspaces.reset_workspaces()
            row["seconds"] = time.perf_counter() - start
            rows.append(row)
            if row["status"] == "ok":
                print(f"  {config.short():30s} {row['ms'] * 1e3:7.1f} us graph {row['graph_us']:6.1f} us = "
                      f"{weight_bytes / row['graph_us'] / 1e3:5.0f} GB/s", flush=True)
            else:
                print(f"  {config.short():30s} {row['status']} {row.get('detail', '')[:80]}", flush=True)
    return rows


def ceilings() -> dict:
    import triton
    import triton.language as tl

    from autofuse.tools.measure import gpu_median_ms

    @triton.jit
    def _read(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        # Each program streams ITERS consecutive blocks and writes one number: pure reads.
        base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + tl.program_id(0), tl.sum(acc))

    n = 1 << 29  # 1 GiB of bf16
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_ms = gpu_median_ms(lambda: y.copy_(x))
    block, iters = 4096, 16
    out = torch.empty(n // (block * iters), device="cuda")
    read_ms = gpu_median_ms(lambda: _read[(out.numel(),)](x, out, n, BLOCK=block, ITERS=iters, num_warps=8))
    sum_ms = gpu_median_ms(lambda: x.sum())
    gemm = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm_ms = gpu_median_ms(lambda: gemm @ gemm)
    return dict(copy_gbs=2 * x.nbytes / copy_ms / 1e6, read_gbs=x.nbytes / read_ms / 1e6,
                torch_sum_gbs=x.nbytes / sum_ms / 1e6, gemm_tflops=2 * 8192**3 / gemm_ms / 1e9)


def explore(keys) -> list[dict]:
    from autofuse.evaluator import Evaluator
    from autofuse.key import current_environment, make_key
    from autofuse.tools.measure import graph_replay_us

    device = torch.device("cuda")
    rows = []
    for label, op, n, k, M, act, bias, configs in keys:
        key = make_key(op, n, k, M, torch.bfloat16, act, bias, False, current_environment(device))
        ev = Evaluator(key, M, device)
        weight_bytes = sum(w.nbytes for w in ev.weights)
        with torch.no_grad():
            base_ms = ev.baseline_ms()
            base_graph = graph_replay_us(lambda: ev.baseline(ev.x)) if M <= 128 else None
        print(f"{label} M={M}: baseline {base_ms * 1e3:.1f} us (graph {base_graph})", flush=True)
        for config in configs:
            start = time.perf_counter()
            record = ev.evaluate(config)
            graph = None
            if record.status == "ok" and M <= 128:
                with torch.no_grad():
                    graph = graph_replay_us(lambda c=config: ev._launch(c, ev.operands[ev._input]))
            row = dict(label=label, op=op, n=n, k=k, M=M, config=config.to_dict(), short=config.short(),
                       status=record.status, detail=record.detail, ms=record.time_ms, graph_us=graph,
                       baseline_ms=base_ms, baseline_graph_us=base_graph, weight_bytes=weight_bytes,
                       seconds=time.perf_counter() - start)
            rows.append(row)
            us = f"{record.time_ms * 1e3:7.1f} us" if record.time_ms else record.status
            gbs = f" graph {graph:6.1f} us = {weight_bytes / graph / 1e3:5.0f} GB/s" if graph else ""
            print(f"  {config.short():34s} {us}{gbs}  ({row['seconds']:.1f} s)", flush=True)
        ev.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", choices=["decode", "prefill", "ceilings", "fused"], action="append")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    parts = args.only or ["ceilings", "decode", "prefill"]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    result["triton"] = triton.__version__
    out = Path(args.out) / f"explore-{'-'.join(parts)}.json"
    if "ceilings" in parts:
        result["ceilings"] = ceilings()
        print(result["ceilings"], flush=True)
    result["rows"] = []
    for part, keys in (("decode", DECODE), ("prefill", PREFILL)):
        if part in parts:
            result["rows"] += explore(keys)
            out.write_text(json.dumps(result, indent=1))
    if "fused" in parts:
        result["rows"] += explore_fused(FUSED)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
