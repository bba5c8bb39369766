"""`autofuse show-kernel` and `autofuse kernel`: the generated Triton source of an op, or of a tuned key."""

from __future__ import annotations

import click

from .. import ops
from ..configs import KernelConfig
from ..shapes import DTYPES
from .cache import winner_for
from .common import DTYPE_NAMES, main


@main.command("show-kernel")
@click.argument("op")  # checked by ops.show_kernel: one line, with the closest name
@click.option("--activation", default=None, help="Activation (default: gelu_tanh where the op has it, else none).")
@click.option("--bias/--no-bias", default=False)
@click.option("--residual/--no-residual", default=False, help="linear only")
@click.option("--dtype", type=click.Choice(DTYPE_NAMES), default="bfloat16")
@click.option("--ragged-k", is_flag=True, help="Show the masked K loop used when K is not a multiple of BLOCK_K.")
@click.option("--interpret", is_flag=True, help="Show the interpreter variant (float32 operand upcasts).")
@click.option("--variant", default="tile", show_default=True,
              help="The kernel variant: tile (one output tile per program), split_k (programs share a tile through "
                   "a workspace), tma (persistent over TMA descriptors, Hopper), gemv (decode's CUDA-core "
                   "reduction, M = 1), or one registered from outside.")
@click.option("--split-k", "variant", flag_value="split_k", help="Same as --variant split_k.")
@click.option("--tma", "variant", flag_value="tma", help="Same as --variant tma.")
def show_kernel_command(op, **options):
    """Print the Triton source autofuse generates for OP (the names `tune --ops` takes, and the pointwise passes)."""
    click.echo(ops.show_kernel(op, activation=options["activation"], bias=options["bias"],
                               residual=options["residual"], dtype=DTYPES[options["dtype"]],
                               even_k=not options["ragged_k"], interpret=options["interpret"],
                               variant=options["variant"]), nl=False)


@main.command("kernel")
@click.argument("key")
def kernel_command(key):
    """Print the generated Triton source that KEY's tuned config runs."""
    winner = winner_for(key)
    k, config = winner.key, winner.config
    if not isinstance(config, KernelConfig):
        click.echo(f"# {k.op} at this key runs the library path {config.short()}: no kernel beat it "
                   f"({winner.baseline_ms:.4f} ms)")
        return
    click.echo(f"# key {k.id()}\n# config {config.short()}")
    click.echo(ops.show_kernel(k.op, activation=k.activation, bias=k.bias, residual=k.residual,
                               dtype=k.torch_dtype, even_k=k.k % config.block_k == 0,
                               interpret=k.gpu == "interpreter",
                               variant=config.variant), nl=False)
