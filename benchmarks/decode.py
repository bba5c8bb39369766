"""Decode at the memory wall: gated MLPs at M = 1..256 against their roofline, whole and per step.

  python benchmarks/decode.py [--out DIR] [--seed 37] [--mlps 12] [--only 0,1,2] [--tokens 1,2,4,8,16,32,64,128,256]
      [--max-autotune-tokens 1,16] [--no-max-autotune] [--write-shapes FILE]
      [--tune [--tune-trials N] [--tune-time-budget S]]
  python benchmarks/decode.py --merge A/decode.json B/decode.json [--out DIR]
  python benchmarks/decode.py --split-k [--tokens 16,64,128] [--out DIR]

`--only` runs some of the drawn shapes (by index), so that a long sweep can run in parts; `--merge` writes one
decode.json of several parts' rows with their summary.

Shapes: never_slower.py's generator with its own seed (d_model 512-8192, d_ff 1-8x d_model, some not multiples
of 8 or 64), none in the shipped files. Run it with an empty user cache (first-use checks decide), then with
--tune: `autofuse tune` of the shapes it runs at --tokens, every op (as `autofuse tune --shapes FILE` of the
shapes `--write-shapes FILE` writes), --tune-trials trials a key (or --tune-time-budget seconds, whichever ends
first), before the measurement, which then runs the tuned records.

Ceilings, measured in this process: read bandwidth (a sum over 1 GiB of bf16), copy bandwidth (a 1 GiB
device-to-device copy, bytes read + written per second; reported beside it) and the bf16 GEMM peak (an 8192^3
matmul). The roofline of an MLP at M is max(bytes / read bandwidth, FLOPs / GEMM peak) with bytes its three
weights, x and y and FLOPs 6 M d_model d_ff: at decode M an MLP reads its weights once and writes M d_model
elements, so the read ceiling is the wall (a copy, half writes, runs at 65% of it on an H200). Whole MLP:
CUDA-graph-replayed GPU time of autofuse, eager PyTorch, torch.compile (default),
torch.compile max-autotune-no-cudagraphs (compiled per M, static shapes; at --max-autotune-tokens only: each M
autotunes for tens of seconds) and Liger (where installed), each over the roofline, and at M <= 16 their plain
(un-graphed) calls too, as never_slower.py times them. Per step of the plan autofuse
runs (the up projection with act(G) * U in its epilogue, then the down projection; or the one-launch MLP): its
choice, graph-replayed µs, the bytes it must move (its weights as stored, its input and output), TB/s and the
percentage of the read ceiling.

--split-k sweeps split-K at decode sizes instead (split_k.json): the GEMM heuristic's tile of a Linear (a down
projection; N 576-6144, K 2688-16384) and of the gated up-projections (d_ff 2688 and 5376, d_model 576-4096), where
the tiles are fewer than the SMs, at split 1-16 (each program keeping two K blocks or more), graph-replayed in turn;
summary: the heuristic's split over each point's fastest (geometric mean, worst), the same for splitting until the
programs cover the SMs (the rule the fp8 decode tiles use), and the points where the unsplit tile is the fastest.
"""

from __future__ import annotations

import json
import math
import time

import harness
import never_slower
import torch
import torch.nn.functional as F
from never_slower import draw_shapes, geomean, liger_gate, mlp_providers, shapes_document, write_shapes

from autofuse import dispatch
from autofuse.launch import addresses
from autofuse.tools.measure import graph_replay_round_robin

GIB = 1 << 30
# A point's MLP weights must reach this many bytes for the wall acceptance's M <= 16 figures: below it the fixed
# cost of a launch, not the weight stream, decides.
LARGE_WEIGHTS = 50e6


def ceilings() -> dict:
    """Copy and read bandwidth (bytes/s) and the bf16 GEMM peak (FLOP/s), graph-replayed."""
    src = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    half = src.view(torch.bfloat16)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    times = graph_replay_round_robin({"copy": lambda: dst.copy_(src), "read": lambda: half.sum(),
                                      "gemm": lambda: a @ a}, replays=20, calls_per_graph=2)
    return dict(copy_bytes_per_s=2 * GIB / (times["copy"] * 1e-6), read_bytes_per_s=GIB / (times["read"] * 1e-6),
                gemm_flop_per_s=2 * 8192**3 / (times["gemm"] * 1e-6))


def roofline_us(d: int, f: int, M: int, ceiling: dict) -> float:
    weights_and_io = 2 * (3 * d * f + 2 * M * d)  # bf16
    return max(weights_and_io / ceiling["read_bytes_per_s"], 6 * M * d * f / ceiling["gemm_flop_per_s"]) * 1e6


