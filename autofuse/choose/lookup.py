"""Lookup: which choice the caches hold for a problem, before any check.

Order, for the key of (op, N, K, M bucket, dtype, flags, GPU, Triton, template hash):
  1. the user's cache (AUTOFUSE_CACHE_DIR), for the bucket M itself, then M's power-of-two bucket;
  2. shipped pretuned files: the package's cache/*.json, then files or folders in AUTOFUSE_CACHE_PATH;
  3. the nearest tuned key of the same problem on the same GPU/Triton/template (closest N and K,
     then closest M bucket, in log scale): any config is correct for any shape, only its speed moves;
  4. the built-in heuristic (choose/heuristics.py).
Winners are read once per process into an in-memory index; modules resolve once per M bucket.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from functools import cache
from pathlib import Path

from ..configfile import read_export
from ..configs import KernelConfig
from ..errors import AutofuseError
from ..key import Problem
from ..resources import shipped_cache_dir, user_cache_dir
from ..store import CHECKED, read_winners
from ..store import exists as store_exists
from .choice import Choice, Source
from .heuristics import fitted, heuristic_for

logger = logging.getLogger("autofuse")

# CHECKED (store.py): the policy of a user-cache record that a first-use check made, and the source of
# a choice read from one.

class TunedIndex:
    """Every winner this process can see, by key id, user cache first."""

    def __init__(self, cache_dir: str, extra_paths: str) -> None:
        self.user = _user_winners(cache_dir)
        self.shipped: dict[str, tuple] = {}
        skipped: dict[Path, list[str]] = {}  # folder -> its JSON files that are not config exports
        for path, folder in _shipped_files(extra_paths):
            winners, problem = _read_shipped(path)
            if problem and folder is None:
                logger.warning("autofuse: ignoring pretuned file: %s", problem)  # a file named on purpose
            elif problem:
                skipped.setdefault(folder, []).append(problem)
            for winner in winners:
                self.shipped.setdefault(winner.key.id(), (winner, path.name))
        for folder, problems in skipped.items():  # one line per folder, not one per unrelated file
            more = f"; and {len(problems) - 1} more" if problems[1:] else ""
            logger.warning("autofuse: ignoring %d file(s) in %s that are not valid config exports (%s%s)",
                           len(problems), folder, problems[0], more)
        self.by_problem: dict[tuple, list] = {}
        for winner in [*self.user.values(), *(w for w, _ in self.shipped.values())]:
            self.by_problem.setdefault(winner.key.problem(), []).append(winner)


_damaged_warned: set[str] = set()


def _user_winners(cache_dir: str) -> dict:
    """The user cache's winners by key id, read without writing or waiting (a read-only cache is read);
    none, with one warning, where its database is damaged: the runtime runs without it rather than fail
    (the CLI names the problem and `cache clear` mends it)."""
    try:
        if not store_exists(cache_dir):
            return {}
        return {w.key.id(): w for w in read_winners(cache_dir)}
    except AutofuseError as e:  # a damaged database, a file where the folder should be
        if cache_dir not in _damaged_warned:
            _damaged_warned.add(cache_dir)
            logger.warning("%s; running without it", e)
        return {}


def _shipped_files(extra_paths: str) -> list[tuple[Path, Path | None]]:
    """(file, the folder it was found in, or None for a file named itself): the package's cache/ and
    AUTOFUSE_CACHE_PATH's entries."""
    files = [(path, None) for path in sorted(shipped_cache_dir().glob("*.json"))]
    for entry in filter(None, extra_paths.split(os.pathsep)):
        p = Path(entry)
        files += [(path, p) for path in sorted(p.glob("*.json"))] if p.is_dir() else [(p, None)]
    return files


@cache
def _read_shipped(path: Path) -> tuple[tuple, str | None]:
    """(the file's winners, None), or ((), why it was skipped): a bad file never crashes a forward."""
    try:
        return tuple(read_export(path, only_regular=True)), None
    except AutofuseError as e:
        return (), str(e)


_indexes: dict[tuple[str, str], TunedIndex] = {}


def tuned_index() -> TunedIndex:
    where = (str(user_cache_dir()), os.environ.get("AUTOFUSE_CACHE_PATH", ""))
    if where not in _indexes:
        _indexes[where] = TunedIndex(*where)
    return _indexes[where]


_generation = 0


