"""End to end: a Gemma-shaped causal LM (random weights, gemma-2b's real MLP and attention dims, a
few layers), unfused eager against autofuse.fuse(model), side by side in one process. (Issue 6.)

  python benchmarks/hf_bench.py --out DIR [--layers 4]

Forward: do_bench median (L2 flushed) of model(input_ids) at batch x sequence = M tokens; at M <= 128
also the forward replayed from a CUDA graph (GPU time, no host launch cost; CUDA events, median).
generate: wall time of greedy model.generate (KV cache, 64 new tokens after a 128-token prompt),
median of 5 runs after a warm-up, CUDA-synchronised; per-token time = total / new tokens. The two
models share nothing but their initial weights (a deep copy), and are timed alternately.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import torch
import transformers
import triton
import triton.testing

import autofuse
from autofuse.tools.measure import graph_replay_us


def _model(layers: int) -> torch.nn.Module:
    # gemma-2b: hidden 2048, intermediate 16384, 8 heads of 256, 1 KV head. Vocabulary cut to 32000
    # (gemma-2b: 256000) so that the LM head does not hide the MLPs; said in RESULTS.
    config = transformers.GemmaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=16384,
                                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=1,
                                      head_dim=256, max_position_embeddings=8192,
                                      hidden_activation="gelu_pytorch_tanh")
    torch.manual_seed(0)
    return transformers.GemmaForCausalLM(config).to("cuda", torch.bfloat16).eval()


def _generate_ms(model, prompt, new_tokens: int) -> float:
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       pad_token_id=0)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])  # the first run warms up


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    eager = _model(args.layers)
    fused = copy.deepcopy(eager)
    report = autofuse.fuse(fused)
    rows = []
    with torch.no_grad():
        for batch, seq in ((1, 1), (1, 16), (1, 128), (1, 4096), (4, 4096)):
            ids = torch.randint(0, 32000, (batch, seq), device="cuda")
            ref = eager(ids).logits.float()
            got = fused(ids).logits.float()
            row = dict(kind="forward", batch=batch, seq=seq, M=batch * seq,
                       logits_rel_error=((got - ref).norm() / ref.norm()).item(),
                       mlp_configs=fused.model.layers[0].mlp._fused.config_sources(batch * seq))
            for name, model in (("eager", eager), ("autofuse", fused), ("eager_again", eager)):
                row[f"{name}_ms"] = triton.testing.do_bench(lambda m=model: m(ids), warmup=10, rep=100,
                                                            return_mode="median")
                if batch * seq <= 128:  # decode sizes: also the GPU time without host launch cost
                    try:
                        row[f"{name}_graph_replay_us"] = graph_replay_us(lambda m=model: m(ids, use_cache=False),
                                                                         replays=20, calls_per_graph=2)
                    except Exception as e:  # noqa: BLE001 - a forward that cannot be captured is reported
                        row[f"{name}_graph_replay_us"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
            print(json.dumps(row), flush=True)
        prompt = torch.randint(0, 32000, (1, 128), device="cuda")
        new = 64
        tokens_eager = eager.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
        tokens_fused = fused.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
        row = dict(kind="generate", prompt=128, new_tokens=new,
                   same_tokens=int((tokens_eager == tokens_fused).sum().item()) - 128)
        for name, model in (("eager", eager), ("autofuse", fused), ("eager_again", eager)):
            row[f"{name}_ms"] = _generate_ms(model, prompt, new)
            row[f"{name}_ms_per_token"] = row[f"{name}_ms"] / new
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out, "hf_bench.json").write_text(json.dumps(dict(
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        transformers=transformers.__version__, layers=args.layers, report=str(report), rows=rows)))


if __name__ == "__main__":
    main()
