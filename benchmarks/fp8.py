"""MLPs with fp8 weights (weight-only, and W8A8) against the best bf16 peer, on shapes nobody tuned.

  python benchmarks/fp8.py [--out DIR] [--mlps 6] [--seed 39] [--tokens 1,2,4,8,16,64,256,1024,4096,16384]

Gated MLPs drawn with a seeded generator (never_slower.py's: d_model 512-8192, d_ff 1-8x d_model, some not
multiples of 8 or 64), bf16 activations. Per shape and M: CUDA-graph-replayed GPU time of the bf16 peers (eager
PyTorch, torch.compile, Liger where installed, autofuse's bf16 MLP) and of autofuse's MLPs with fp8 weights
(get_mlp(weights="fp8") and weights="w8a8", the bf16 module's weights quantized), the providers replayed in turn in
this process, and at M <= 16 the plain (un-graphed) call's time too (never_slower.measure).
Run it with an empty user cache: every fp8 config then comes from a first-use check. Reported per point: the best
bf16 peer of eager / torch.compile / Liger over each fp8 MLP, the same against autofuse's bf16 MLP, and each MLP's
relative error against the bf16 model's output (eager bf16). Needs a GPU of
compute capability 8.9 or newer.
"""

from __future__ import annotations

import time

import harness
import torch
from never_slower import draw_shapes, geomean, liger_gate, measure, mlp_providers

import autofuse
from autofuse.ops.gated_act import gated_activation
from autofuse.ops.linear_w8a8 import scaled_mm, scaled_mm_fits

PEERS = ("eager", "torch.compile", "liger")


def fp8_twin(module, weights: str):
    """get_mlp(weights=`weights`, fp8 or w8a8) holding `module`'s weights quantized."""
    fp8 = autofuse.get_mlp(module.d_model, module.d_ff, activation=module.activation, dtype=torch.bfloat16,
                           device="cuda", weights=weights)
    dense = {name: p.detach().contiguous() for name, p in module.state_dict().items()}
    fp8.load_state_dict(dense)
    return fp8


def scaled_mm_mlp(w8a8):
    """The library path of a W8A8 MLP: torch._scaled_mm (fp8 tensor cores, rowwise scales) for gate, up and down,
    each input quantized per row by PyTorch's ops (linear_w8a8.scaled_mm), and one pointwise pass act(G) * U, on
    `w8a8`'s quantized weights; None where _scaled_mm cannot run the sizes (d_model and d_ff must be multiples of
    16)."""
    if not scaled_mm_fits(w8a8.d_model, w8a8.d_ff):
        return None
    projections = [(m.weight_fp8, m.weight_scale, m.bias) for m in (w8a8.gate_proj, w8a8.up_proj, w8a8.down_proj)]

    def project(x, w8, scale, bias):
        y = scaled_mm(x, w8, scale)
        return y if bias is None else y + bias

    def forward(x):
        (wg, sg, bg), (wu, su, bu), (wd, sd, bd) = projections
        h = gated_activation(project(x, wg, sg, bg), project(x, wu, su, bu), w8a8.activation)
        return project(h, wd, sd, bd)

    return forward


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
            for weights in ("fp8", "w8a8"):
                providers[f"autofuse-{weights}"] = fp8_twin(providers["autofuse"], weights)
            scaled_mm = scaled_mm_mlp(providers["autofuse-w8a8"])
            if scaled_mm is not None:
                providers["scaled_mm-w8a8"] = scaled_mm
            for M in tokens:
                row = dict(**shape, **measure(providers, shape["d_model"], M, subject="autofuse-fp8", peers=PEERS))
                us = row["us"]
                row["ratio_w8a8"] = us[row["best_peer"]] / us["autofuse-w8a8"]
                if "scaled_mm-w8a8" in us:
                    row["ratio_to_scaled_mm"] = {w: us["scaled_mm-w8a8"] / us[f"autofuse-{w}"]
                                                 for w in ("fp8", "w8a8")}
                row["ratio_to_autofuse_bf16"] = {w: us["autofuse"] / us[f"autofuse-{w}"] for w in ("fp8", "w8a8")}
                row["choices"] = {w: {op: c.short() for op, c in providers[f"autofuse-{w}"].config_for(M).items()}
                                  for w in ("fp8", "w8a8")}
                rows.append(row)
                print(f"{shape['d_model']}->{shape['d_ff']} {shape['activation']} M={M}: best bf16 peer "
                      f"{row['best_peer']} {us[row['best_peer']]:.1f} us; fp8 {us['autofuse-fp8']:.1f} "
                      f"({row['ratio']:.2f}x), w8a8 {us['autofuse-w8a8']:.1f} ({row['ratio_w8a8']:.2f}x), autofuse "
                      f"bf16 {us['autofuse']:.1f}, _scaled_mm {us.get('scaled_mm-w8a8', float('nan')):.1f}; error "
                      f"against eager bf16: fp8 "
                      f"{row['rel_error']['autofuse-fp8']:.2e}, w8a8 {row['rel_error']['autofuse-w8a8']:.2e}, bf16 "
                      f"{row['rel_error']['autofuse']:.2e}", flush=True)
            del providers
            torch._dynamo.reset()
            summary = _summary(rows, start)
            harness.write(out, "fp8.json", dict(seed=args.seed, liger=liger is not None, summary=summary, rows=rows))
    print(summary, flush=True)


def _summary(rows: list[dict], start: float) -> dict:
    def of(points, key):
        ratios = [r[key] for r in points]
        return dict(points=len(ratios), geomean=geomean(ratios), min=min(ratios, default=float("nan")))

    summary = {}
    for weights, key in (("fp8", "ratio"), ("w8a8", "ratio_w8a8")):
        summary[weights] = dict(m_le_16=of([r for r in rows if r["M"] <= 16], key),
                                m_ge_1024=of([r for r in rows if r["M"] >= 1024], key), all=of(rows, key),
                                over_scaled_mm=of([dict(r=r["ratio_to_scaled_mm"][weights]) for r in rows
                                                   if "ratio_to_scaled_mm" in r], "r"),
                                max_rel_error=max((r["rel_error"][f"autofuse-{weights}"] for r in rows),
                                                  default=float("nan")))
    return dict(**summary, seconds=time.perf_counter() - start)


if __name__ == "__main__":
    main()