def remember(winner) -> None:
    """Add a winner just stored in the user cache (a first-use check's) to what this process has read,
    without reading everything again as invalidate() does; memos keyed on generation() (module
    tables, the torch.library ops' entries, among them ones that waited for this check) resolve again."""
    global _generation
    index = tuned_index()
    index.user[winner.key.id()] = winner
    index.by_problem.setdefault(winner.key.problem(), []).append(winner)
    _generation += 1


def generation() -> int:
    """How many times invalidate() or remember() ran: memos of resolved configs key on it."""
    return _generation


def invalidate() -> None:
    """Forget what was read: call after tuning or importing in this process."""
    global _generation
    _indexes.clear()
    _read_shipped.cache_clear()
    _generation += 1


def resolve_tuned(problem: Problem) -> Choice | None:
    """The tuned winner for the problem (the user's cache, then shipped files; M, then its bucket), or None."""
    env_key = problem.key()
    index = tuned_index()
    for bucket in dict.fromkeys((problem.M, problem.bucket)):
        key = dataclasses.replace(env_key, m_bucket=bucket)
        found = index.user.get(key.id())
        if found is not None:
            return Choice.of(found, Source.CHECKED if found.policy == CHECKED else Source.USER_CACHE)
        shipped = index.shipped.get(key.id())
        if shipped is not None:
            return Choice.of(shipped[0], Source.SHIPPED, shipped[1])
    return None


def resolve(problem: Problem, tuned: bool = True) -> Choice:
    """The choice for one op at M, before any check. `tuned=False` skips every cache: the built-in heuristic."""
    bucketed = problem.replace(M=problem.bucket)
    if not tuned:
        return Choice(heuristic_for(bucketed), Source.HEURISTIC)
    found = resolve_tuned(problem)
    if found is not None:
        return found
    key = problem.key()
    index = tuned_index()
    neighbours = index.by_problem.get(key.problem(), [])
    if neighbours:
        nearest = min(neighbours,
                      key=lambda w: (_size_distance(w, problem), abs(math.log2(w.key.m_bucket / problem.M))))
        config = nearest.config
        if isinstance(config, KernelConfig):
            config = fitted(config, problem)
        if config is not None:
            return Choice(config, Source.NEAREST, detail=nearest.key.id())
    _warn_once_if_tuned_elsewhere(index, key)
    return Choice(heuristic_for(bucketed), Source.HEURISTIC)


def _size_distance(winner, problem: Problem) -> float:
    """How far a record's N and K are from the problem's, in log scale."""
    return abs(math.log2(winner.key.n / problem.n)) + abs(math.log2(winner.key.k / problem.k))


def tuned_neighbours(problem: Problem, count: int) -> list:
    """Up to `count` tuned records (shipped, or the user's that no first-use check made) of the problem's op, flags,
    GPU and Triton at its M bucket, nearest N and K first: the evidence a first-use check narrows its candidates by
    (check.prior)."""
    key = problem.key()
    seen: dict[str, object] = {}
    for winner in tuned_index().by_problem.get(key.problem(), []):  # the user's records first
        if winner.key.m_bucket == problem.bucket and winner.policy != CHECKED:
            seen.setdefault(winner.key.id(), winner)
    return sorted(seen.values(), key=lambda w: _size_distance(w, problem))[:count]


_warned_environments: set[tuple] = set()
def _warn_once_if_tuned_elsewhere(index: TunedIndex, key) -> None:
    """A deployment whose GPU or Triton version differs from where its configs were tuned runs on
    the heuristic; say so once per environment (not per module or shape), naming what was found."""
    here = (key.gpu, key.capability, key.triton, key.cuda)
    if key.gpu == "interpreter" or here in _warned_environments:
        return
    winners = [*index.user.values(), *(w for w, _ in index.shipped.values())]
    elsewhere = {f"{w.key.gpu} / triton {w.key.triton}" for w in winners}
    if not winners or any((w.key.gpu, w.key.capability, w.key.triton, w.key.cuda) == here for w in winners):
        return
    _warned_environments.add(here)
    logger.warning("autofuse: no tuned configs for %s / triton %s (tuned ones are for %s); using the built-in "
                   "heuristic. Run `autofuse tune` on this GPU for tuned speed.", key.gpu, key.triton,
                   ", ".join(sorted(elsewhere)))
