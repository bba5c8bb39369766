"""The "never slower" sweep: autofuse on shapes nobody tuned, against the best peer.

  python benchmarks/never_slower.py [--out DIR] [--mlps 12] [--linears 4]
      [--tokens 1,2,5,16,48,77,128,300,1000,2048,5000] [--public] [--write-shapes FILE] [--race-log]

--public adds public model shapes (PUBLIC_MLPS, PUBLIC_LINEARS) after the drawn ones; `--mlps 0 --linears 0
--public` times those alone. --race-log keeps, in each row with an un-graphed race, the windows the race timed.

Shapes come from a seeded generator (d_model 512-8192, d_ff 1-8x d_model, some not multiples of 8 or
64; activations gelu_tanh / silu, Linear with a bias and gelu_tanh), none of them in the shipped files.
Run it with an empty user cache (AUTOFUSE_CACHE_DIR pointing at a fresh folder): every config autofuse
runs then comes from a first-use check (choose/check.py), a shipped file or a library path. Per
shape and M: CUDA-graph-replayed GPU time (median of replays of 10 back-to-back calls, the providers
replayed in turn) of eager PyTorch, torch.compile (default mode), Liger (where installed; gated MLPs)
and autofuse, all in this process; the ratio is the best peer's time over autofuse's (>= 1: autofuse at least as fast).
"""

from __future__ import annotations

import json
import logging
import math
import random
import statistics
import time
from pathlib import Path

import harness
import torch
import torch.nn.functional as F

import autofuse
from autofuse.choose.race import race_length
from autofuse.reference import eager_linear, eager_mlp
from autofuse.tools.measure import graph_replay_round_robin, launch_hooks, plain_call_us