def _bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def plan_steps(module, x: torch.Tensor, M: int) -> list[dict]:
    """The steps autofuse runs for `module` at M (its resolved table), each as a call on the operands it runs
    with (the stored layout, padded where it pads) and the bytes it must move."""
    table = module._config_table(M)
    params = module._params()
    layout = module._layout
    if layout is not None:
        wide = layout.widen(params, addresses(params))
        if wide is not None:
            params = wide
            if layout.d_in != module.d_model:
                x = F.pad(x, (0, layout.d_in - module.d_model))
    act = module.activation
    wg, bg, wu, bu, wd, bd = params
    if "mlp" in table:
        y = dispatch.run_mlp(x, params, act, table)
        return [dict(step="mlp", choice=table["mlp"].config.short(),
                     call=lambda: dispatch.run_mlp(x, params, act, table), bytes=_bytes(x, wg, wu, wd, bg, bu, bd, y))]
    up = dispatch.up_op_of(table)
    h = dispatch.run_up(x, params, act, table)
    y = dispatch.run_down(h, params, table["down"])
    return [dict(step=up, choice=table[up].config.short(), call=lambda: dispatch.run_up(x, params, act, table),
                 bytes=_bytes(x, wg, wu, bg, bu, h)),
            dict(step="down", choice=table["down"].config.short(),
                 call=lambda: dispatch.run_down(h, params, table["down"]), bytes=_bytes(h, wd, bd, y))]


def measure(shape: dict, found: dict, M: int, ceiling: dict, max_autotune: bool) -> dict:
    """never_slower.measure's row (graph-replayed and, at small M, plain-call times of every provider) with
    the roofline and autofuse's plan step by step."""
    d, f = shape["d_model"], shape["d_ff"]
    fns = dict(found)
    if max_autotune:
        fns["max-autotune"] = never_slower.max_autotune(found["eager"])
    row = never_slower.measure(fns, d, M)
    roof = roofline_us(d, f, M, ceiling)
    x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    steps = plan_steps(found["autofuse"], x, M)
    step_us = graph_replay_round_robin({s["step"]: s["call"] for s in steps}, replays=50)
    for s in steps:
        del s["call"]
        s["us"] = step_us[s["step"]]
        s["tb_per_s"] = s["bytes"] / (s["us"] * 1e-6) / 1e12
        s["pct_read_ceiling"] = 100 * s["bytes"] / (s["us"] * 1e-6) / ceiling["read_bytes_per_s"]
    return dict(row, roofline_us=roof, over_roofline={k: v / roof for k, v in row["us"].items()},
                weight_bytes=2 * 3 * d * f, steps=steps, sources=found["autofuse"].config_sources(M))


def summarize(rows: list[dict]) -> dict:
    def over(select) -> dict:
        values = [r["over_roofline"]["autofuse"] for r in rows if select(r)]
        return dict(points=len(values), geomean=geomean(values), max=max(values, default=float("nan")))

    small = [r["ratio"] for r in rows if r["M"] <= 16]
    autotuned = [r["us"]["max-autotune"] / r["us"]["autofuse"] for r in rows if "max-autotune" in r["us"]]
    return dict(points=len(rows),
                roofline_m_le_16_large=over(lambda r: r["M"] <= 16 and r["weight_bytes"] >= LARGE_WEIGHTS),
                roofline_m_le_16=over(lambda r: r["M"] <= 16), roofline_m_32_256=over(lambda r: 32 <= r["M"] <= 256),
                best_peer_m_le_16=dict(geomean=geomean(small), min=min(small, default=float("nan")),
                                       below_1=sum(v < 1 for v in small)),
                max_autotune_over_autofuse=dict(points=len(autotuned), geomean=geomean(autotuned),
                                                min=min(autotuned, default=float("nan"))))


def merge(files: list[str], out: str | None) -> None:
    """One decode.json of the rows of `files` (parts of one sweep: same seed and GPU, ceilings each part's own),
    written under the parts' GPU with their run information (the first part's, every part's command), not the
    merging machine's, and each part's `--tune` record (None where a part did not tune)."""
    parts = [json.loads(open(name).read()) for name in files]
    if len({p["seed"] for p in parts}) != 1:
        raise SystemExit("decode.py --merge: the parts were drawn with different seeds")
    runs = [p.get("run", {}) for p in parts]
    if len({r.get("gpu") for r in runs}) != 1:
        raise SystemExit("decode.py --merge: the parts ran on different GPUs")
    rows = [row for p in parts for row in p["rows"]]
    summary = summarize(rows)
    run = {**runs[0], "command": " ; ".join(r.get("command", "?") for r in runs),
           "merged_by": harness.run_info()["command"]}
    harness.write(harness.out_dir(out, runs[0].get("gpu")), "decode.json",
                  dict(seed=parts[0]["seed"], ceilings=[p["ceilings"] for p in parts],
                       liger=all(p["liger"] for p in parts), summary=summary, rows=rows,
                       seconds=sum(p["seconds"] for p in parts), parts=runs,
                       tuned=[p.get("tuned") for p in parts]), run=run)
    print(json.dumps(summary), flush=True)


