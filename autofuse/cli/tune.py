"""`autofuse tune`: tune a shapes file's (or a model config's) keys on this machine's GPUs."""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import click
import torch

from .. import ops
from ..model_config import shapes_from_model_config
from ..opspec import WEIGHT_FORMATS
from ..resources import user_cache_dir
from ..shapes import DEFAULT_TOKENS, DTYPES, load_shapes
from ..store import Store
from ..tune import worklist
from ..tune.coordinator import default_storage, parse_devices, run_workers
from ..tune.driver import DEFAULT_TRIALS, TuneOptions, TuningInterrupted, jobs_for_shapes, tune_jobs, tune_shapes
from ..tune.policies import POLICIES
from ..tune.progress import RunProgress, duration, plural
from .common import dtype_option, main, model_option, parse_choices, parse_tokens, select_device, shapes_file_option


def _parse_ops(text: str | None, train: bool, weights: str = "dense") -> set[str] | None:
    if text is None:
        return None
    picked = set(parse_choices(text, ops.names(tunable=True), "op", "--ops"))
    training = sorted(name for name in picked if ops.get(name).training)
    if training and not train:
        raise click.BadParameter(f"{', '.join(training)} tune(s) the training backward: add --train",
                                 param_hint="--ops")
    other = sorted(name for name in picked if ops.get(name).weights != weights)
    if other:
        theirs = ops.get(other[0]).weights
        fix = "leave out --weights" if theirs == "dense" else f"add --weights {theirs}"
        raise click.BadParameter(f"{', '.join(other)} run(s) {theirs} weights: {fix}", param_hint="--ops")
    return picked


@main.command("tune")
@shapes_file_option("Shapes file (JSON).")
@model_option("Instead of --shapes: a Hugging Face config.json or model folder; its MLP is tuned.")
@dtype_option("Override the file's dtype.")
@click.option("--tokens", default=None, help="Override the file's token counts, e.g. 1,16,128.")
@click.option("--trials", type=click.IntRange(min=1), default=DEFAULT_TRIALS, show_default=True,
              help="Trials per key.")
