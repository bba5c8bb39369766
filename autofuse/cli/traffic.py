"""`autofuse traffic show`: the recorded traffic of fused modules (autofuse/traffic.py), merged, per shape."""

from __future__ import annotations

import click

from .. import traffic as recorded_traffic
from ..tune import traffic as plan_traffic
from .common import main


@main.group("traffic")
def traffic():
    """Show traffic traces recorded with AUTOFUSE_TRAFFIC or autofuse.record_traffic."""


@traffic.command("show")
@click.argument("path", type=click.Path(exists=True))
@click.option("--top", type=click.IntRange(min=1), default=8, show_default=True, help="M values listed per shape.")
def show(path: str, top: int) -> None:
    """Print the merged histogram of PATH (a trace file, or a folder of them): per shape its calls, recorded
    time and share, and its busiest M values; then what `autofuse tune --traffic PATH` would tune."""
    merged = recorded_traffic.load(path)
    planned = plan_traffic.plan(merged)
    unit = "ms" if planned.timed else "work"
    click.echo(f"{len(merged.sources)} trace(s), device(s): {', '.join(sorted(merged.gpus))}")
    if not planned.timed:
        click.echo("some shape has no timed call: shapes are weighed by work (calls x M x weights), not time")
    total = planned.total
    for shape, by_m in sorted(merged.counts.items(), key=lambda kv: kv[0].label()):
        points = [p for p in planned.points if p.shape == shape]
        weight = sum(p.weight for p in points)
        calls = sum(c.calls for c in by_m.values())
        click.echo(f"\n{shape.label()}: {calls} calls, {weight:.4g} {unit} "
                   f"({plan_traffic.describe_share(weight, total)} of the trace)")
        click.echo(f"  {'M':>7} {'calls':>9} {'timed':>6} {'ms/call':>9}")
        busiest = sorted(by_m.items(), key=lambda kv: -kv[1].calls)[:top]
        for M, count in sorted(busiest):
            per_call = merged.per_call_ms(shape, M)
            shown_ms = f"{per_call:9.4f}" if per_call is not None else f"{'-':>9}"
            click.echo(f"  {M:>7} {count.calls:>9} {count.sampled:>6} {shown_ms}")
        if len(by_m) > top:
            click.echo(f"  ... {len(by_m) - top} more M values")
        tuned = ", ".join(f"M={p.run_m}" if p.exact else f"bucket {p.key_m} at M={p.run_m}" for p in points)
        click.echo(f"  tune --traffic tunes: {tuned}")
