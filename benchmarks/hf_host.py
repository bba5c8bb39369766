"""Host time per call of a gemma-2b MLP at decode size (M=1) on the device, the way Hugging Face's
un-graphed generate pays it: the original GemmaMLP, FusedHFMLP, FusedMLP with the shipped configs,
and the gated up-projection launcher with the shipped config, TMA and not. (Issue 6.)

  python benchmarks/hf_host.py --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import torch
import transformers

import autofuse
from autofuse.ops.gated_up import gated_up
from autofuse.tools.measure import graph_replay_us, host_profile_text, host_us_per_call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    config = transformers.GemmaConfig(hidden_size=2048, intermediate_size=16384, hidden_activation="gelu_pytorch_tanh",
                                      num_hidden_layers=1, vocab_size=256)
    torch.manual_seed(0)
    model = transformers.GemmaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    original = model.model.layers[0].mlp
    autofuse.fuse(model)
    block = model.model.layers[0].mlp
    x = torch.randn(1, 1, 2048, device="cuda", dtype=torch.bfloat16)
    x2 = x.reshape(1, 2048)
    rows = {}
    with torch.inference_mode():
        configs = block._fused._config_table(1)
        up = configs["gated_up"].kernel if "gated_up" in configs else None
        w = (original.gate_proj.weight, original.up_proj.weight)
        fns = {"GemmaMLP (original)": lambda: original(x), "FusedHFMLP": lambda: block(x),
               "FusedMLP": lambda: block._fused(x)}
        if up is not None:
            fns[f"gated_up {up.short()}"] = lambda: gated_up(x2, *w, None, None, "gelu_tanh", up)
            plain = dataclasses.replace(up, tma=False)
            fns[f"gated_up {plain.short()}"] = lambda: gated_up(x2, *w, None, None, "gelu_tanh", plain)
        for name, fn in fns.items():
            rows[name] = dict(host_us=host_us_per_call(fn, calls=2000), graph_us=graph_replay_us(fn))
            print(f"{name:44s} host {rows[name]['host_us']:7.1f} us  graph replay {rows[name]['graph_us']:7.1f} us",
                  flush=True)
        profile = host_profile_text(lambda: block(x), calls=2000, top=25)
    print(profile[:5000])
    Path(args.out, "hf_host.json").write_text(json.dumps(dict(configs={k: str(v) for k, v in configs.items()},
                                                              rows=rows, profile=profile)))


if __name__ == "__main__":
    main()
