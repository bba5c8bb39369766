"""First use: the wall time of a module's first forward at a token count nobody tuned, on an empty cache, and
what it goes to (the first-use checks, choose/check.py, and the Triton compiles inside them); then the plain
(un-graphed) calls that follow, in windows of 50 calls, against eager PyTorch's: what the un-graphed race
(choose/race.py) costs while it runs, and after how many calls it has decided.

  python benchmarks/first_use.py [--out DIR] [--shapes 6] [--tokens 1,16,128,1024] [--seed 36] [--calls 2000]
      [--race-log]

Gated MLPs drawn by a seeded generator (d_model 896-4096, d_ff 2-4x d_model, every other d_ff not a multiple
of 8), none in the shipped files, bf16, each shape's modules built fresh. Run with AUTOFUSE_CACHE_DIR pointing
at an empty folder; Triton's compile cache is a fresh folder of this process (TRITON_CACHE_DIR), so the first
shape compiles cold and later ones reuse what an earlier shape compiled where Triton's specialisation allows,
as a deployment's process would. Per (shape, M): the first forward's wall time (synchronised), the seconds its
checks took and the seconds of compiling inside them (in this process: where compile workers took a kernel,
loading what they compiled; AUTOFUSE_COMPILE_WORKERS=0 compiles here alone); then --calls plain calls of the
module and of eager PyTorch's MLP on the same weights, in turn by windows of 50 (each window synchronised at its
ends), µs per call per window, the worst window's ratio autofuse / eager after the first call, and the calls the
race took; per window also the ms Python's garbage collector ran in autofuse's window and in eager's, and
autofuse's background threads alive after it (compile workers, a check's store); with --race-log also each
window the race timed (the call that ended it, the table, µs a call, its checkpoints, whether it ran whole or ended
at a checkpoint, and whether it dropped the table), each window it started again, and its first call's host-time
estimates. The summary counts the windows over 1.25x eager's, and of them those in which the collector ran during
autofuse's calls.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import statistics
import tempfile
import threading
import time

import harness

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-cache-"))

import torch  # noqa: E402 - after TRITON_CACHE_DIR: Triton reads it when first imported

import autofuse  # noqa: E402
from autofuse import evaluator  # noqa: E402
from autofuse.choose import check  # noqa: E402
from autofuse.choose.race import race_length  # noqa: E402


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


WINDOW = 50


class _GcClock:
    """Milliseconds Python's garbage collector ran, summed, while installed (gc.callbacks): a window's time
    holds them as it holds any other host stall."""

    def __init__(self) -> None:
        self.ms, self._start = 0.0, 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._start) * 1e3

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


def _window_us(fn, calls: int = WINDOW) -> tuple[float, float, int]:
    """(µs a call over `calls` calls, ms of garbage collection in them, autofuse's background threads alive at
    the end: compile workers' and a check's store)."""
    torch.cuda.synchronize()
    with _GcClock() as collected:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        us = (time.perf_counter() - start) / calls * 1e6
    return us, collected.ms, sum(t.name.startswith("autofuse") for t in threading.enumerate())


def plain_windows(mlp, x: torch.Tensor, calls: int) -> dict:
    """Windows of plain calls after the first, autofuse's and eager's in turn on the same weights."""
    wg, wu, wd = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    act = torch.nn.functional.silu if mlp.activation == "silu" else (
        lambda t: torch.nn.functional.gelu(t, approximate="tanh"))

    def eager():
        return torch.nn.functional.linear(act(torch.nn.functional.linear(x, wg)) * torch.nn.functional.linear(x, wu),
                                          wd)

    ours, theirs, gc_ms, threads = [], [], [], []
    with torch.no_grad():
        eager()
        for _ in range(calls // WINDOW):
            us, ours_gc, alive = _window_us(lambda: mlp(x))
            ours.append(us)
            eager_us, eager_gc, _ = _window_us(eager)
            theirs.append(eager_us)
            gc_ms.append([round(ours_gc, 3), round(eager_gc, 3)])
            threads.append(alive)
    entry = harness.race_of(mlp, x.shape[0])
    decided_after = None  # no race: the entry has one table, which runs from the first call
    race_windows = None
    if entry is not None:
        decided_after = "undecided" if entry.plain is None else entry.decided_after  # the call that settled it
        race_windows = entry.windows  # with --race-log: each window the race timed, which table, µs a call
    # Against eager's median window too: a window's host can stall for milliseconds (both providers' windows
    # showed such spikes, 3-8x their neighbours), and the window beside it is then no measure of eager's call.
    eager_us = statistics.median(theirs)
    return dict(autofuse_us=ours, eager_us=theirs, worst_ratio=max(o / e for o, e in zip(ours, theirs)),
                worst_over_eager_median=max(ours) / eager_us,
                windows_over_1_25=sum(o > 1.25 * e for o, e in zip(ours, theirs)),
                # of them, those in which the garbage collector ran during autofuse's calls (a pause of the process)
                windows_over_1_25_with_collection=sum(o > 1.25 * e and ms[0] > 0
                                                      for o, e, ms in zip(ours, theirs, gc_ms)),
                windows_over_1_25_eager_median=sum(o > 1.25 * eager_us for o in ours),
                steady_ratio=statistics.median(o / e for o, e in zip(ours[-5:], theirs[-5:])), race=decided_after,
                gc_ms=gc_ms, background_threads=threads,
                **({"race_windows": race_windows} if race_windows is not None else {}))


def first_forward(d: int, f: int, activation: str, M: int, calls: int) -> dict:
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
    row = dict(d_model=d, d_ff=f, activation=activation, M=M, first_s=first, checks_s=checks.seconds,
               compiles_s=compiles.seconds, second_s=second, sources=mlp.config_sources(M),
               choices={op: c.short() for op, c in mlp.config_for(M).items()})
    if calls:
        row["plain"] = plain_windows(mlp, x, calls)
    return row


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--shapes", type=int, default=6)
    parser.add_argument("--tokens", default="1,16,128,1024")
    parser.add_argument("--seed", type=int, default=36)
    parser.add_argument("--race-log", action="store_true",
                        help="keep each race's windows (which table, calls, us a call, checkpoints, whole or ended) "
                             "in the JSON, beside the windows of 50 they fall in")
    parser.add_argument("--calls", type=int, default=2000,
                        help=f"plain calls after the first (0: none; a race of 12 tables takes at most "
                             f"{race_length(12)})")
    args = parser.parse_args()
    if args.race_log:
        logging.getLogger("autofuse").setLevel(logging.DEBUG)  # races made from now on keep their windows
    out = harness.out_dir(args.out)
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for d, f, activation in draw(args.seed, args.shapes):
        for M in tokens:
            row = first_forward(d, f, activation, M, args.calls if M <= 256 else 0)
            rows.append(row)
            print(f"{d}->{f} {activation} M={M}: first {row['first_s']:.2f} s (checks {row['checks_s']:.2f}, "
                  f"compiles {row['compiles_s']:.2f}), second {row['second_s'] * 1e3:.2f} ms {row['sources']}"
                  + (f"; plain windows: worst {row['plain']['worst_ratio']:.2f}x eager beside it "
                     f"({row['plain']['worst_over_eager_median']:.2f}x eager's median; windows over 1.25x: "
                     f"{row['plain']['windows_over_1_25']}, {row['plain']['windows_over_1_25_eager_median']}), steady "
                     f"{row['plain']['steady_ratio']:.2f}x ({_race(row['plain']['race'])})" if "plain" in row else ""),
                  flush=True)
        harness.write(out, "first_use.json", dict(rows=rows, summary=_summary(rows, tokens)))
    print(_summary(rows, tokens))


def _race(decided_after) -> str:
    if decided_after is None:
        return "nothing to race"
    return "race undecided" if decided_after == "undecided" else f"race settled at call {decided_after}"


def _summary(rows: list[dict], tokens: list[int]) -> dict:
    summary = {}
    for M in tokens:
        at = [r for r in rows if r["M"] == M]
        if at:
            summary[f"M={M}"] = {key: statistics.median(r[key] for r in at)
                                 for key in ("first_s", "checks_s", "compiles_s", "second_s")}
            plain = [r["plain"] for r in at if "plain" in r]
            if plain:
                summary[f"M={M}"].update(
                    worst_window_ratio=max(p["worst_ratio"] for p in plain),
                    worst_window_over_eager_median=max(p["worst_over_eager_median"] for p in plain),
                    windows_over_1_25=sum(p["windows_over_1_25"] for p in plain),
                    windows_over_1_25_with_collection=sum(p["windows_over_1_25_with_collection"] for p in plain),
                    windows_over_1_25_eager_median=sum(p["windows_over_1_25_eager_median"] for p in plain),
                    windows=sum(len(p["autofuse_us"]) for p in plain),
                    race_settled_by_call=max((p["race"] for p in plain if isinstance(p["race"], int)), default=None),
                    races_undecided=sum(p["race"] == "undecided" for p in plain))
    return summary


if __name__ == "__main__":
    main()