ACT = {"gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu}


# Public models' MLP blocks and two Linear widths (not drawn: --public).
PUBLIC_MLPS = (
    dict(d_model=2048, d_ff=16384, activation="gelu_tanh", name="gemma-2b"),
    dict(d_model=3072, d_ff=24576, activation="gelu_tanh", name="gemma-7b"),
    dict(d_model=4096, d_ff=14336, activation="silu", name="llama-3-8b"),
    dict(d_model=3584, d_ff=18944, activation="silu", name="qwen2.5-7b"),
)
PUBLIC_LINEARS = (
    dict(in_features=4096, out_features=16384, activation="gelu_tanh", name="4096->16384"),
    dict(in_features=2560, out_features=10240, activation="gelu_tanh", name="2560->10240"),
)


def draw_shapes(seed: int, mlps: int, linears: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(seed)

    def width(low: int, high: int) -> int:
        value = rng.randint(low, high)
        kind = rng.random()
        if kind < 0.5:
            return value // 64 * 64 or 64  # aligned to 64
        if kind < 0.8:
            return value // 8 * 8 or 8  # a multiple of 8, not of 64
        return value | 1  # odd: rows of the next GEMM are not 16-byte aligned

    gated = []
    for _ in range(mlps):
        d = width(512, 8192)
        gated.append(dict(d_model=d, d_ff=width(d, min(8 * d, 28672)), activation=rng.choice(list(ACT))))
    linear = [dict(in_features=width(512, 8192), out_features=width(512, 16384), activation="gelu_tanh")
              for _ in range(linears)]
    return gated, linear


def shapes_document(gated: list[dict], linear: list[dict], tokens: list[int],
                    indices: list[int] | None = None) -> dict:
    """The drawn shapes (those at `indices` of the MLPs, default all) as an `autofuse tune --shapes` document
    (names drawn-mlp-i / drawn-linear-i, i the drawn index)."""
    picked = range(len(gated)) if indices is None else indices
    return {
        "dtype": "bfloat16",
        "tokens": tokens,
        "mlps": [dict(name=f"drawn-mlp-{i}", bias=False, **gated[i]) for i in picked],
        "linears": [dict(name=f"drawn-linear-{i}", bias=True, **shape) for i, shape in enumerate(linear)],
    }


def write_shapes(path: str, gated: list[dict], linear: list[dict], tokens: list[int]) -> None:
    """The drawn shapes as an `autofuse tune --shapes` file (names drawn-mlp-i / drawn-linear-i)."""
    Path(path).write_text(json.dumps(shapes_document(gated, linear, tokens), indent=1) + "\n")


def liger_gate():
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return None
    return {"gelu_tanh": LigerGELUMulFunction.apply, "silu": LigerSiLUMulFunction.apply}


def max_autotune(fn):
    """torch.compile max-autotune-no-cudagraphs of `fn`, to be called at one M alone (static shapes): what Inductor's
    max-autotune makes of one shape. A sweep compiles one such function per M beside torch.compile's default one, so
    Dynamo's recompile limits are raised to hold them."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    torch._dynamo.config.recompile_limit = max(getattr(torch._dynamo.config, "recompile_limit", 8), 64)
    return torch.compile(fn, mode="max-autotune-no-cudagraphs", dynamic=False)


def mlp_providers(shape: dict, liger) -> dict:
    d, f, act = shape["d_model"], shape["d_ff"], shape["activation"]
    module = autofuse.get_mlp(d, f, activation=act, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    # The peers run on plain parameters, as a PyTorch model holds them (autofuse keeps an odd d_ff's
    # in padded storage, autofuse/layout.py; contiguous() copies only those).
    wg, wu, wd = (p.detach().contiguous() for p in (module.gate_proj.weight, module.up_proj.weight,
                                                     module.down_proj.weight))

    def eager(x):
        return eager_mlp(x, wg, wu, wd, activation=act)

    providers = {"eager": eager, "torch.compile": torch.compile(eager), "autofuse": module}
    if liger is not None:
        gate = liger[act]
        providers["liger"] = lambda x: F.linear(gate(F.linear(x, wg), F.linear(x, wu)), wd)
    return providers


def linear_providers(shape: dict) -> dict:
    module = autofuse.get_linear(shape["in_features"], shape["out_features"], bias=True,
                                 activation=shape["activation"], dtype=torch.bfloat16, device="cuda")
    w, b = module.weight, module.bias

    def eager(x):
        return eager_linear(x, w, b, None, "gelu_tanh")

    return {"eager": eager, "torch.compile": torch.compile(eager), "autofuse": module}


def measure(providers: dict, d_in: int, M: int, subject: str = "autofuse",
            peers: tuple[str, ...] | None = None, time_plain: bool | None = None) -> dict:
    """One point: every provider's error against eager's output and graph-replayed time, and its plain calls' time
    where `time_plain` (default: at M <= PLAIN_M); `ratio` is the best of `peers` (default: every provider but
    `subject`) over `subject`."""
    x = torch.randn(M, d_in, device="cuda", dtype=torch.bfloat16)
    ref = providers["eager"](x).float()
    errors = {}
    for name, fn in providers.items():
        out = fn(x)  # first calls: compile, first-use checks
        errors[name] = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    # Prefill calls take up to tens of milliseconds: fewer calls per graph there (a replay of 2 such calls is
    # far above the events' resolution). 30 replays: on the H100, 8 replays timed autofuse running eager's
    # own library path 3.4% slower than eager at M=5000.
    times = graph_replay_round_robin({name: (lambda fn=fn: fn(x)) for name, fn in providers.items()},
                                     replays=50 if M < 1000 else 30,
                                     calls_per_graph=10 if M < 1000 else 2)
    peers = [name for name in times if name != subject] if peers is None else [p for p in peers if p in times]
    best = min(peers, key=times.get)
    row = dict(M=M, us=times, rel_error=errors, best_peer=best, ratio=times[best] / times[subject])
    if (M <= PLAIN_M) if time_plain is None else time_plain:
        # Steady state: each autofuse module's plain calls until its un-graphed race (choose/race.py) has decided,
        # RACE_CALLS at most (what those calls cost is first_use.py's to measure); plain_call_us warms the others.
        for fn in providers.values():
            settled = getattr(fn, "plain_config_for", None)
            if settled is None:
                continue
            for _ in range(RACE_CALLS):
                if settled(M) is not None:
                    break
                fn(x)
        plain = plain_call_us({name: (lambda fn=fn: fn(x)) for name, fn in providers.items()}, calls=100, rounds=5)
        plain_best = min(peers, key=plain.get)
        row.update(plain_us=plain, plain_best_peer=plain_best, plain_ratio=plain[plain_best] / plain[subject],
                   # the subject's plain call again with no other provider in between, and whether a launch hook
                   # (which bound launches decline, autofuse/bound.py) was set: where the two plain times differ.
                   plain_alone_us=plain_call_us({subject: lambda: providers[subject](x)}, calls=100,
                                                rounds=3)[subject],
                   launch_hooks=sum(launch_hooks().values()))
    return row


# Up to this M the plain call's time (host included, un-graphed) is measured too, after RACE_CALLS calls: the most
# a race of 12 tables takes (choose/race.py).
PLAIN_M = 16
RACE_CALLS = race_length(12)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--mlps", type=int, default=12)
    parser.add_argument("--linears", type=int, default=4)
    parser.add_argument("--tokens", default="1,2,5,16,48,77,128,300,1000,2048,5000")
    parser.add_argument("--public", action="store_true", help="add the public model shapes after the drawn ones")
    parser.add_argument("--write-shapes", metavar="FILE", default=None,
                        help="write the drawn shapes and --tokens as a shapes file for `autofuse tune`, then stop "
                             "(the tuned rerun: tune them, then run this sweep again on that cache)")
    parser.add_argument("--race-log", action="store_true",
                        help="keep each un-graphed race's windows (which table, calls, us a call, checkpoints) in its "
                             "row of the JSON")
    args = parser.parse_args()
    args.out = harness.out_dir(args.out)
    if args.write_shapes:
        write_shapes(args.write_shapes, *draw_shapes(args.seed, args.mlps, args.linears),
                     [int(t) for t in args.tokens.split(",")])
        return
    # The first-use checks' decisions, with the times they compared (choose/check.py).
    handler = logging.FileHandler(Path(args.out, "checks.log"))
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.setLevel(logging.INFO)
    logging.getLogger("autofuse").addHandler(handler)
    # With --race-log the races made from now on keep their windows (choose/race.py), each row then holding them.
    logging.getLogger("autofuse").setLevel(logging.DEBUG if args.race_log else logging.INFO)
    tokens = [int(t) for t in args.tokens.split(",")]
    gated, linear = draw_shapes(args.seed, args.mlps, args.linears)
    if args.public:
        gated, linear = gated + list(PUBLIC_MLPS), linear + list(PUBLIC_LINEARS)
    liger = liger_gate()
    rows = []
    start = time.perf_counter()
    with torch.no_grad():
        for kind, shapes in (("mlp", gated), ("linear", linear)):
            for shape in shapes:
                providers = mlp_providers(shape, liger) if kind == "mlp" else linear_providers(shape)
                d_in = shape.get("d_model", shape.get("in_features"))
                for M in tokens:
                    row = dict(kind=kind, **{"name": "drawn", **shape}, **measure(providers, d_in, M))
                    row["sources"] = providers["autofuse"].config_sources(M)
                    row["choices"] = {op: c.short() for op, c in providers["autofuse"].config_for(M).items()}
                    race = harness.race_of(providers["autofuse"], M)
                    if race is not None and race.windows is not None:  # --race-log
                        row["race"] = dict(decided_after=race.decided_after, voided=race.voided, windows=race.windows)
                    plain_choices = providers["autofuse"].plain_config_for(M)
                    if plain_choices is not None and plain_choices != providers["autofuse"].config_for(M):
                        row["plain_choices"] = {op: c.short() for op, c in plain_choices.items()}
                    rows.append(row)
                    print(f"{kind} {d_in}->{shape.get('d_ff', shape.get('out_features'))} {shape['activation']} "
                          f"M={M}: ratio {row['ratio']:.3f} (autofuse {row['us']['autofuse']:.1f} us, best peer "
                          f"{row['best_peer']} {row['us'][row['best_peer']]:.1f})"
                          + (f", plain call {row['plain_ratio']:.3f} (autofuse {row['plain_us']['autofuse']:.1f} us, "
                             f"{row['plain_best_peer']} {row['plain_us'][row['plain_best_peer']]:.1f}); "
                             if "plain_ratio" in row else "; ")
                          + f"{ {op: src.split(':')[0] for op, src in row['sources'].items()} }", flush=True)
                del providers
                torch._dynamo.reset()
                _write(args, liger, rows, start)
    summary = _write(args, liger, rows, start)
    print(json.dumps(summary), flush=True)


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(map(math.log, values))) if values else float("nan")


def _write(args, liger, rows: list[dict], start: float) -> dict:
    """never_slower.json with the rows so far: written after every shape, so that a run cut short by a
    time limit still leaves what it measured."""
    ratios = [r["ratio"] for r in rows]
    summary = dict(points=len(rows), min_ratio=min(ratios, default=float("nan")),
                   below_0_97=sum(r < 0.97 for r in ratios),
                   geomean_m_le_128=geomean([r["ratio"] for r in rows if r["M"] <= 128]),
                   geomean_m_ge_1024=geomean([r["ratio"] for r in rows if r["M"] >= 1024]),
                   seconds=time.perf_counter() - start)
    plain = [r["plain_ratio"] for r in rows if "plain_ratio" in r]
    summary[f"plain_call_m_le_{PLAIN_M}"] = dict(points=len(plain), geomean=geomean(plain),
                                                 min=min(plain, default=float("nan")),
                                                 below_1=sum(r < 1.0 for r in plain))
    for kind in ("mlp", "linear"):  # gated MLPs and Linears apart, at M >= 1024
        prefill = [r["ratio"] for r in rows if r["kind"] == kind and r["M"] >= 1024]
        summary[f"{kind}_m_ge_1024"] = dict(points=len(prefill), geomean=geomean(prefill),
                                            min=min(prefill, default=float("nan")))
    harness.write(args.out, "never_slower.json", dict(seed=args.seed, liger=liger is not None, summary=summary,
                                                      rows=rows))
    return summary


if __name__ == "__main__":
    main()