def tune_drawn(gated: list[dict], indices: list[int], tokens: list[int], trials: int | None,
               time_budget_s: float | None, device: torch.device) -> dict:
    """`autofuse tune` of the drawn MLPs at `indices` at every M of `tokens`, every op (the CLI's default), `trials` a
    key (None: the CLI's default), into the user cache; what ran: keys, seconds and the budget."""
    from autofuse.shapes import parse_shapes
    from autofuse.tune.driver import DEFAULT_TRIALS, tune_shapes
    from autofuse.tune.progress import RunProgress

    trials = DEFAULT_TRIALS if trials is None else trials
    shapes = parse_shapes(shapes_document(gated, [], tokens, indices), "the drawn shapes")
    start = time.perf_counter()
    results = tune_shapes(shapes, device, trials=trials, time_budget_s=time_budget_s, progress=RunProgress())
    return dict(keys=len(results), seconds=time.perf_counter() - start, trials=trials, time_budget_s=time_budget_s)


SPLITS = (1, 2, 4, 8, 16)
SPLIT_LINEARS = [(n, k) for k in (2688, 8192, 16384) for n in (576, 1024, 2048, 3072, 4096, 6144)]
SPLIT_GATED = [(2688, 576), (2688, 1024), (2688, 2048), (5376, 4096)]  # (d_ff, d_model): fewer tiles than SMs


