"""RMSNorm on the device: autofuse's one-pass kernel (FusedRMSNorm, what `fuse(model)` installs) against the
Hugging Face module run eagerly, the same module under torch.compile, and Liger's LigerRMSNorm, in bf16.

  python benchmarks/norms.py [--out DIR] [--rows 1,16,128,1024,4096,16384]

Per (form, width, M): CUDA-graph-replayed GPU time of each provider, replayed in turn (timing.graph_side_by_side_ms);
at M <= 16 also the plain call's time (host included: N back-to-back calls / N, round-robin medians). Errors
against float64 at M=128. Widths: the public models' and a few no model uses (odd ones among them).
"""

from __future__ import annotations

import json
import statistics

import harness
import torch
import transformers

from autofuse.norm import FusedRMSNorm
from autofuse.ops import get
from autofuse.timing import graph_side_by_side_ms
from autofuse.tools.measure import plain_call_us

FAMILIES = {  # form -> (Hugging Face module, Liger's offset and casting mode)
    "one_plus_weight": (transformers.models.gemma.modeling_gemma.GemmaRMSNorm, 1.0, "gemma"),
    "weight": (transformers.models.llama.modeling_llama.LlamaRMSNorm, 0.0, "llama"),
}
WIDTHS = (2048, 3072, 4096, 8192, 2880, 1000, 5001)


def _liger(width: int, eps: float, offset: float, casting: str, weight: torch.Tensor):
    try:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
    except ImportError:
        return None
    module = LigerRMSNorm(width, eps=eps, offset=offset, casting_mode=casting, in_place=False).to("cuda", weight.dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module


def providers(form: str, width: int, eps: float = 1e-6) -> dict:
    hf_class, offset, casting = FAMILIES[form]
    hf = hf_class(width, eps=eps).to("cuda", torch.bfloat16)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(width) * 0.5 + (0.0 if offset else 1.0))
    found = {"eager": hf, "torch.compile": torch.compile(hf),
             "autofuse": FusedRMSNorm(hf.weight, eps, form)}
    liger = _liger(width, eps, offset, casting, hf.weight)
    if liger is not None:
        found["liger"] = liger
    return found


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--rows", default="1,16,128,1024,4096,16384")
    args = parser.parse_args()
    rows_list = [int(m) for m in args.rows.split(",")]
    # One compiled module per (form, width), each recompiled once for a dynamic M: past Dynamo's default
    # limit of recompiles per code object the later ones would silently run eagerly.
    torch._dynamo.config.recompile_limit = 1024
    meta = dict(transformers=transformers.__version__)
    results = []
    reference = get("rms_norm").reference
    with torch.inference_mode():
        for form in FAMILIES:
            for width in WIDTHS:
                mods = providers(form, width)
                for M in rows_list:
                    x = torch.randn(1, M, width, device="cuda", dtype=torch.bfloat16) * 3
                    fns = {name: (lambda m=m: m(x)) for name, m in mods.items()}
                    gpu = {k: v * 1e3 for k, v in graph_side_by_side_ms(fns, budget_ms=40).items()}
                    row = dict(form=form, width=width, M=M, gpu_us=gpu)
                    peers = {k: v for k, v in gpu.items() if k != "autofuse"}
                    best = min(peers, key=peers.get)
                    row["best_peer"], row["ratio"] = best, peers[best] / gpu["autofuse"]
                    if M <= 16:
                        row["plain_us"] = plain_call_us(fns, calls=400)
                    if M == 128:
                        ref = reference({"x": x, "w": mods["eager"].weight, "eps": 1e-6}, form, torch.bfloat16)
                        row["error"] = {k: ((fn().double() - ref).norm() / ref.norm()).item() for k, fn in fns.items()}
                    results.append(row)
                    plain = "" if "plain_us" not in row else "  plain " + " ".join(
                        f"{k} {v:.1f}" for k, v in row["plain_us"].items())
                    print(f"{form:16s} {width:5d} M={M:5d}  " + " ".join(f"{k} {v:.1f}" for k, v in gpu.items())
                          + f"  best peer {best} ratio {row['ratio']:.3f}{plain}", flush=True)
    harness.write(harness.out_dir(args.out), "norms.json", dict(meta=meta, rows=results))
    ratios = [r["ratio"] for r in results]
    geo = statistics.geometric_mean(ratios)
    print(json.dumps(dict(meta=meta, points=len(ratios), min_ratio=min(ratios), geomean=geo)))


if __name__ == "__main__":
    main()
