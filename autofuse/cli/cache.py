"""`autofuse cache ...`: list, show, export, import or clear the tuned configs of the user cache."""

from __future__ import annotations

import json
import sqlite3

import click

from .. import resolve as resolve_module
from ..configfile import export_winners, import_winners
from ..errors import AutofuseError
from ..key import TuningKey
from ..resources import user_cache_dir
from ..store import DamagedCache, Store, Winner
from ..store import exists as store_exists
from ..tune.progress import plural
from .common import main


@main.group()
def cache():
    """Inspect, export, import or clear tuned configs."""


@cache.command("ls")
def cache_ls():
    """List tuned keys in the user cache."""
    directory = user_cache_dir()
    if not store_exists(directory):
        click.echo(f"0 tuned keys in {directory} (no cache there yet)")
        return
    winners = sorted(Store(directory).winners(), key=lambda w: (w.key.gpu, w.key.op, w.key.n, w.key.k, w.key.m_bucket))
    click.echo(f"{plural(len(winners), 'tuned key')} in {directory}")
    for w in winners:
        k = w.key
        click.echo(f"{k.op:<8} N={k.n:<6} K={k.k:<6} M={k.m_bucket:<6} {k.dtype:<8} {k.activation:<9} "
                   f"bias={int(k.bias)} {w.config.short():<28} {w.time_ms:.4f} ms (library {w.baseline_ms:.4f})  "
                   f"{k.gpu}")
        click.echo(f"    {k.id()}")


def winner_for(key_text: str) -> Winner:
    """The user cache's record of a key given as `autofuse cache ls` prints it."""
    try:
        key = TuningKey.parse(key_text)
    except ValueError as e:
        raise AutofuseError(str(e)) from None
    winner = Store(user_cache_dir()).get_winner(key) if store_exists() else None
    if winner is None:
        raise AutofuseError("no tuned config for that key in the user cache (see `autofuse cache ls`)")
    return winner


@cache.command("show")
@click.argument("key")
def cache_show(key):
    """Show the stored record of KEY (an id printed by `autofuse cache ls`)."""
    click.echo(json.dumps(winner_for(key).to_record(), indent=1))


@cache.command("export")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True)
@click.option("--gpu", default=None, help="Only this GPU's configs (its name as `cache ls` prints it).")
def cache_export(output, gpu):
    """Write tuned configs to a versioned JSON file."""
    if not store_exists():
        raise AutofuseError(f"nothing to export: no autofuse cache in {user_cache_dir()} yet (tune first)")
    count = export_winners(Store(user_cache_dir()), output, gpu=gpu)
    click.echo(f"exported {count} configs to {output}")


@cache.command("import")
@click.argument("file", type=click.Path(dir_okay=False))
def cache_import(file):
    """Validate an export and add its configs to the user cache (all or nothing)."""
    winners = import_winners(Store(user_cache_dir()), file)
    resolve_module.invalidate()
    click.echo(f"imported {len(winners)} configs from {file}")


@cache.command("clear")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def cache_clear(yes):
    """Delete every tuned config and trial from the user cache (and repair a damaged one)."""
    directory = user_cache_dir()
    if not yes:
        click.confirm(f"delete every tuned config in {directory}?", abort=True)
    try:
        store = Store(directory)
        removed = store.clear()
        store.close()
    except (DamagedCache, sqlite3.DatabaseError) as e:
        Store.repair(directory)
        Store(directory).close()
        resolve_module.invalidate()
        click.echo(f"the cache was damaged ({str(e)[:120]}); started it afresh in {directory}")
        return
    resolve_module.invalidate()
    click.echo(f"removed {removed} tuned configs")