def split_point(op: str, n: int, k: int, M: int, device, tensors_on: str = "cuda", timer=None) -> dict:
    """The heuristic's tile of `op` at [M, K] x [K, n] timed at each split by `timer` (default: graph-replayed in
    turn, timing.graph_side_by_side_ms: {split: fn} -> {split: ms}), its operands on `tensors_on`; beside it the
    heuristic's split and the split that covers the SMs (configs._split_to_fill, the fp8 decode tiles' rule)."""
    from autofuse import ops
    from autofuse.configs import Shape, _split_to_fill, split_k, tiles, with_split_k
    from autofuse.timing import graph_side_by_side_ms

    timer = timer or (lambda runs: graph_side_by_side_ms(runs, budget_ms=20))
    spec = ops.get(op)
    heuristic = spec.default_config(Shape(M, n, k, torch.bfloat16), device)
    tile = heuristic.tile
    made = spec.make_operands(n, k, M, False, False,
                              lambda *size: torch.randn(*size, device=tensors_on, dtype=torch.bfloat16))
    activation = "none" if op == "linear" else "silu"
    configs = {s: with_split_k(tile, s) for s in SPLITS if s == 1 or -(-k // tile.block_k) >= 2 * s}
    runs = {s: (lambda c=c: spec.run(made, activation, c)) for s, c in configs.items()}
    us = {s: ms * 1e3 for s, ms in timer(runs).items()}
    width = 2 * n if op == "gated_pairs" else n  # one GEMM over the interleaved gate and up weights
    covering = _split_to_fill(tile, Shape(M, width, k, torch.bfloat16), device.multiprocessors)
    return dict(op=op, N=n, K=k, M=M, tile=tile.short(), tiles=tiles(M, width, tile),
                heuristic_split=split_k(heuristic), covering_split=split_k(covering),
                us={str(s): u for s, u in us.items()})


def summarize_splits(rows: list[dict]) -> dict:
    """Per group (the Linear; the gated up-projections): each rule's split over the point's fastest, and how many
    points the unsplit tile is the fastest at."""
    summary = {}
    for group, names in (("linear", ("linear",)), ("gated", ("gated_up", "gated_pairs"))):
        picked = [r for r in rows if r["op"] in names]
        if not picked:
            continue
        entry = dict(points=len(picked))
        for rule in ("heuristic_split", "covering_split"):
            ratios = [r["us"][str(r[rule])] / min(r["us"].values()) for r in picked if str(r[rule]) in r["us"]]
            entry[rule] = dict(geomean=math.exp(sum(map(math.log, ratios)) / len(ratios)), worst=max(ratios),
                               over_1_10=sum(q > 1.10 for q in ratios))
        entry["unsplit_fastest"] = sum(min(r["us"], key=r["us"].get) == "1" for r in picked)
        summary[group] = entry
    return summary


def split_sweep(tokens: list[int], out: str | None) -> None:
    from autofuse.choose.heuristics import device_info

    device = device_info(torch.device("cuda"))
    rows = []
    for op, shapes in (("linear", SPLIT_LINEARS), ("gated_up", SPLIT_GATED), ("gated_pairs", SPLIT_GATED)):
        for n, k in shapes:
            for M in tokens:
                row = split_point(op, n, k, M, device)
                rows.append(row)
                print(f"{op} N={n} K={k} M={M}: tiles {row['tiles']}, heuristic split {row['heuristic_split']}; "
                      + " ".join(f"{s}:{u:.1f}" for s, u in row["us"].items()), flush=True)
    summary = summarize_splits(rows)
    harness.write(harness.out_dir(out), "split_k.json", dict(summary=summary, rows=rows))
    print(json.dumps(summary), flush=True)


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--seed", type=int, default=37)
    parser.add_argument("--mlps", type=int, default=12)
    parser.add_argument("--tokens", default=None, help="default 1,2,4,8,16,32,64,128,256; with --split-k 16,64,128")
    parser.add_argument("--max-autotune-tokens", default="1,16",
                        help="the M at which torch.compile max-autotune runs too (each autotunes anew)")
    parser.add_argument("--no-max-autotune", action="store_true")
    parser.add_argument("--write-shapes", metavar="FILE", default=None,
                        help="write the drawn shapes and --tokens as a shapes file for `autofuse tune`, then stop")
    parser.add_argument("--only", default=None, help="comma-separated indices of the drawn shapes to run")
    parser.add_argument("--tune", action="store_true",
                        help="`autofuse tune` the shapes it runs at --tokens (every op) before measuring them")
    parser.add_argument("--tune-trials", type=int, default=None,
                        help="--tune: trials a key (default: autofuse tune's)")
    parser.add_argument("--tune-time-budget", type=float, default=None,
                        help="--tune: seconds a key, whichever of it and --tune-trials ends first")
    parser.add_argument("--split-k", action="store_true",
                        help="sweep split-K at decode sizes instead (--tokens default 16,64,128), then stop")
    parser.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                        help="merge the rows of several decode.json files (parts of one sweep) and summarise them")
    args = parser.parse_args()
    if args.merge:
        merge(args.merge, args.out)
        return
    if args.split_k:
        split_sweep([int(t) for t in (args.tokens or "16,64,128").split(",")], args.out)
        return
    tokens = [int(t) for t in (args.tokens or "1,2,4,8,16,32,64,128,256").split(",")]
    gated, _ = draw_shapes(args.seed, args.mlps, 0)
    indices = harness.selected(parser, args.only, len(gated))
    if args.write_shapes:
        write_shapes(args.write_shapes, gated, [], tokens)
        return
    args.out = harness.out_dir(args.out)
    tuned = None
    if args.tune:
        tuned = tune_drawn(gated, indices, tokens, args.tune_trials, args.tune_time_budget, torch.device("cuda"))
        print(f"tuned {tuned['keys']} keys in {tuned['seconds']:.0f} s", flush=True)
    autotune_at = set() if args.no_max_autotune else {int(t) for t in args.max_autotune_tokens.split(",")}
    liger = liger_gate()
    ceiling = ceilings()
    print(json.dumps({k: f"{v:.4g}" for k, v in ceiling.items()}), flush=True)
    rows, start = [], time.perf_counter()
    with torch.no_grad():
        for i in indices:
            shape = gated[i]
            found = mlp_providers(shape, liger)
            for M in tokens:
                row = dict(name=f"drawn-mlp-{i}", **shape, **measure(shape, found, M, ceiling, M in autotune_at))
                rows.append(row)
                steps = "; ".join(f"{s['step']} {s['choice']} {s['us']:.1f} us {s['pct_read_ceiling']:.0f}%"
                                  for s in row["steps"])
                print(f"{shape['d_model']}->{shape['d_ff']} M={M}: autofuse {row['us']['autofuse']:.1f} us, "
                      f"{row['over_roofline']['autofuse']:.2f}x roofline ({row['roofline_us']:.1f}); best peer "
                      f"{row['best_peer']} ratio {row['ratio']:.3f}; {steps}", flush=True)
            del found
            torch._dynamo.reset()
            harness.write(args.out, "decode.json", dict(seed=args.seed, ceilings=ceiling, liger=liger is not None,
                                                        tuned=tuned, summary=summarize(rows), rows=rows,
                                                        seconds=time.perf_counter() - start))
    print(json.dumps(summarize(rows)), flush=True)


if __name__ == "__main__":
    main()
