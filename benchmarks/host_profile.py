"""Where host time goes on the device (issue 15): cProfile of one autofuse MLP call on a tiny shape at
M=1 (the GPU never waits), and of greedy generate of a 4-layer Gemma-shaped model, unfused and fused.

  python benchmarks/host_profile.py --out DIR
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import time
from pathlib import Path

import torch
import transformers

import autofuse
from autofuse.timing import host_profile_text


def _profile(fn, sort: str, top: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(sort).print_stats(top)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    out = Path(args.out)
    mlp = autofuse.get_mlp(64, 128, activation="gelu_tanh", dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1, 64, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        mlp(x)
        (out / "tiny_mlp.txt").write_text(host_profile_text(lambda: mlp(x), calls=2000, top=30))
    config = transformers.GemmaConfig(hidden_size=2048, intermediate_size=16384, num_hidden_layers=4,
                                      hidden_activation="gelu_pytorch_tanh", num_attention_heads=8,
                                      num_key_value_heads=1, head_dim=256, vocab_size=32000)
    torch.manual_seed(0)
    eager = transformers.GemmaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    fused = copy.deepcopy(eager)
    autofuse.fuse(fused, verbose=False)
    prompt = torch.randint(0, 32000, (1, 128), device="cuda")
    with torch.no_grad():
        for name, model in (("eager", eager), ("fused", fused), ("eager_again", eager), ("fused_again", fused)):
            def generate(model=model):
                return model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
            generate()
            torch.cuda.synchronize()
            start = time.perf_counter()
            generate()
            torch.cuda.synchronize()
            print(f"{name} generate 32 tokens: {(time.perf_counter() - start) * 1e3:.1f} ms", flush=True)
            if not name.endswith("again"):
                (out / f"generate_{name}.txt").write_text(_profile(generate, "tottime", 40))
    print((out / "tiny_mlp.txt").read_text()[:3500])
    print((out / "generate_fused.txt").read_text()[:4500])


if __name__ == "__main__":
    main()
