"""`autofuse demo`, `bench` and `profile`: check and time the fused modules against PyTorch."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import click
import torch

from ..activations import GATED_ACTIVATIONS, LINEAR_ACTIVATIONS, canonical_activation
from ..errors import AutofuseError
from ..model_config import shapes_from_model_config
from ..shapes import DTYPES, LinearShape, MLPShape, example_shapes_path, load_shapes, public_shapes_path
from ..tools.bench import PROVIDERS as BENCH_PROVIDERS
from ..tools.bench import plot, run_bench
from ..tools.demo import run_demo
from ..tools.profile import PROVIDERS as PROFILE_PROVIDERS
from ..tools.profile import format_rows, profile_case
from .common import main, parse_choices, parse_tokens, select_device


@main.command("demo")
@click.option("--shapes", "shapes_path", type=click.Path(dir_okay=False), default=None,
              help="Shapes file (JSON, see README); default: a small bundled example.")
@click.option("--tokens", default=None, help="Override the file's token counts, e.g. 1,16,128.")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default=None, help="Override the file's dtype.")
def demo_command(shapes_path, tokens, dtype):
    """Build fused modules for a shapes file, check them against PyTorch, time them against eager."""
    shapes = load_shapes(shapes_path or example_shapes_path())
    if parse_tokens(tokens):
        shapes = dataclasses.replace(shapes, tokens=parse_tokens(tokens))
    if dtype:
        shapes = dataclasses.replace(shapes, dtype=DTYPES[dtype])
    device = select_device()
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


def _shape_option(text: str, kind: str):
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


@main.command("profile")
@click.option("--mlp", "mlps", multiple=True, help="A gated MLP: D_MODEL,D_FF[,ACTIVATION] (repeatable).")
@click.option("--linear", "linears", multiple=True, help="A Linear: IN,OUT[,ACTIVATION] (repeatable).")
@click.option("--shapes", "shapes_path", type=click.Path(dir_okay=False), default=None, help="Shapes file.")
@click.option("--model", "model_path", type=click.Path(), default=None, help="A Hugging Face config.json or folder.")
@click.option("--tokens", default="1,4096", show_default=True, help="Token counts M, e.g. 1,4096.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="Default: bfloat16 on a GPU, float32 on the CPU.")
@click.option("--providers", default=",".join(PROFILE_PROVIDERS), show_default=True)
@click.option("--iters", type=click.IntRange(min=1), default=20, show_default=True, help="Forwards profiled per run.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="autofuse-profile", show_default=True,
              help="Folder for the Chrome traces and profile.json.")
def profile_command(**options):
    """Profile eager, torch.compile and autofuse side by side: kernels, GPU and host time, traffic."""
    cases = [_shape_option(t, "mlp") for t in options["mlps"]] + [_shape_option(t, "linear")
                                                                   for t in options["linears"]]
    if options["shapes_path"]:
        loaded = load_shapes(options["shapes_path"])
        cases += [*loaded.mlps, *loaded.linears]
    if options["model_path"]:
        cases += list(shapes_from_model_config(options["model_path"]).mlps)
    if not cases:
        raise click.UsageError("name something to profile: --mlp, --linear, --shapes or --model")
    names = parse_choices(options["providers"], PROFILE_PROVIDERS, "provider", "--providers")
    device = torch.device(select_device())
    dtype = DTYPES[options["dtype"]] if options["dtype"] else (torch.bfloat16 if device.type == "cuda"
                                                               else torch.float32)
    out = Path(options["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in cases:
        for M in parse_tokens(options["tokens"]):
            rows += profile_case(shape, M, dtype, device, out, providers=names, iters=options["iters"])
    click.echo(format_rows(rows))
    if device.type == "cpu":
        click.echo("[CPU: autofuse runs in Triton's interpreter here; host times are not GPU speed, no kernels]")
    (out / "profile.json").write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
    click.echo(f"\nChrome traces: {out}/*.json (open in https://ui.perfetto.dev or chrome://tracing, or "
               f"TensorBoard); the table: {out / 'profile.json'}")


@main.command("bench")
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
def bench_command(shapes_path, tokens, providers, out_dir, rounds):
    """Check and time every provider's forward for each shape and M, beside the roofline."""
    names = list(BENCH_PROVIDERS) if providers is None else parse_choices(providers, tuple(BENCH_PROVIDERS),
                                                                          "provider", "--providers")
    device = select_device()
    default = public_shapes_path() if device == "cuda" else example_shapes_path()
    shapes = load_shapes(shapes_path or default)
    if parse_tokens(tokens):
        shapes = dataclasses.replace(shapes, tokens=parse_tokens(tokens))
    import triton  # after select_device: TRITON_INTERPRET must be set before Triton is first imported

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
    skipped = "" if picture else (" (no plot: matplotlib is not installed)" if device == "cuda" else
                                  " (no plot on the CPU: interpreter times are not GPU speed)")
    click.echo(f"rows: {out / 'bench.json'}" + (f", plot: {picture}" if picture else skipped))
    if any(r["status"] == "wrong" for r in rows):
        click.echo("some providers gave wrong results (see above)", err=True)
        sys.exit(1)
