"""The `autofuse` command line."""

from __future__ import annotations

import os
import sys

import click
import torch

from .errors import AutofuseError
from .render import TEMPLATES


class _Group(click.Group):
    """Turns AutofuseError (a user's mistake) into a one-line message and exit code 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except AutofuseError as e:
            raise click.UsageError(str(e)) from None


def _select_device() -> str:
    """'cuda' when a GPU is visible; otherwise switch Triton's interpreter on and say so."""
    if torch.cuda.is_available():
        return "cuda"
    os.environ["TRITON_INTERPRET"] = "1"
    click.echo(
        "No CUDA GPU visible: running autofuse's Triton kernels under Triton's interpreter on the CPU. "
        "Results are checked as usual; timings say nothing about GPU speed.",
        err=True,
    )
    return "cpu"


@click.group(cls=_Group)
@click.version_option(package_name="autofuse")
def main():
    """autofuse: tuned, fused Triton kernels for transformer MLP blocks."""


@main.command()
@click.option("--shapes", "shapes_path", type=click.Path(dir_okay=False), default=None,
              help="Shapes file (JSON, see README); default: a small bundled example.")
def demo(shapes_path):
    """Build fused modules for a shapes file, check them against PyTorch, time them against eager."""
    from .demo import run_demo
    from .shapes import example_shapes_path, load_shapes

    shapes = load_shapes(shapes_path or example_shapes_path())
    device = _select_device()
    unit = "ms (CPU, interpreter)" if device == "cpu" else "ms (GPU median, L2 flushed)"
    click.echo(f"{'shape':<20} {'op':<6} {'M':>6} {'config':<42} {'rel.err':>9} {'check':<5} "
               f"{'autofuse':>9} {'eager':>9}  [{unit}]")
    failures = 0
    for row in run_demo(shapes, device):
        failures += not row.ok
        click.echo(f"{row.name:<20} {row.op:<6} {row.M:>6} {row.config:<42} {row.rel_error:>9.2e} "
                   f"{'ok' if row.ok else 'FAIL':<5} {row.autofuse_ms:>9.3f} {row.eager_ms:>9.3f}")
    if failures:
        click.echo(f"{failures} check(s) FAILED", err=True)
        sys.exit(1)
    click.echo(f"all checks passed ({str(shapes.dtype).removeprefix('torch.')})")


@main.command("show-kernel")
@click.argument("op", type=click.Choice(list(TEMPLATES)))
@click.option("--activation", default=None, help="Activation (default: none for linear, gelu_tanh for gated_up).")
@click.option("--bias/--no-bias", default=False)
@click.option("--residual/--no-residual", default=False, help="linear only")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="bfloat16")
@click.option("--ragged-k", is_flag=True, help="Show the masked K loop used when K is not a multiple of BLOCK_K.")
@click.option("--interpret", is_flag=True, help="Show the interpreter variant (float32 operand upcasts).")
@click.option("--split-k", is_flag=True, help="Show the split-K variant (programs share a tile through a workspace).")
def show_kernel_command(op, activation, bias, residual, dtype, ragged_k, interpret, split_k):
    """Print the Triton source autofuse generates for OP."""
    from .kernels import show_kernel

    click.echo(show_kernel(op, activation=activation, bias=bias, residual=residual,
                           dtype=getattr(torch, dtype), even_k=not ragged_k, interpret=interpret, split_k=split_k),
               nl=False)


def _parse_tokens(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        tokens = tuple(sorted({int(t) for t in text.split(",") if t.strip()}))
    except ValueError:
        raise AutofuseError(f"--tokens must be comma-separated positive integers, got {text!r}") from None
    if not tokens or tokens[0] < 1:
        raise AutofuseError(f"--tokens must be comma-separated positive integers, got {text!r}")
    return tokens


_TUNED_OPS = ("gated_up", "down", "mlp", "gated_bwd", "linear")


def _parse_choices(text: str, choices: tuple[str, ...], what: str, option: str) -> list[str]:
    """A comma-separated selection from `choices`, in the order given; a usage error names the unknown ones."""
    picked = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in picked if p not in choices]
    if unknown or not picked:
        raise click.BadParameter(f"unknown {what}(s) {', '.join(unknown) or '(none given)'}; choose from "
                                 f"{', '.join(choices)}", param_hint=option)
    return picked


