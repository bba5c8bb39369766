"""`autofuse cache ...`: list, show, export, import or clear the tuned configs of the user cache."""

from __future__ import annotations

import hashlib
import json

import click

from ..choose import lookup as resolve_module
from ..configfile import export_winners, read_export
from ..errors import AutofuseError
from ..key import TuningKey
from ..resources import user_cache_dir
from ..store import CHECKED, DamagedCache, Store, Winner
from ..store import exists as store_exists
from ..tune.progress import plural
from .common import main


@main.group()
def cache():
    """Inspect, export, import or clear tuned configs."""


def short_id(key: TuningKey) -> str:
    """A key's short name in `cache ls`, which `cache show` and `kernel` take (or any unique prefix of it)."""
    return hashlib.sha256(key.id().encode()).hexdigest()[:10]


def _all_winners() -> list[tuple[Winner, str]]:
    """(winner, source) for every config this process can see: the user cache's first (its tuned and checked
    keys), then shipped files' and AUTOFUSE_CACHE_PATH's (those a user-cache record overrides are left out)."""
    index = resolve_module.tuned_index()

    def order(w: Winner) -> tuple:
        return w.key.gpu, w.key.op, w.key.n, w.key.k, w.key.m_bucket, w.key.residual

    rows = [(w, "checked" if w.policy == CHECKED else "user-cache") for w in sorted(index.user.values(), key=order)]
    shipped = [(w, f"shipped:{name}") for key, (w, name) in index.shipped.items() if key not in index.user]
    return rows + sorted(shipped, key=lambda r: order(r[0]))


@cache.command("ls")
@click.option("--mine", is_flag=True, help="Only the user cache's keys (tuned and checked), not shipped files'.")
@click.option("--op", "op_name", default=None, help="Only this op's keys (e.g. gated_up).")
def cache_ls(mine, op_name):
    """List the tuned keys this process sees: the user cache first, then shipped files and AUTOFUSE_CACHE_PATH."""
    directory = user_cache_dir()
    rows = _all_winners()
    user = sum(source == "user-cache" for _, source in rows)
    checked = sum(source == "checked" for _, source in rows)
    where = "" if store_exists(directory) else " (no cache there yet)"
    click.echo(f"{plural(user, 'tuned key')} and {plural(checked, 'checked key')} (decided at first use, not "
               f"tuned) in {directory}{where}; {plural(len(rows) - user - checked, 'more key')} from shipped files "
               "and AUTOFUSE_CACHE_PATH")
    shown_rows = [(w, source) for w, source in rows if (not mine or not source.startswith("shipped:"))
                  and (op_name is None or w.key.op == op_name)]
    if len(shown_rows) < len(rows):
        click.echo(f"showing {len(shown_rows)} of them ({'--mine' if mine else ''}"
                   f"{' ' if mine and op_name else ''}{f'--op {op_name}' if op_name else ''})")
    for w, source in shown_rows:
        k = w.key
        click.echo(f"{short_id(k)}  {k.op:<11} N={k.n:<6} K={k.k:<6} M={k.m_bucket:<6} {k.dtype:<8} "
                   f"{k.activation:<9} bias={int(k.bias)} res={int(k.residual)} {w.config.short():<28} "
                   f"{w.time_ms:.4f} ms (library {w.baseline_ms:.4f})  {k.gpu}  {source}")


def winner_for(key_text: str) -> Winner:
    """The record of a key given as `autofuse cache ls` prints it: its short id, a unique prefix of
    it, or the whole key id."""
    if "=" in key_text:
        try:
            key = TuningKey.parse(key_text)
        except ValueError as e:
            raise AutofuseError(str(e)) from None
        found = [w for w, _ in _all_winners() if w.key == key]
    else:
        if len(key_text) < 4:
            raise AutofuseError(f"give at least 4 characters of a key's short id (see `autofuse cache ls`), got "
                                f"{key_text!r}")
        found = [w for w, _ in _all_winners() if short_id(w.key).startswith(key_text)]
        if len(found) > 1:
            raise AutofuseError(f"{len(found)} keys start with {key_text!r}: give more of the short id")
    if not found:
        raise AutofuseError("no tuned config for that key (see `autofuse cache ls`)")
    return found[0]


@cache.command("show")
@click.argument("key")
def cache_show(key):
    """Show the stored record of KEY (a short id, or its prefix, or a whole key id, as `cache ls` prints)."""
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
@click.option("--replace", is_flag=True,
              help="Store the file's records even where the cache holds a faster tuned record of a key (default: "
                   "keep that one and say so).")
def cache_import(file, replace):
    """Validate an export and add its configs to the user cache (all or nothing)."""
    winners = read_export(file)  # validated before the cache is opened: a rejected file writes nothing
    store = Store(user_cache_dir())
    before = {w.key: w for w in store.winners()}
    stored = store.put_winners(winners, replace=replace)
    resolve_module.invalidate()
    new = sum(w.key not in before for w in winners)
    same = sum(before.get(w.key) == w for w in winners)
    kept = sum(s is not w for s, w in zip(stored, winners))
    click.echo(f"imported {plural(len(winners), 'config')} from {file}: {new} new, {same} already there unchanged, "
               f"{len(winners) - new - same - kept} replaced, {kept} kept the stored record (faster, or tuned where "
               "the file's was a first-use check; --replace stores the file's)")


@cache.command("clear")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
def cache_clear(yes):
    """Delete every tuned config and trial from the user cache (and repair a damaged one)."""
    directory = user_cache_dir()
    if not yes:
        try:
            confirmed = click.confirm(f"delete every tuned config in {directory}?")
        except click.Abort:  # no answer: input ended (no terminal) or Ctrl-C
            click.echo(err=True)  # end the prompt's line
            raise AutofuseError("no answer to the confirmation, nothing removed; pass --yes to clear without "
                                "asking") from None
        if not confirmed:
            click.echo("nothing removed")
            return
    try:
        store = Store(directory)
        records = list(store.winners())
        store.clear()
        store.close()
    except DamagedCache as e:  # damaged, not merely read-only or locked (store._unavailable tells them apart)
        try:
            Store.repair(directory)
        except OSError as error:
            raise AutofuseError(f"cannot repair the damaged cache at {directory}: {error.strerror}") from None
        Store(directory).close()
        resolve_module.invalidate()
        click.echo(f"the cache was damaged ({str(e)[:120]}); started it afresh in {directory}")
        return
    resolve_module.invalidate()
    checked = sum(w.policy == CHECKED for w in records)
    click.echo(f"removed {plural(len(records) - checked, 'tuned key')} and {plural(checked, 'checked key')}")
