"""MLPs with fp8 weights against the best bf16 peer, on shapes nobody tuned.

  python benchmarks/fp8.py [--out DIR] [--mlps 6] [--seed 39] [--tokens 1,2,4,8,16,64,256,1024,4096,16384]

Gated MLPs drawn with a seeded generator (never_slower.py's: d_model 512-8192, d_ff 1-8x d_model, some not
multiples of 8 or 64), bf16 activations. Per shape and M: CUDA-graph-replayed GPU time of the bf16 peers (eager
PyTorch, torch.compile, Liger where installed, autofuse's bf16 MLP) and of autofuse's MLP with fp8 weights
(get_mlp(weights="fp8"), the bf16 module's weights quantized), the providers replayed in turn in this process,
and at M <= 16 the plain (un-graphed) call's time too (never_slower.measure).
Run it with an empty user cache: every fp8 config then comes from a first-use check. Reported per point: the best
bf16 peer of eager / torch.compile / Liger over the fp8 MLP, the same against autofuse's bf16 MLP, and the fp8
MLP's relative error against the bf16 model's output (eager bf16) beside the bf16 MLP's own. Needs a GPU of
compute capability 8.9 or newer.
"""

from __future__ import annotations

import time

import harness
import torch
from never_slower import draw_shapes, geomean, liger_gate, measure, mlp_providers

import autofuse

PEERS = ("eager", "torch.compile", "liger")


def fp8_twin(module):
    """get_mlp(weights="fp8") holding `module`'s weights quantized."""
    fp8 = autofuse.get_mlp(module.d_model, module.d_ff, activation=module.activation, dtype=torch.bfloat16,
                           device="cuda", weights="fp8")
    dense = {name: p.detach().contiguous() for name, p in module.state_dict().items()}
    fp8.load_state_dict(dense)
    return fp8


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--seed", type=int, default=39)
    parser.add_argument("--mlps", type=int, default=6)
    parser.add_argument("--tokens", default="1,2,4,8,16,64,256,1024,4096,16384")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        parser.exit(2, "fp8.py needs a CUDA GPU of compute capability 8.9 or newer\n")
    out = harness.out_dir(args.out)
    tokens = [int(t) for t in args.tokens.split(",")]
    gated, _ = draw_shapes(args.seed, args.mlps, 0)
    liger = liger_gate()
    rows = []
    start = time.perf_counter()
    with torch.no_grad():
        for shape in gated:
            providers = mlp_providers(shape, liger)
            providers["autofuse-fp8"] = fp8_twin(providers["autofuse"])
            for M in tokens:
                row = dict(**shape, **measure(providers, shape["d_model"], M, subject="autofuse-fp8", peers=PEERS))
                row["ratio_to_autofuse_bf16"] = row["us"]["autofuse"] / row["us"]["autofuse-fp8"]
                row["sources"] = providers["autofuse-fp8"].config_sources(M)
                row["choices"] = {op: c.short() for op, c in providers["autofuse-fp8"].config_for(M).items()}
                rows.append(row)
                print(f"{shape['d_model']}->{shape['d_ff']} {shape['activation']} M={M}: fp8 "
                      f"{row['us']['autofuse-fp8']:.1f} us, best bf16 peer {row['best_peer']} "
                      f"{row['us'][row['best_peer']]:.1f} ({row['ratio']:.2f}x), autofuse bf16 "
                      f"{row['us']['autofuse']:.1f} ({row['ratio_to_autofuse_bf16']:.2f}x); error "
                      f"{row['rel_error']['autofuse-fp8']:.2e} (bf16 {row['rel_error']['autofuse']:.2e})", flush=True)
            del providers
            torch._dynamo.reset()
            summary = _summary(rows, start)
            harness.write(out, "fp8.json", dict(seed=args.seed, liger=liger is not None, summary=summary, rows=rows))
    print(summary, flush=True)


def _summary(rows: list[dict], start: float) -> dict:
    def of(points):
        ratios = [r["ratio"] for r in points]
        return dict(points=len(ratios), geomean=geomean(ratios), min=min(ratios, default=float("nan")))

    return dict(m_le_16=of([r for r in rows if r["M"] <= 16]), m_ge_1024=of([r for r in rows if r["M"] >= 1024]),
                all=of(rows), max_rel_error=max((r["rel_error"]["autofuse-fp8"] for r in rows), default=float("nan")),
                seconds=time.perf_counter() - start)


if __name__ == "__main__":
    main()