def _parse_ops(text: str | None, train: bool) -> set[str] | None:
    if text is None:
        return None
    ops = set(_parse_choices(text, _TUNED_OPS, "op", "--ops"))
    if "gated_bwd" in ops and not train:
        raise click.BadParameter("gated_bwd is the training backward: add --train", param_hint="--ops")
    return ops


@main.command()
@click.option("--shapes", "shapes_path", type=click.Path(dir_okay=False), default=None, help="Shapes file (JSON).")
@click.option("--model", "model_path", type=click.Path(), default=None,
              help="Instead of --shapes: a Hugging Face config.json or model folder; its MLP is tuned.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="Override the file's dtype.")
@click.option("--tokens", default=None, help="Override the file's token counts, e.g. 1,16,128.")
@click.option("--trials", type=click.IntRange(min=1), default=20, show_default=True, help="Trials per key.")
@click.option("--time-budget", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds per key (with --trials, whichever ends first).")
@click.option("--policy", type=click.Choice(["optuna", "exhaustive", "random"]), default="optuna", show_default=True)
@click.option("--resume", is_flag=True, help="Keep the trials a killed or earlier run recorded; run only the rest.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--train", is_flag=True, help="Also tune each MLP's backward kernel (gated_bwd), for training.")
@click.option("--ops", default=None,
              help="Tune only these ops, comma-separated: gated_up, down, mlp, gated_bwd, linear (default: all).")
@click.option("--devices", default=None,
              help="Tune on these GPUs at once, one worker process each, e.g. 0,1,2,3 (cpu: interpreter workers).")
@click.option("--storage", default=None,
              help="Optuna storage the workers share: a journal file path or an RDB URL (sqlite:///, postgresql://). "
                   "Give the same one on several machines to tune one run together. Default with --devices: a "
                   "journal file in the cache folder.")
@click.option("--stale-after", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              help="Seconds without a heartbeat after which another worker takes over a key.")
@click.option("--worker", default=None, hidden=True, help="Internal: run as one worker of a --devices run.")
def tune(shapes_path, model_path, dtype, tokens, trials, time_budget, policy, resume, seed, train, ops, devices,
         storage, stale_after, worker):
    """Tune every key of a shapes file (or a model config's MLP) and store the winners in the cache."""
    import dataclasses

    from .model_config import shapes_from_model_config
    from .shapes import DTYPES, load_shapes
    from .tune.driver import tune_shapes

    if (shapes_path is None) == (model_path is None):
        raise click.UsageError("give one of --shapes FILE or --model CONFIG")
    shapes = load_shapes(shapes_path) if shapes_path else shapes_from_model_config(model_path)
    if dtype:
        shapes = dataclasses.replace(shapes, dtype=DTYPES[dtype])
    tokens = _parse_tokens(tokens)
    if tokens:
        shapes = dataclasses.replace(shapes, tokens=tokens)
    only = _parse_ops(ops, train)
    options = dict(trials=trials, time_budget_s=time_budget, policy=policy, seed=seed)
    if devices is not None or storage is not None or worker is not None:
        coordinated = _tune_distributed(shapes, shapes_path, model_path, dtype, tokens, train, only, options, resume,
                                        devices, storage, stale_after, worker)
        if coordinated is None:  # this process was a worker
            return
        rows, interpret = coordinated
    else:
        device = _select_device()
        interpret = device == "cpu"
        results = tune_shapes(shapes, torch.device(device), train=train, ops=only, resume=resume, **options)
        rows = [(job, r.winner, r.resumed, r.failures) for job, r in results]

    note = "  [interpreter: times are CPU milliseconds, not GPU speed]" if interpret else ""
    click.echo(f"\n{'key':<32} {'M':>6} {'winner':<28} {'ms':>9} {'baseline':>9} {'speedup':>7} "
               f"{'trials':>6} {'resumed':>7}  failures{note}")
    for job, w, resumed, failures in rows:
        winner = "baseline (eager)" if w.config is None else w.config.short()
        fails = ", ".join(f"{k}={v}" for k, v in sorted(failures.items())) or "-"
        click.echo(f"{job.label:<32} {job.M:>6} {winner:<28} {w.time_ms:>9.4f} {w.baseline_ms:>9.4f} "
                   f"{w.baseline_ms / w.time_ms:>6.2f}x {w.trials:>6} {resumed:>7}  {fails}")


def _devices_or_default(devices: str | None) -> list[str]:
    from .tune.parallel import parse_devices

    if devices is not None:
        return parse_devices(devices)
    return ["0"] if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else ["cpu"]


def _tune_distributed(shapes, shapes_path, model_path, dtype, tokens, train, only, options, resume, devices,
                      storage, stale_after, worker):
    """--devices / --storage: coordinate worker processes (or, with --worker, be one). Returns the
    table rows and whether every worker ran under the interpreter, or None in a worker."""
    from .store import Store, cache_dir
    from .tune import distributed
    from .tune.driver import jobs_for_shapes
    from .tune.parallel import default_storage, run_workers

    storage = storage or default_storage()
    settings = dict(train=train, ops=sorted(only) if only else None, **options)
    if worker is not None:
        device = torch.device(_select_device())
        jobs = jobs_for_shapes(shapes, device, train=train, ops=only)
        store = Store(cache_dir())
        try:
            distributed.work(storage, distributed.run_name(jobs, settings), jobs, store, device, worker,
                             stale_after_s=stale_after, resume=resume, **options)
        finally:
            store.close()
        return None
    device_list = _devices_or_default(devices)

    def plan():  # the same keys and run name the workers compute (the first device's GPU model)
        first = device_list[0]
        env_device = torch.device("cpu") if first == "cpu" else torch.device("cuda", int(first))
        jobs = jobs_for_shapes(shapes, env_device, train=train, ops=only)
        return jobs, distributed.run_name(jobs, settings)

    args = ["--shapes", shapes_path] if shapes_path else ["--model", model_path]
    args += ["--trials", str(options["trials"]), "--policy", options["policy"], "--seed", str(options["seed"]),
             "--storage", storage, "--stale-after", repr(stale_after)]
    args += ["--dtype", dtype] if dtype else []
    args += ["--tokens", ",".join(map(str, shapes.tokens))] if tokens else []
    args += ["--time-budget", repr(options["time_budget_s"])] if options["time_budget_s"] else []
    args += ["--train"] if train else []
    args += ["--ops", ",".join(sorted(only))] if only else []
    args += ["--resume"] if resume else []
    jobs, found = run_workers(device_list, args, plan, storage, cache_dir() / "workers")
    winners = {w.key: w for w in found}
    return [(job, winners[job.key], 0, {}) for job in jobs], all(d == "cpu" for d in device_list)


def _parse_shape_option(text: str, kind: str):
    from .activations import GATED_ACTIVATIONS, LINEAR_ACTIVATIONS, canonical_activation
    from .shapes import LinearShape, MLPShape

    parts = [p.strip() for p in text.split(",")]
    try:
        a, b = int(parts[0]), int(parts[1])
        if a < 1 or b < 1 or len(parts) > 3:
            raise ValueError
    except (ValueError, IndexError):
        what = "D_MODEL,D_FF[,ACTIVATION]" if kind == "mlp" else "IN,OUT[,ACTIVATION]"
        raise AutofuseError(f"--{kind} takes {what}, got {text!r}") from None
    if kind == "mlp":
        act = canonical_activation(parts[2] if len(parts) > 2 else "gelu_tanh", GATED_ACTIVATIONS)
        return MLPShape(f"mlp-{a}x{b}", a, b, act)
    act = canonical_activation(parts[2] if len(parts) > 2 else "none", LINEAR_ACTIVATIONS)
    return LinearShape(f"linear-{a}x{b}", a, b, act)


@main.command()
@click.option("--mlp", "mlps", multiple=True, help="A gated MLP: D_MODEL,D_FF[,ACTIVATION] (repeatable).")
@click.option("--linear", "linears", multiple=True, help="A Linear: IN,OUT[,ACTIVATION] (repeatable).")
@click.option("--shapes", "shapes_path", type=click.Path(dir_okay=False), default=None, help="Shapes file.")
@click.option("--model", "model_path", type=click.Path(), default=None, help="A Hugging Face config.json or folder.")
@click.option("--tokens", default="1,4096", show_default=True, help="Token counts M, e.g. 1,4096.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="Default: bfloat16 on a GPU, float32 on the CPU.")
@click.option("--providers", default=",".join(("eager", "torch.compile", "autofuse")), show_default=True)
@click.option("--iters", type=click.IntRange(min=1), default=20, show_default=True, help="Forwards profiled per run.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="autofuse-profile", show_default=True,
              help="Folder for the Chrome traces and profile.json.")
def profile(mlps, linears, shapes_path, model_path, tokens, dtype, providers, iters, out_dir):
    """Profile eager, torch.compile and autofuse side by side: kernels, GPU and host time, traffic."""
    import dataclasses
    import json
    from pathlib import Path

    from .model_config import shapes_from_model_config
    from .profile import PROVIDERS, format_rows, profile_case
    from .shapes import DTYPES, load_shapes

    cases = [_parse_shape_option(t, "mlp") for t in mlps] + [_parse_shape_option(t, "linear") for t in linears]
    if shapes_path:
        loaded = load_shapes(shapes_path)
        cases += [*loaded.mlps, *loaded.linears]
    if model_path:
        cases += list(shapes_from_model_config(model_path).mlps)
    if not cases:
        raise click.UsageError("name something to profile: --mlp, --linear, --shapes or --model")
    names = _parse_choices(providers, PROVIDERS, "provider", "--providers")
    device = torch.device(_select_device())
    dtype = DTYPES[dtype] if dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in cases:
        for M in _parse_tokens(tokens):
            rows += profile_case(shape, M, dtype, device, out, providers=names, iters=iters)
    click.echo(format_rows(rows))
    if device.type == "cpu":
        click.echo("[CPU: autofuse runs in Triton's interpreter here; host times are not GPU speed, no kernels]")
    (out / "profile.json").write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    click.echo(f"\nChrome traces: {out}/*.json (open in https://ui.perfetto.dev or chrome://tracing, or "
               f"TensorBoard); the table: {out / 'profile.json'}")


@main.command()
@click.option("--shapes", "shapes_path", type=click.Path(dir_okay=False), default=None,
              help="Shapes file; default: the public model shapes on a GPU, the tiny example on the CPU.")
@click.option("--tokens", default=None, help="Override the file's token counts, e.g. 1,16,128.")
@click.option("--providers", default=None,
              help="Comma-separated subset of: eager, eager-merged, torch.compile, liger, autofuse-heuristic, "
                   "autofuse-tuned (default: all).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=".", show_default=True,
              help="Folder for bench.json (all rows) and bench.png (when matplotlib is installed).")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
              help="Interleaved timing rounds per case on a GPU (provider order rotated; median kept).")
def bench(shapes_path, tokens, providers, out_dir, rounds):
    """Check and time every provider's forward for each shape and M, beside the roofline."""
    import dataclasses
    import json
    from pathlib import Path

    from .bench import PROVIDERS, plot, run_bench
    from .shapes import example_shapes_path, load_shapes, public_shapes_path

    names = list(PROVIDERS) if providers is None else [p.strip() for p in providers.split(",") if p.strip()]
    unknown = [n for n in names if n not in PROVIDERS]
    if unknown or not names:
        raise AutofuseError(f"unknown provider(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(PROVIDERS)}")
    device = _select_device()
    default = public_shapes_path() if device == "cuda" else example_shapes_path()
    shapes = load_shapes(shapes_path or default)
    if _parse_tokens(tokens):
        shapes = dataclasses.replace(shapes, tokens=_parse_tokens(tokens))
    import triton

    meta = {"gpu": torch.cuda.get_device_name() if device == "cuda" else "interpreter (CPU)",
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}
    click.echo(", ".join(f"{k} {v}" for k, v in meta.items()))
    unit = "ms, GPU median (L2 flushed)" if device == "cuda" else "ms, CPU under the interpreter: not GPU speed"
    click.echo(f"{'shape':<20} {'M':>6} {'provider':<19} {'ms':>10} {'x roofline':>10} {'host us':>8} "
               f"{'graph us':>8} {'rel.err':>8}  [{unit}]")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for row in run_bench(shapes, names, device, rounds=rounds):
        rows.append(row)
        # Rewritten after every row: a run that is cut off keeps what it measured.
        (out / "bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        if row["status"] != "ok":
            click.echo(f"{row['shape']:<20} {row['M']:>6} {row['provider']:<19} {row['status']}: {row['detail']}")
            continue
        ratio = f"{row['ms'] / row['roofline_ms']:.2f}" if row["roofline_ms"] else "-"
        host = f"{row['host_us']:.1f}" if "host_us" in row else "-"
        graph = f"{row['graph_us']:.1f}" if "graph_us" in row else "-"
        click.echo(f"{row['shape']:<20} {row['M']:>6} {row['provider']:<19} {row['ms']:>10.4f} {ratio:>10} "
                   f"{host:>8} {graph:>8} {row['rel_error']:>8.1e}")
    picture = plot(rows, str(out / "bench.png")) if device == "cuda" else None
    click.echo(f"rows: {out / 'bench.json'}" + (f", plot: {picture}" if picture else ""))
    if any(r["status"] == "wrong" for r in rows):
        click.echo("some providers gave wrong results (see above)", err=True)
        sys.exit(1)


@main.group()
def cache():
    """Inspect, export, import or clear tuned configs."""


@cache.command("ls")
def cache_ls():
    """List tuned keys in the user cache."""
    from .store import Store, cache_dir

    store = Store(cache_dir())
    winners = sorted(store.winners(), key=lambda w: (w.key.gpu, w.key.op, w.key.n, w.key.k, w.key.m_bucket))
    click.echo(f"{len(winners)} tuned keys in {store.directory}")
    for w in winners:
        k = w.key
        winner = "baseline" if w.config is None else w.config.short()
        click.echo(f"{k.op:<8} N={k.n:<6} K={k.k:<6} M={k.m_bucket:<6} {k.dtype:<8} {k.activation:<9} "
                   f"bias={int(k.bias)} {winner:<28} {w.time_ms:.4f} ms (baseline {w.baseline_ms:.4f})  {k.gpu}")
        click.echo(f"    {k.id()}")


def _winner_for(key_text: str):
    from .key import TuningKey
    from .store import Store, cache_dir

    try:
        key = TuningKey.parse(key_text)
    except ValueError as e:
        raise AutofuseError(str(e)) from None
    winner = Store(cache_dir()).get_winner(key)
    if winner is None:
        raise AutofuseError("no tuned config for that key in the user cache (see `autofuse cache ls`)")
    return winner


@cache.command("show")
@click.argument("key")
def cache_show(key):
    """Show the stored record of KEY (an id printed by `autofuse cache ls`)."""
    import json

    click.echo(json.dumps(_winner_for(key).to_record(), indent=1))


@cache.command("export")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True)
@click.option("--gpu", default=None, help="Only this GPU's configs (its name as `cache ls` prints it).")
def cache_export(output, gpu):
    """Write tuned configs to a versioned JSON file."""
    from .export import export_winners
    from .store import Store, cache_dir

    count = export_winners(Store(cache_dir()), output, gpu=gpu)
    click.echo(f"exported {count} configs to {output}")


@cache.command("import")
@click.argument("file", type=click.Path(dir_okay=False))
def cache_import(file):
    """Validate an export and add its configs to the user cache (all or nothing)."""
    from . import resolve as resolve_module
    from .export import import_winners
    from .store import Store, cache_dir

    winners = import_winners(Store(cache_dir()), file)
    resolve_module.invalidate()
    click.echo(f"imported {len(winners)} configs from {file}")


@cache.command("clear")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def cache_clear(yes):
    """Delete every tuned config and trial from the user cache."""
    from .store import Store, cache_dir

    store = Store(cache_dir())
    if not yes:
        click.confirm(f"delete every tuned config in {store.directory}?", abort=True)
    click.echo(f"removed {store.clear()} tuned configs")


@main.command("kernel")
@click.argument("key")
def kernel_command(key):
    """Print the generated Triton source that KEY's tuned config runs."""
    from .kernels import show_kernel

    winner = _winner_for(key)
    k = winner.key
    if winner.config is None:
        click.echo(f"# {k.op} at this key runs eager PyTorch: no candidate beat it "
                   f"({winner.baseline_ms:.4f} ms)")
        return
    click.echo(f"# key {k.id()}\n# config {winner.config.short()}")
    click.echo(show_kernel(k.template, activation=k.activation, bias=k.bias, residual=k.residual,
                           dtype=k.torch_dtype, even_k=k.k % winner.config.block_k == 0,
                           interpret=k.gpu == "interpreter", split_k=winner.config.split_k > 1), nl=False)


if __name__ == "__main__":
    main()
