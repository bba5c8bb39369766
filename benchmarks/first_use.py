"""First use: the wall time of a module's first forward at a token count nobody tuned, on an empty cache, and
what it goes to: the first-use checks (choose/check.py), the Triton compiles inside them, the rest.

  python benchmarks/first_use.py [--out DIR] [--shapes 6] [--tokens 1,16,128,1024] [--seed 36]

Gated MLPs drawn by a seeded generator (d_model 896-4096, d_ff 2-4x d_model, every other d_ff not a multiple
of 8), none in the shipped files, bf16, each shape's modules built fresh. Run with AUTOFUSE_CACHE_DIR pointing
at an empty folder; Triton's compile cache is a fresh folder of this process (TRITON_CACHE_DIR), so the first
shape compiles cold and later ones reuse what an earlier shape compiled where Triton's specialisation allows,
as a deployment's process would. Per (shape, M): the first forward's wall time (synchronised), the seconds its
checks took and the seconds of compiling inside them, and the second forward's wall time.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time

import harness

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-cache-"))

import torch  # noqa: E402 - after TRITON_CACHE_DIR: Triton reads it when first imported

import autofuse  # noqa: E402
from autofuse import evaluator  # noqa: E402
from autofuse.choose import check  # noqa: E402


def draw(seed: int, count: int) -> list[tuple[int, int, str]]:
    rng = random.Random(seed)
    shapes = []
    for i in range(count):
        d = rng.randrange(896, 4097, 64)
        f = int(d * rng.uniform(2.0, 4.0)) // 8 * 8 + (rng.choice((1, 3, 5, 7)) if i % 2 else 0)
        shapes.append((d, f, ("silu", "gelu_tanh")[i % 2]))
    return shapes


class _Clock:
    """Seconds spent inside a function, summed, while installed in place of it."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name, self.real, self.seconds = owner, name, getattr(owner, name), 0.0

    def __enter__(self):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self.real(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        setattr(self.owner, self.name, timed)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.owner, self.name, self.real)


def first_forward(d: int, f: int, activation: str, M: int) -> dict:
    mlp = autofuse.get_mlp(d, f, activation=activation, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    with torch.no_grad(), _Clock(check, "_compare") as checks, \
            _Clock(evaluator.Evaluator, "_compile_and_sync") as compiles:
        start = time.perf_counter()
        mlp(x)
        torch.cuda.synchronize()
        first = time.perf_counter() - start
    with torch.no_grad():
        start = time.perf_counter()
        mlp(x)
        torch.cuda.synchronize()
        second = time.perf_counter() - start
    return dict(d_model=d, d_ff=f, activation=activation, M=M, first_s=first, checks_s=checks.seconds,
                compiles_s=compiles.seconds, second_s=second, sources=mlp.config_sources(M),
                choices={op: c.short() for op, c in mlp.config_for(M).items()})


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--shapes", type=int, default=6)
    parser.add_argument("--tokens", default="1,16,128,1024")
    parser.add_argument("--seed", type=int, default=36)
    args = parser.parse_args()
    out = harness.out_dir(args.out)
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for d, f, activation in draw(args.seed, args.shapes):
        for M in tokens:
            row = first_forward(d, f, activation, M)
            rows.append(row)
            print(f"{d}->{f} {activation} M={M}: first {row['first_s']:.2f} s (checks {row['checks_s']:.2f}, "
                  f"compiles {row['compiles_s']:.2f}), second {row['second_s'] * 1e3:.2f} ms {row['sources']}",
                  flush=True)
        harness.write(out, "first_use.json", dict(rows=rows, summary=_summary(rows, tokens)))
    print(_summary(rows, tokens))


def _summary(rows: list[dict], tokens: list[int]) -> dict:
    summary = {}
    for M in tokens:
        at = [r for r in rows if r["M"] == M]
        if at:
            summary[f"M={M}"] = {key: statistics.median(r[key] for r in at)
                                 for key in ("first_s", "checks_s", "compiles_s", "second_s")}
    return summary


if __name__ == "__main__":
    main()
