"""The `autofuse` command line."""

from __future__ import annotations

import os
import sys

import click
import torch

from .errors import AutofuseError


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
@click.argument("op", type=click.Choice(["linear", "gated_up"]))
@click.option("--activation", default=None, help="Activation (default: none for linear, gelu_tanh for gated_up).")
@click.option("--bias/--no-bias", default=False)
@click.option("--residual/--no-residual", default=False, help="linear only")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="bfloat16")
@click.option("--ragged-k", is_flag=True, help="Show the masked K loop used when K is not a multiple of BLOCK_K.")
@click.option("--interpret", is_flag=True, help="Show the interpreter variant (float32 operand upcasts).")
def show_kernel_command(op, activation, bias, residual, dtype, ragged_k, interpret):
    """Print the Triton source autofuse generates for OP."""
    from .kernels import show_kernel

    click.echo(show_kernel(op, activation=activation, bias=bias, residual=residual,
                           dtype=getattr(torch, dtype), even_k=not ragged_k, interpret=interpret), nl=False)


if __name__ == "__main__":
    main()
