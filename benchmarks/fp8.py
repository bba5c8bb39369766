"""MLPs with fp8 weights (weight-only, and W8A8) against the best bf16 peer, on shapes nobody tuned.

  python benchmarks/fp8.py [--out DIR] [--mlps 6] [--seed 39] [--tokens 1,2,4,8,16,64,256,1024,4096,16384]
                           [--max-autotune-tokens M,...] [--plain-tokens M,...] [--only I,...]
  python benchmarks/fp8.py --hf-decode [--out DIR] [--batches 1,16] [--layers 16] [--prompt 64] [--tune]

Gated MLPs drawn with a seeded generator (never_slower.py's: d_model 512-8192, d_ff 1-8x d_model, some not
multiples of 8 or 64), bf16 activations. Per shape and M: CUDA-graph-replayed GPU time of the bf16 peers (eager
PyTorch, torch.compile, Liger where installed, autofuse's bf16 MLP) and of autofuse's MLPs with fp8 weights
(get_mlp(weights="fp8") and weights="w8a8", the bf16 module's weights quantized), the providers replayed in turn in
this process, and at M <= 16 the plain (un-graphed) call's time too (never_slower.measure). --max-autotune-tokens:
torch.compile max-autotune-no-cudagraphs joins the bf16 peers at those M (compiled per M, static shapes; each
autotunes anew, tens of seconds a point). --plain-tokens: the plain calls are timed at those M as well (at large M a
plain call of six launches may wait on the host). --only: those of the drawn MLPs (indices), to split a run.
Run it with an empty user cache: every fp8 config then comes from a first-use check. Reported per point: the best
bf16 peer of eager / torch.compile / Liger over each fp8 MLP, the same against autofuse's bf16 MLP, and each MLP's
relative error against the bf16 model's output (eager bf16). Needs a GPU of
compute capability 8.9 or newer.

--hf-decode: a Hugging Face decode step with fp8 MLPs instead. A Llama-3.2-1B-shaped model (random weights, the real
dimensions: 16 layers, d_model 2048, d_ff 8192, 32 heads, 8 KV heads, vocab 128256), fused with bf16 MLPs
(`fuse(model)`) and with fp8 MLPs (`fuse(model, weights="fp8")`); one decode step (the model's forward of one new
token per sequence against a static KV cache holding a --prompt-token prefix) replayed from a CUDA graph at each
--batches size, beside the unfused model, the models replayed in turn for --rounds rounds (medians); the fp8
model's logits at that step against the bf16-fused model's (relative error, and how often the greedy token
agrees); greedy generate with the fp8 model. --tune runs autofuse.tune_model on both fused models at the batch
sizes first (otherwise first-use checks decide, as on an empty cache). Each step runs eagerly before its capture:
first-use checks run only outside a capture. Writes hf_fp8.json.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings

import harness
import torch
from never_slower import draw_shapes, geomean, liger_gate, max_autotune, measure, mlp_providers

import autofuse
from autofuse.ops.gated_act import gated_activation
from autofuse.ops.linear_w8a8 import scaled_mm, scaled_mm_fits

PEERS = ("eager", "torch.compile", "max-autotune", "liger")


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


LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                vocab_size=128256, max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=True,
                hidden_act="silu")


def static_cache(model, batch: int, length: int):
    """A StaticCache for `batch` sequences of `length` tokens, across the transformers versions that differ in
    its constructor."""
    import inspect

    import transformers

    params = inspect.signature(transformers.StaticCache.__init__).parameters
    kwargs = dict(config=model.config, max_cache_len=length)
    if "max_batch_size" in params:
        kwargs.update(max_batch_size=batch, device=model.device, dtype=model.dtype)
    return transformers.StaticCache(**kwargs)


class DecodeStep:
    """One model's decode step at one batch size: the prompt's prefix written into a static cache once, then the
    forward of one token per sequence at the next position, eager (`run`) or captured and replayed (`capture`,
    `replay_ms`). Where the capture fails (a model whose forward synchronises with the host), `replay_ms` times
    eager steps instead and `graphed` says so."""

    def __init__(self, model, prompt: torch.Tensor, steps: int) -> None:
        self.model = model
        batch, length = prompt.shape
        # Room for every step the caller will run: a cache may write each step one slot further (transformers 5
        # keeps its write offset on the device, where a replayed graph advances it).
        self.cache = static_cache(model, batch, length + steps + 8)
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=self.cache,
                  cache_position=torch.arange(length, device=prompt.device), use_cache=True)
        self.ids = prompt[:, -1:].clone()
        self.position = torch.tensor([length], device=prompt.device)
        self.graph = None
        self.graphed = False
        # The first step's logits: the next token's after the prompt and its last token again (later steps
        # overwrite the same slot, but a cache may count the steps it has seen).
        self.first_logits = self.run().float()

    def run(self) -> torch.Tensor:
        with torch.no_grad():
            # The same cache position every step (a cache that writes by it overwrites that slot).
            return self.model(input_ids=self.ids, past_key_values=self.cache, cache_position=self.position,
                              use_cache=True).logits

    def capture(self) -> None:
        for _ in range(3):  # first-use checks and Triton's compiles happen here, outside the capture
            self.run()
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.run()
        except RuntimeError as e:
            print(f"capture failed, timing eager steps instead: {str(e).splitlines()[0][:200]}", flush=True)
            torch.cuda.synchronize()
            return
        torch.cuda.synchronize()
        self.graph, self.graphed = graph, True

    def replay_ms(self, replays: int) -> float:
        step = self.graph.replay if self.graphed else self.run
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        step()
        start.record()
        for _ in range(replays):
            step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / replays


def hf_decode(args) -> None:
    """--hf-decode: the Hugging Face decode step (the module's docstring)."""
    import transformers

    warnings.filterwarnings("ignore", message=".*past_key_values.*")  # renamed in transformers 5; both accept it
    out = harness.out_dir(args.out)
    batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(num_hidden_layers=args.layers, **LLAMA_1B)
    unfused = transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    models = {"unfused": unfused, "bf16 fused": copy.deepcopy(unfused), "fp8 fused": copy.deepcopy(unfused)}
    autofuse.fuse(models["bf16 fused"], verbose=False)  # in place
    autofuse.fuse(models["fp8 fused"], verbose=False, weights="fp8")
    if args.tune:
        start = time.perf_counter()
        keys = sum(autofuse.tune_model(models[name], tokens=tuple(batches)) for name in ("bf16 fused", "fp8 fused"))
        print(f"tuned {keys} keys in {time.perf_counter() - start:.0f} s", flush=True)
    rows = []
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    for batch in batches:
        prompt = torch.randint(0, config.vocab_size, (batch, args.prompt), device="cuda", generator=generator)
        runs = 8 + args.rounds * (args.replays + 1)  # the steps each model runs: first, warm-up, capture, rounds
        steps = {name: DecodeStep(model, prompt, runs) for name, model in models.items()}
        for step in steps.values():
            step.capture()
        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(args.rounds):
            for name, step in steps.items():
                times[name].append(step.replay_ms(args.replays))
        ms = {name: statistics.median(v) for name, v in times.items()}
        reference, fp8 = steps["bf16 fused"].first_logits, steps["fp8 fused"].first_logits
        error = ((fp8 - reference).norm() / reference.norm()).item()
        agree = (fp8.argmax(-1) == reference.argmax(-1)).float().mean().item()
        row = dict(batch=batch, ms=ms, graphed={name: step.graphed for name, step in steps.items()},
                   fp8_over_bf16_fused=ms["bf16 fused"] / ms["fp8 fused"],
                   bf16_fused_over_unfused=ms["unfused"] / ms["bf16 fused"], logits_rel_error=error,
                   greedy_token_agreement=agree)
        rows.append(row)
        print(f"batch {batch}: decode step " + ", ".join(f"{n} {v:.3f} ms" for n, v in ms.items())
              + f"; fp8 / bf16-fused speed {row['fp8_over_bf16_fused']:.3f}x; logits error {error:.4f}, greedy "
              f"tokens agree {agree:.1%}", flush=True)
        del steps
    with torch.no_grad():
        prompt = torch.randint(0, config.vocab_size, (1, 16), device="cuda", generator=generator)
        generated = models["fp8 fused"].generate(prompt, max_new_tokens=16, do_sample=False)
    print(f"greedy generate with fp8 MLPs: {generated.shape[1] - prompt.shape[1]} new tokens", flush=True)
    harness.write(out, "hf_fp8.json", dict(layers=args.layers, prompt=args.prompt, tuned=args.tune,
                                           transformers=transformers.__version__, rows=rows,
                                           generate_new_tokens=int(generated.shape[1] - prompt.shape[1])))


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--seed", type=int, default=39)
    parser.add_argument("--mlps", type=int, default=6)
    parser.add_argument("--tokens", default="1,2,4,8,16,64,256,1024,4096,16384")
    parser.add_argument("--max-autotune-tokens", default="", help="M at which torch.compile max-autotune runs too")
    parser.add_argument("--plain-tokens", default="", help="M above 16 at which plain calls are timed too")
    parser.add_argument("--only", default=None, help="indices of the drawn MLPs to run (default: all)")
    parser.add_argument("--hf-decode", action="store_true", help="the Hugging Face decode step instead (see above)")
    parser.add_argument("--batches", default="1,16", help="--hf-decode: batch sizes")
    parser.add_argument("--layers", type=int, default=16, help="--hf-decode: decoder layers")
    parser.add_argument("--prompt", type=int, default=64, help="--hf-decode: tokens in the KV cache")
    parser.add_argument("--tune", action="store_true", help="--hf-decode: tune both fused models first")
    parser.add_argument("--replays", type=int, default=100, help="--hf-decode: graph replays per round")
    parser.add_argument("--rounds", type=int, default=5, help="--hf-decode: rounds")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        parser.exit(2, "fp8.py needs a CUDA GPU of compute capability 8.9 or newer\n")
    if args.hf_decode:
        hf_decode(args)
        return
    out = harness.out_dir(args.out)
    tokens = [int(t) for t in args.tokens.split(",")]
    autotune_at = {int(t) for t in args.max_autotune_tokens.split(",") if t}
    plain_at = {int(t) for t in args.plain_tokens.split(",") if t}
    gated, _ = draw_shapes(args.seed, args.mlps, 0)
    indices = harness.selected(parser, args.only, len(gated))
    liger = liger_gate()
    rows = []
    start = time.perf_counter()
    with torch.no_grad():
        for i in indices:
            shape = gated[i]
            providers = mlp_providers(shape, liger)
            for weights in ("fp8", "w8a8"):
                providers[f"autofuse-{weights}"] = fp8_twin(providers["autofuse"], weights)
            scaled_mm = scaled_mm_mlp(providers["autofuse-w8a8"])
            if scaled_mm is not None:
                providers["scaled_mm-w8a8"] = scaled_mm
            for M in tokens:
                fns = dict(providers)
                if M in autotune_at:
                    fns["max-autotune"] = max_autotune(providers["eager"])
                row = dict(name=f"drawn-mlp-{i}", **shape,
                           **measure(fns, shape["d_model"], M, subject="autofuse-fp8", peers=PEERS,
                                     time_plain=True if M in plain_at else None))
                us = row["us"]
                row["ratio_w8a8"] = us[row["best_peer"]] / us["autofuse-w8a8"]
                if "scaled_mm-w8a8" in us:
                    row["ratio_to_scaled_mm"] = {w: us["scaled_mm-w8a8"] / us[f"autofuse-{w}"]
                                                 for w in ("fp8", "w8a8")}
                row["ratio_to_autofuse_bf16"] = {w: us["autofuse"] / us[f"autofuse-{w}"] for w in ("fp8", "w8a8")}
                plain = ""
                if "plain_us" in row:
                    row["plain_choices"] = {w: {op: c.short() for op, c in
                                                (providers[f"autofuse-{w}"].plain_config_for(M) or {}).items()}
                                            for w in ("fp8", "w8a8")}
                    row["plain_ratio_w8a8"] = row["plain_us"][row["plain_best_peer"]] / row["plain_us"]["autofuse-w8a8"]
                    plain = (f"; plain calls: best bf16 peer {row['plain_best_peer']} "
                             f"{row['plain_us'][row['plain_best_peer']]:.1f} us, fp8 {row['plain_ratio']:.2f}x, "
                             f"w8a8 {row['plain_ratio_w8a8']:.2f}x")
                row["choices"] = {w: {op: c.short() for op, c in providers[f"autofuse-{w}"].config_for(M).items()}
                                  for w in ("fp8", "w8a8")}
                rows.append(row)
                print(f"{shape['d_model']}->{shape['d_ff']} {shape['activation']} M={M}: best bf16 peer "
                      f"{row['best_peer']} {us[row['best_peer']]:.1f} us; fp8 {us['autofuse-fp8']:.1f} "
                      f"({row['ratio']:.2f}x), w8a8 {us['autofuse-w8a8']:.1f} ({row['ratio_w8a8']:.2f}x), autofuse "
                      f"bf16 {us['autofuse']:.1f}, _scaled_mm {us.get('scaled_mm-w8a8', float('nan')):.1f}; error "
                      f"against eager bf16: fp8 "
                      f"{row['rel_error']['autofuse-fp8']:.2e}, w8a8 {row['rel_error']['autofuse-w8a8']:.2e}, bf16 "
                      f"{row['rel_error']['autofuse']:.2e}{plain}", flush=True)
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
                                plain=of([dict(r=r["plain_ratio" if weights == "fp8" else "plain_ratio_w8a8"])
                                          for r in rows if "plain_us" in r], "r"),
                                max_rel_error=max((r["rel_error"][f"autofuse-{weights}"] for r in rows),
                                                  default=float("nan")))
    return dict(**summary, seconds=time.perf_counter() - start)


if __name__ == "__main__":
    main()
