"""Hugging Face end to end: greedy generate of a 4-layer Gemma-shaped model (gemma-2b's dimensions, random
weights), unfused and fused, un-graphed: 64 new tokens after a 128-token prompt, batch 1, the models in turn
each round, the first round a warm-up, medians of the rest, and whether the fused models produce eager's
tokens. Models: eager; fused (fuse(model): MLPs and RMSNorms); fused MLPs only (fuse(model, norms=False));
eager with its MLPs removed (what any MLP could gain at most). Also where host time goes: cProfile of one
autofuse MLP call on a tiny shape at M=1 (the GPU never waits) and of generate, eager and fused.

  python benchmarks/hf_generate.py [--out DIR] [--rounds 8]
"""

from __future__ import annotations

import copy
import cProfile
import io
import pstats
import statistics
import time

import harness
import torch
import transformers

import autofuse
from autofuse.tools.measure import host_profile_text


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
    parser = harness.parser(__doc__)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    out = harness.out_dir(args.out)
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
    mlps_only = copy.deepcopy(eager)
    autofuse.fuse(mlps_only, verbose=False, norms=False)
    # The ceiling of what any MLP could gain here: the same model with its MLPs removed (an identity,
    # no kernel at all; its tokens differ, its time is what the rest of generate costs).
    without_mlp = copy.deepcopy(eager)
    for layer in without_mlp.model.layers:
        layer.mlp = torch.nn.Identity()
    prompt = torch.randint(0, 32000, (1, 128), device="cuda")
    models = {"eager": eager, "fused": fused, "fused MLPs only": mlps_only, "no MLP": without_mlp}
    times: dict[str, list[float]] = {name: [] for name in models}
    tokens = {}
    with torch.no_grad():
        for round_ in range(args.rounds):  # in turn, the first round a warm-up
            for name, model in models.items():
                torch.cuda.synchronize()
                start = time.perf_counter()
                tokens[name] = model.generate(prompt, max_new_tokens=64, min_new_tokens=64, do_sample=False,
                                              pad_token_id=0)
                torch.cuda.synchronize()
                if round_:
                    times[name].append((time.perf_counter() - start) * 1e3)
        mlp = fused.model.layers[0].mlp
        print("fused MLP choices: " + "; ".join(
            f"M={M}: " + ", ".join(f"{op} {c.short()} ({mlp.config_sources(M)[op]})"
                                   for op, c in mlp.config_for(M).items())
            for M in (1, prompt.shape[1])), flush=True)
        print("fused MLP plain-call choices: " + "; ".join(
            f"M={M}: " + ", ".join(f"{op} {c.short()}" for op, c in (mlp.plain_config_for(M) or {}).items())
            for M in (1, prompt.shape[1])), flush=True)
        same = {name: int((tokens["eager"] == tokens[name]).sum().item()) - prompt.shape[1]
                for name in ("fused", "fused MLPs only")}
        medians = {name: statistics.median(v) for name, v in times.items()}
        speedups = {name: medians["eager"] / medians[name] for name in models}
        print(f"generate 64 new tokens, batch 1, medians of {args.rounds - 1}: "
              + ", ".join(f"{name} {medians[name]:.1f} ms ({speedups[name]:.3f}x eager's tokens/s)" for name in models)
              + f"; same tokens as eager {same}; all runs {times}", flush=True)
        harness.write(out, "hf_generate.json", dict(medians_ms=medians, speedups=speedups, same_tokens=same,
                                                    runs_ms=times, transformers=transformers.__version__))
        for name in ("eager", "fused"):
            model = models[name]
            def generate(model=model):
                return model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
            (out / f"generate_{name}.txt").write_text(_profile(generate, "tottime", 40))
    print((out / "tiny_mlp.txt").read_text()[:3500])
    print((out / "generate_fused.txt").read_text()[:4500])


if __name__ == "__main__":
    main()
