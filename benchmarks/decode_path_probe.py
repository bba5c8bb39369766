"""Where a decode MLP's plain call goes (issue 15): gemma-2b at M=1, bf16, each piece of the path the module
runs timed as a plain call (N back-to-back calls / N, synchronised around, medians of rounds taken in turn),
beside its CUDA-graph-replayed GPU time, and the CUDA runtime calls one module call makes.

  python benchmarks/decode_path_probe.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

import autofuse
from autofuse.ops.gated_act import pairs_activation
from autofuse.ops.gated_pairs import pairs_of
from autofuse.reference import eager_mlp
from autofuse.timing import plain_call_us, round_robin
from autofuse.tools.measure import graph_replay_round_robin, host_us_sample


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    d, f = 2048, 16384
    mlp = autofuse.get_mlp(d, f, activation="gelu_tanh", dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    wg, wu, wd = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    w_pairs, _ = pairs_of(wg, None)
    plain_pairs = w_pairs.detach().clone()
    # Eager runs on plain copies, as a PyTorch model holds its weights (the module's are strided views).
    wg_plain, wu_plain = wg.detach().contiguous(), wu.detach().contiguous()
    x = torch.randn(1, d, device="cuda", dtype=torch.bfloat16)
    gu = F.linear(x, w_pairs)
    h = pairs_activation(gu, "gelu_tanh")
    fns = {
        "eager MLP (five ops)": lambda: eager_mlp(x, wg_plain, wu_plain, wd, activation="gelu_tanh"),
        "autofuse module": lambda: mlp(x),
        "F.linear(x, interleaved view [2F, d])": lambda: F.linear(x, w_pairs),
        "F.linear(x, a plain copy of it)": lambda: F.linear(x, plain_pairs),
        "F.linear(x, wg) (one of eager's)": lambda: F.linear(x, wg),
        "pairs_act pass alone": lambda: pairs_activation(gu, "gelu_tanh"),
        "down F.linear(h, wd)": lambda: F.linear(h, wd),
        "cuBLAS over pairs + pairs_act": lambda: pairs_activation(F.linear(x, w_pairs), "gelu_tanh"),
    }
    with torch.inference_mode():
        mlp(x)
        rows = {"choices": {op: c.short() for op, c in mlp.config_for(1).items()},
                "plain_us": plain_call_us(fns, calls=300),
                # Host time alone: 20 calls queued, not awaited (timing.host_us_sample), medians of 30 rounds.
                "host_us": round_robin(fns, lambda fn: host_us_sample(fn, 20), 30),
                "graph_us": graph_replay_round_robin({k: v for k, v in fns.items()})}
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                mlp(x)
            torch.cuda.synchronize()
        rows["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    for key in ("plain_us", "host_us", "graph_us"):
        for name, value in rows[key].items():
            print(f"{key:9s} {name:42s} {value:8.1f}", flush=True)
    print(rows["choices"])
    print(rows["profile"])
    Path(args.out, "decode_path_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