@click.option("--time-budget", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds per key (with --trials, whichever ends first).")
@click.option("--policy", type=click.Choice(list(POLICIES)), default="optuna", show_default=True)
@click.option("--fresh", is_flag=True,
              help="Discard the trials an earlier or interrupted run of these keys stored (default: keep them and "
                   "run only the rest).")
@click.option("--replace", is_flag=True,
              help="Store this run's winners even where the cache holds a faster tuned record of the key (default: "
                   "keep that one and say so).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--train", is_flag=True, help="Also tune each MLP's backward kernel (gated_bwd), for training.")
@click.option("--weights", type=click.Choice(list(WEIGHT_FORMATS)), default="dense", show_default=True,
              help="The weight format to tune for: fp8 tunes the ops of get_linear / get_mlp(weights='fp8') "
                   "(linear_fp8, gated_up_fp8, down_fp8), w8a8 those of weights='w8a8' (linear_w8a8, "
                   "gated_up_w8a8, down_w8a8).")
@click.option("--ops", "only", default=None,
              help=f"Tune only these ops, comma-separated: {', '.join(ops.names(tunable=True))} (default: all).")
@click.option("--devices", default=None,
              help="Tune on these GPUs at once, one worker process each, e.g. 0,1,2,3 (cpu: interpreter workers).")
@click.option("--storage", default=None,
              help="Optuna storage the workers share: a journal file path or an RDB URL (sqlite:///, postgresql://). "
                   "Give the same one on several machines to tune one run together. Default with --devices: a "
                   "journal file in the cache folder.")
@click.option("--stale-after", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              help="Seconds without a heartbeat after which another worker takes over a key.")
@click.option("--traffic", "traffic_path", type=click.Path(exists=True), default=None,
              help="A traffic trace (or a folder of them: AUTOFUSE_TRAFFIC, autofuse.record_traffic) to tune from: "
                   "exact keys for the M values that carry the time, fitted buckets for the rest, the trial budget "
                   "(--trials or --time-budget per key, times the keys) spread by each key's share of the time. "
                   "Alone or with --shapes/--model.")
@click.option("--worker", default=None, hidden=True, help="Internal: run as one worker of a --devices run.")
def tune_command(**args):
    """Tune every key of a shapes file (or a model config's MLP) and store the winners in the cache.
    A run that was interrupted continues where it stopped when started again (--fresh starts over)."""
    try:
        _tune(args)
    except TuningInterrupted as e:
        _interrupted(f"after {e.done} of {e.total} key{'s' if e.total != 1 else ''}")
    except KeyboardInterrupt:
        _interrupted("")


def _interrupted(progress: str) -> None:
    click.echo(f"\ninterrupted{' ' + progress if progress else ''}: every finished key's winner and every finished "
               "trial are stored. Run the same command again to continue where it stopped (--fresh starts over).",
               err=True)
    sys.exit(130)


@dataclasses.dataclass
class _Run:
    """One `autofuse tune` run: what it tunes and how, as a coordinator hands it to its workers."""

    shapes: object  # shapes.ShapeSet
    train: bool
    only: set[str] | None
    options: TuneOptions
    source: dict  # the command line's own --shapes / --model / --dtype / --tokens, for the workers

    def settings(self) -> dict:
        """What names the run in a shared storage, beside its keys (worklist.run_name)."""
        o = self.options
        return dict(train=self.train, ops=sorted(self.only) if self.only else None, trials=o.trials,
                    time_budget_s=o.time_budget_s, policy=o.policy, seed=o.seed, weights=self.shapes.weights)


def _tune(args: dict) -> None:
    shapes_path, model_path = args["shapes_path"], args["model_path"]
    if shapes_path is not None and model_path is not None:
        raise click.UsageError("give only one of --shapes FILE or --model CONFIG")
    if args["traffic_path"] is not None:
        _tune_traffic(args)
        return
    if shapes_path is None and model_path is None:
        raise click.UsageError("give one of --shapes FILE, --model CONFIG or --traffic TRACE")
    shapes = _shapes_of(args)
    tokens = parse_tokens(args["tokens"])
    if tokens:
        shapes = dataclasses.replace(shapes, tokens=tokens)
    elif model_path is not None and _interpreter_run(args["devices"]):
        shapes = dataclasses.replace(shapes, tokens=tuple(t for t in shapes.tokens if t <= INTERPRETER_MAX_M))
        click.echo(f"interpreter: tuning the model at M = {', '.join(map(str, shapes.tokens))} (the default "
                   f"goes up to M = {DEFAULT_TOKENS[-1]}, minutes a key on a CPU; --tokens picks others)", err=True)
    options = TuneOptions(policy=args["policy"], trials=args["trials"], time_budget_s=args["time_budget"],
                          seed=args["seed"], resume=not args["fresh"], replace=args["replace"])
    source = dict(shapes_path=shapes_path, model_path=model_path, dtype=args["dtype"], tokens=tokens)
    run = _Run(shapes, args["train"], _parse_ops(args["only"], args["train"], shapes.weights), options, source)
    start = time.perf_counter()
    if args["devices"] is not None or args["storage"] is not None or args["worker"] is not None:
        coordinated = _tune_distributed(run, args)
        if coordinated is None:  # this process was a worker
            return
        rows, interpret = coordinated
    else:
        device = select_device()
        interpret = device == "cpu"
        results = tune_shapes(shapes, torch.device(device), options, train=run.train, only=run.only,
                              progress=RunProgress())
        rows = [(job, r.winner, r.resumed, r.failures, r.not_stored) for job, r in results]
    _print_table(rows, interpret, time.perf_counter() - start)


def _shapes_of(args: dict):
    """The shapes of --shapes FILE or --model CONFIG, in --dtype where given."""
    shapes = load_shapes(args["shapes_path"]) if args["shapes_path"] else shapes_from_model_config(args["model_path"])
    if args["dtype"]:
        shapes = dataclasses.replace(shapes, dtype=DTYPES[args["dtype"]])
    return dataclasses.replace(shapes, weights=args["weights"])


def _tune_traffic(args: dict) -> None:
    """tune --traffic: the recorded traffic's keys with the budget spread by time (autofuse/tune/traffic.py), and
    the shapes file's or model's keys beside them with the plain budget; then the expected saving per point."""
    from .. import traffic as recorded_traffic
    from ..tune import traffic as from_traffic

    if args["devices"] is not None or args["storage"] is not None or args["worker"] is not None:
        raise click.UsageError("--traffic tunes on this process's device: leave out --devices and --storage")
    if args["tokens"]:
        raise click.UsageError("--traffic picks the token counts from the trace: leave out --tokens")
    if args["weights"] != "dense":
        raise click.UsageError("--traffic tunes the recorded (dense) modules: leave out --weights")
    recorded = recorded_traffic.load(args["traffic_path"])
    planned = from_traffic.plan(recorded)
    if not planned.points:
        raise click.UsageError(f"{args['traffic_path']}: the trace holds no calls to tune for")
    options = TuneOptions(policy=args["policy"], trials=args["trials"], time_budget_s=args["time_budget"],
                          seed=args["seed"], resume=not args["fresh"], replace=args["replace"])
    only = _parse_ops(args["only"], True)
    device = select_device()
    interpret = device == "cpu"
    keyed = from_traffic.jobs(planned.points, torch.device(device), only)
    point_of = {job.key: point for job, point in keyed}
    runs = from_traffic.budgets(keyed, options)
    if args["shapes_path"] or args["model_path"]:
        runs += [(job, options) for job in jobs_for_shapes(_shapes_of(args), torch.device(device),
                                                           train=args["train"], only=only) if job.key not in point_of]
    weighed = "recorded time" if planned.timed else "work (some shape has no timed call)"
    click.echo(f"tuning {plural(len(runs), 'key')} from {len(recorded.sources)} trace(s): "
               f"{plural(len(planned.points), 'point')} weighed by {weighed}", err=True)
    start = time.perf_counter()
    store = Store(user_cache_dir())
    try:
        held = {job.key: store.get_winner(job.key) for job, _ in keyed}  # what ran when the traffic was recorded
    finally:
        store.close()
    results = tune_jobs(runs, torch.device(device), RunProgress())
    _print_table([(job, r.winner, r.resumed, r.failures, r.not_stored) for job, r in results], interpret,
                 time.perf_counter() - start)
    winners, before = {}, {}
    for job, r in results:
        if job.key in point_of:
            at = (point_of[job.key], job.key.op)
            winners[at] = r.winner.time_ms
            then = held.get(job.key)
            before[at] = then.time_ms if then is not None and then.time_ms else r.winner.baseline_ms
    _print_savings(from_traffic.savings(planned, winners, before), planned, interpret)


def _print_savings(rows, planned, interpret: bool) -> None:
    """The expected saving per point: its recorded time, the same calls at the tuned records' speed, the
    difference; the total row is the sum of the rows."""
    if not planned.timed:
        click.echo("\nno expected saving: the trace has shapes without a timed call")
        return
    clock = ("CPU ms of the interpreter, not GPU speed" if interpret else
             "recorded: GPU ms of the sampled forwards (un-graphed: the GPU's wait for the host included); tuned: "
             "those ms scaled by the tuned records' graph-replayed speed-up over what ran then")
    click.echo(f"\nexpected saving over the recorded traffic ({clock}):")
    click.echo(f"{'shape':<40} {'M':>14} {'calls':>8} {'recorded':>11} {'tuned':>11} {'saved':>11} {'%':>6}")
    for row in rows:
        p = row.point
        where = f"{p.run_m}" if p.exact or len(p.tokens) == 1 else f"{p.tokens[0]}-{p.tokens[-1]}@{p.run_m}"
        click.echo(f"{p.shape.label():<40} {where:>14} {p.calls:>8} {row.recorded_ms:>11.3f} {row.tuned_ms:>11.3f} "
                   f"{row.saved_ms:>11.3f} {100 * row.saved_ms / row.recorded_ms:>5.1f}%")
    recorded = sum(r.recorded_ms for r in rows)
    tuned = sum(r.tuned_ms for r in rows)
    if recorded > 0:
        click.echo(f"{'total':<40} {'':>14} {sum(r.point.calls for r in rows):>8} {recorded:>11.3f} {tuned:>11.3f} "
                   f"{recorded - tuned:>11.3f} {100 * (recorded - tuned) / recorded:>5.1f}%")


# `tune --model` under the interpreter tunes the default token counts up to this M (it takes seconds
# a key; M = 16384 takes minutes).
INTERPRETER_MAX_M = 128


def _interpreter_run(devices: str | None) -> bool:
    """Whether this run's kernels run under Triton's interpreter (no GPU, or only cpu workers)."""
    if devices is not None:
        return all(d.strip() == "cpu" for d in devices.split(","))
    return os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()


def _print_table(rows, interpret: bool, seconds: float) -> None:
    if interpret:  # CPU milliseconds of the interpreter: a speed-up against PyTorch would mean nothing
        click.echo("\n[interpreter: every winner was checked. Its times are CPU milliseconds, not GPU speed, so the "
                   "fastest correct kernel is stored, not the library path that is faster on the CPU: tune on the "
                   "GPU for records worth shipping]")
        click.echo(f"{'key':<32} {'dtype':<8} {'M':>6} {'winner':<28} {'ms':>9} {'library':>9} {'trials':>6} "
                   f"{'resumed':>7}  failures")
    else:
        click.echo(f"\n{'key':<32} {'dtype':<8} {'M':>6} {'winner':<28} {'ms':>9} {'library':>9} {'speedup':>7} "
                   f"{'trials':>6} {'resumed':>7}  failures")
    for job, w, resumed, failures, _ in rows:
        fails = ", ".join(f"{k}={v}" for k, v in sorted(failures.items())) or "-"
        speed = f" {w.baseline_ms:>9.4f}" + ("" if interpret else f" {w.baseline_ms / w.time_ms:>6.2f}x")
        click.echo(f"{job.label:<32} {job.key.dtype:<8} {job.M:>6} {w.config.short():<28} {w.time_ms:>9.4f}{speed} "
                   f"{w.trials:>6} {resumed:>7}  {fails}")
    click.echo(f"tuned {plural(len(rows), 'key')} in {duration(seconds)}")
    kept = [(job, w, found) for job, w, _, _, found in rows if found is not None]
    if kept:
        click.echo(f"{plural(len(kept), 'key')} kept the record already stored, faster than this run's winner "
                   "(--replace stores this run's):")
        for job, w, found in kept:
            click.echo(f"  {job.label} M={job.M}: stored {w.config.short()} {w.time_ms:.4f} ms, this run "
                       f"{found.config.short()} {found.time_ms:.4f} ms")


def _devices_or_default(devices: str | None) -> list[str]:
    if devices is not None:
        return parse_devices(devices)
    return ["0"] if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else ["cpu"]


def _worker_args(run: _Run, storage: str, stale_after: float) -> list[str]:
    """The command line a worker process gets: the same run, so that it computes the same keys."""
    options, source = run.options, run.source
    args = ["--shapes", source["shapes_path"]] if source["shapes_path"] else ["--model", source["model_path"]]
    args += ["--trials", str(options.trials), "--policy", options.policy, "--seed", str(options.seed),
             "--storage", storage, "--stale-after", repr(stale_after)]
    args += ["--dtype", source["dtype"]] if source["dtype"] else []
    args += ["--tokens", ",".join(map(str, run.shapes.tokens))] if source["tokens"] else []
    args += ["--time-budget", repr(options.time_budget_s)] if options.time_budget_s else []
    args += ["--train"] if run.train else []
    args += ["--weights", run.shapes.weights] if run.shapes.weights != "dense" else []
    args += ["--ops", ",".join(sorted(run.only))] if run.only else []
    args += [] if options.resume else ["--fresh"]
    args += ["--replace"] if options.replace else []
    return args


def _tune_distributed(run: _Run, args: dict):
    """--devices / --storage: coordinate worker processes (or, with --worker, be one). Returns the
    table rows and whether every worker ran under the interpreter, or None in a worker."""
    storage = args["storage"] or default_storage()
    stale_after = args["stale_after"]
    if args["worker"] is not None:
        device = torch.device(select_device())
        jobs = jobs_for_shapes(run.shapes, device, train=run.train, only=run.only)
        store = Store(user_cache_dir())
        try:
            work_list = worklist.WorkList(worklist.open_storage(storage), worklist.run_name(jobs, run.settings()),
                                          jobs)
            worklist.work(work_list, store, device, args["worker"], run.options, stale_after_s=stale_after)
        finally:
            store.close()
        return None
    device_list = _devices_or_default(args["devices"])

    def plan():  # the same keys and run name the workers compute (the first device's GPU model)
        first = device_list[0]
        env_device = torch.device("cpu") if first == "cpu" else torch.device("cuda", int(first))
        jobs = jobs_for_shapes(run.shapes, env_device, train=run.train, only=run.only)
        return jobs, worklist.run_name(jobs, run.settings())

    jobs, stored = run_workers(device_list, _worker_args(run, storage, stale_after), plan, storage,
                               user_cache_dir() / "workers", replace=run.options.replace)
    winners = {w.key: w for w in stored}
    return [(job, winners[job.key], 0, {}, None) for job in jobs], all(d == "cpu" for d in device_list)
