"""Tuning from recorded traffic, end to end: a Llama-3.2-1B-shaped model (random weights, bf16, fuse(model)) runs
a short greedy generate (batch 1, a 100-token prompt, 32 new tokens) and one training step (batch 4 x 256 tokens)
with traffic recording on; then `autofuse tune --traffic` tunes from that trace into an empty user cache (and an
empty Triton cache).

  python benchmarks/traffic_tune.py [--out DIR] [--trials 30] [--time-budget S] [--keep-cache DIR]

Reports the trace (calls and recorded ms per shape and M), the tuning run's wall time (the command, process start
included), its keys and trials, and its expected-saving table. --time-budget S passes `--time-budget S` too: S
seconds a key, times the keys, spread by time share like the trials, whichever of the two ends a key first.
--keep-cache DIR tunes into DIR (which must be empty or absent) and keeps it, e.g. for `python
benchmarks/search_quality.py measure --tuned-cache DIR`, which sweeps the same model's keys and compares these
records with the sweep's best.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import torch
import transformers

import autofuse
from autofuse import traffic
from autofuse.tune.driver import DEFAULT_TRIALS


def record(folder: Path) -> dict:
    config = transformers.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                      max_position_embeddings=2048)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    autofuse.fuse(model, verbose=False)
    prompt = torch.randint(0, config.vocab_size, (1, 100), device="cuda")
    batch = torch.randint(0, config.vocab_size, (4, 256), device="cuda")
    with autofuse.record_traffic(folder / "trace.json", sample_every=4):
        model.eval()
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        for _ in range(2):  # the first step compiles and checks: the second is timed as a sample
            loss = model(batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    torch.cuda.synchronize()
    recorded = traffic.load(folder / "trace.json")
    return {shape.label(): {M: [c.calls, c.sampled, round(c.sampled_ms, 4)] for M, c in sorted(by_m.items())}
            for shape, by_m in recorded.counts.items()}


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--trials", type=int, default=DEFAULT_TRIALS)
    parser.add_argument("--time-budget", type=float, default=None, metavar="S", help="seconds a key (autofuse tune)")
    parser.add_argument("--keep-cache", default=None, help="tune into this (empty) folder and keep it")
    args = parser.parse_args()
    if args.keep_cache and Path(args.keep_cache).exists() and any(Path(args.keep_cache).iterdir()):
        parser.error(f"--keep-cache {args.keep_cache}: the folder is not empty (the run tunes into an empty cache)")
    out = harness.out_dir(args.out)
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        # An empty autofuse cache and an empty Triton cache: the tuning run compiles every kernel it times, as a
        # first tune on a machine does (a Triton cache left by an earlier run would make its compiles free).
        env = dict(os.environ, AUTOFUSE_CACHE_DIR=args.keep_cache or str(work / "cache"),
                   TRITON_CACHE_DIR=str(work / "triton"))
        os.environ["AUTOFUSE_CACHE_DIR"] = env["AUTOFUSE_CACHE_DIR"]
        os.environ["TRITON_CACHE_DIR"] = env["TRITON_CACHE_DIR"]
        trace = record(work)
        print(trace, flush=True)
        start = time.perf_counter()
        budget = [] if args.time_budget is None else ["--time-budget", str(args.time_budget)]
        done = subprocess.run([sys.executable, "-m", "autofuse", "tune", "--traffic", str(work / "trace.json"),
                               "--trials", str(args.trials), *budget], env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    print(done.stdout[-6000:], flush=True)
    if done.returncode:
        print(done.stderr[-3000:], flush=True)
    harness.write(out, "traffic_tune.json", dict(trace=trace, tune_seconds=seconds, trials=args.trials,
                                                 time_budget_s=args.time_budget, returncode=done.returncode,
                                                 output=done.stdout[-20000:]))


if __name__ == "__main__":
    main()
