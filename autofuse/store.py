"""The user's tuning cache: diskcache under AUTOFUSE_CACHE_DIR, JSON only.

Two diskcache folders of plain JSON entries (diskcache's JSONDisk: nothing is pickled, nothing
is unpickled), validated when read:
  configs/  <key id>                 the winner for a key (a KernelConfig dict, or "library:<name>")
  trials/   <key id>|<config id>     one finished trial (typed outcome, time), written as it ends
Writes are SQLite transactions, so several processes may tune into one cache at once, and a
killed run leaves only whole entries behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import math
import os
import shutil
import sqlite3
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from .configs import KernelConfig, Library, choice_from_json
from .errors import AutofuseError, shown
from .jsondisk import REFUSED, RefusedRow, json_only_disk
from .key import TuningKey
from .resources import user_cache_dir

logger = logging.getLogger("autofuse")

TRIAL_STATUSES = ("ok", "infeasible", "compile_error", "out_of_resources", "wrong_result", "timeout", "error")


@dataclasses.dataclass(frozen=True)
class Winner:
    """The tuned choice for one key, with what was measured when it was chosen."""

    key: TuningKey
    config: KernelConfig | Library  # a kernel, or a library path of the op (autofuse.configs)
    time_ms: float  # the winner's median time
    baseline_ms: float  # the fastest library candidate for the same op
    heuristic_ms: float | None = None  # the built-in heuristic's config, when it was timed
    trials: int = 0
    tune_seconds: float = 0.0
    policy: str = ""
    # Where a library path won: the fastest correct kernel and its time. An un-graphed call at a decode M
    # may run it instead (plain.py): a kernel launch costs less host time than the library path's ops.
    runner_up: KernelConfig | None = None
    runner_up_ms: float | None = None

    def to_record(self) -> dict[str, Any]:
        record = {
            "key": self.key.to_dict(),
            "config": self.config.to_json(),
            "time_ms": self.time_ms,
            "baseline_ms": self.baseline_ms,
            "heuristic_ms": self.heuristic_ms,
            "trials": self.trials,
            "tune_seconds": self.tune_seconds,
            "policy": self.policy,
        }
        if self.runner_up is not None:  # absent, not null: records written before it stay byte for byte
            record["runner_up"] = {"config": self.runner_up.to_json(), "time_ms": self.runner_up_ms}
        return record

    @classmethod
    def from_record(cls, record: Any) -> Winner:
        """Validate one JSON record; ValueError names what is wrong."""
        if not isinstance(record, dict):
            raise ValueError("a record must be a JSON object")
        expected = {"key", "config", "time_ms", "baseline_ms", "heuristic_ms", "trials", "tune_seconds", "policy"}
        allowed = expected | {"runner_up"}
        if not expected <= set(record) <= allowed:
            raise ValueError(f"record fields wrong: missing {sorted(expected - set(record))}, "
                             f"unknown {shown(sorted(set(record) - allowed), 80)}")
        key = TuningKey.from_dict(record["key"])
        config = choice_from_json(record["config"])
        if isinstance(config, Library) and config.name not in key.spec.library_for(key.activation, key.bias,
                                                                                   key.residual):
            raise ValueError(f"op {key.op!r} has no library candidate {config.name!r} for activation "
                             f"{key.activation}, bias {key.bias}, residual {key.residual}")
        refused = key.spec.refuse_config(config) if isinstance(config, KernelConfig) else None
        if refused:
            raise ValueError(refused)
        for name in ("time_ms", "baseline_ms"):
            if not _positive_number(record[name]):
                raise ValueError(f"{name} must be a positive number, got {record[name]!r}")
        if record["heuristic_ms"] is not None and not _positive_number(record["heuristic_ms"]):
            raise ValueError(f"heuristic_ms must be a positive number or null, got {record['heuristic_ms']!r}")
        if type(record["trials"]) is not int or record["trials"] < 0:
            raise ValueError(f"trials must be a non-negative integer, got {record['trials']!r}")
        if not _positive_number(record["tune_seconds"], allow_zero=True):
            raise ValueError(f"tune_seconds must be a non-negative number, got {record['tune_seconds']!r}")
        if not isinstance(record["policy"], str) or len(record["policy"]) > 40:
            raise ValueError("policy must be a string of at most 40 characters")
        runner_up, runner_up_ms = _runner_up(record.get("runner_up"), key, config)
        return cls(key, config, float(record["time_ms"]), float(record["baseline_ms"]),
                   None if record["heuristic_ms"] is None else float(record["heuristic_ms"]),
                   record["trials"], float(record["tune_seconds"]), record["policy"], runner_up, runner_up_ms)


def _runner_up(value: Any, key: TuningKey, config: KernelConfig | Library) -> tuple[KernelConfig | None, float | None]:
    """A record's runner_up, validated: a kernel config the op accepts and a positive time, beside a library
    winner only."""
    if value is None:
        return None, None
    if not isinstance(value, dict) or set(value) != {"config", "time_ms"}:
        raise ValueError('runner_up must be an object {"config": ..., "time_ms": ...}')
    if not isinstance(config, Library):
        raise ValueError("runner_up is kept only where a library path won")
    runner_up = choice_from_json(value["config"])
    if not isinstance(runner_up, KernelConfig):
        raise ValueError("runner_up must be a kernel config")
    refused = key.spec.refuse_config(runner_up)
    if refused:
        raise ValueError(f"runner_up: {refused}")
    if not _positive_number(value["time_ms"]):
        raise ValueError(f"runner_up time_ms must be a positive number, got {value['time_ms']!r}")
    return runner_up, float(value["time_ms"])


def _positive_number(value: Any, allow_zero: bool = False) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value >= 0 if allow_zero else value > 0


def config_id(config: KernelConfig) -> str:
    """A trial's name within its key: every field, so configs that differ anywhere never collide."""
    tiles = (config.block_m, config.block_n, config.block_k, config.group_m, config.num_warps, config.num_stages)
    knobs = [f"{name}={value}" for name, value in config.knobs]
    return "-".join([*map(str, tiles), config.variant, *knobs])


@dataclasses.dataclass(frozen=True)
class TrialRecord:
    config: KernelConfig
    status: str
    time_ms: float | None = None
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "status": self.status, "time_ms": self.time_ms,
                "detail": self.detail[:500]}

    @classmethod
    def from_json(cls, data: Any) -> TrialRecord:
        if not isinstance(data, dict) or set(data) != {"config", "status", "time_ms", "detail"}:
            raise ValueError("malformed trial record")
        if data["status"] not in TRIAL_STATUSES:
            raise ValueError(f"unknown trial status {data['status']!r}")
        time_ms = data["time_ms"]
        if data["status"] == "ok" and not _positive_number(time_ms):
            raise ValueError("an ok trial needs a positive time_ms")
        if not isinstance(data["detail"], str) or len(data["detail"]) > 500:  # written cut to 500
            raise ValueError("a trial's detail must be a string of at most 500 characters")
        return cls(KernelConfig.from_dict(data["config"]), data["status"],
                   None if time_ms is None else float(time_ms), data["detail"])


# The policy of a record that a first-use check wrote (not a tuning run): it compared one kernel config
# with the op's library paths, briefly.
CHECKED = "checked"


def outranked_by(new: Winner, stored: Winner) -> str | None:
    """Why `stored` must stay where `new` would replace it, or None. A tuned record outranks a checked
    one (a check compares one config, a tuning run many); between two tuned records the faster stays,
    so tuning again with fewer trials, or importing an older file, never silently loses a better one."""
    if new.policy == CHECKED and stored.policy != CHECKED:
        return "a first-use check never replaces a tuned record"
    if new.policy != CHECKED and stored.policy != CHECKED and stored.time_ms < new.time_ms:
        return (f"it is faster ({stored.config.short()} {stored.time_ms:.4g} ms against {new.config.short()} "
                f"{new.time_ms:.4g} ms); replace it on purpose with --replace")
    return None


class CacheUnavailable(AutofuseError):
    """The user cache cannot be used now: read-only for this user, or locked by another process. Its
    records are intact; the runtime reads them where it can and stores nothing, the CLI says so."""


class DamagedCache(CacheUnavailable):
    """The user cache's database is damaged (not a database, malformed): `cache clear` starts it afresh."""


# What a damaged, read-only or locked cache raises from SQLite, the file system or a corrupt value.
_DAMAGE = (sqlite3.DatabaseError, OSError, zlib.error)
_PARTS = ("configs", "trials")


def _unavailable(directory: Path, error: BaseException) -> CacheUnavailable:
    """The one-line error for `error` met while opening or using the cache at `directory`: damage only where
    SQLite found no database or a malformed one; a permission, a read-only file or a held lock is not."""
    detail = f"{type(error).__name__}: {shown(str(error), 120)}"
    text = str(error).lower()
    read_only = (isinstance(error, PermissionError) or getattr(error, "errno", None) == errno.EROFS
                 or "readonly" in text or _not_writable(directory))
    if read_only:
        return CacheUnavailable(f"the autofuse cache at {directory} is read-only for this user ({detail}): its "
                                "records are used, nothing new is stored; set AUTOFUSE_CACHE_DIR to a folder you "
                                "can write to store tuning results")
    if "locked" in text or type(error).__name__ == "Timeout":
        return CacheUnavailable(f"the autofuse cache at {directory} is locked by another process ({detail}); try "
                                "again when it has finished")
    return DamagedCache(f"the autofuse cache at {directory} cannot be read ({detail}); `autofuse cache clear` "
                        "starts it afresh")


def _warn_if_empty(db: Path) -> None:
    if db.is_file() and db.stat().st_size == 0:  # SQLite would take it as a new, empty database
        logger.warning("autofuse: the cache database %s is empty (0 bytes): every config it held is lost", db)


def _not_writable(directory: Path) -> bool:
    """Whether this user may not write the cache folder, one of its databases' folders or files."""
    paths = [directory, *(directory / part for part in _PARTS), *(directory / part / "cache.db" for part in _PARTS)]
    return any(path.exists() and not os.access(path, os.W_OK) for path in paths)


def read_winners(directory: Path | str | None = None) -> list[Winner]:
    """Every valid winner of the cache at `directory`, read without writing anything and without waiting
    for a writer: what the runtime reads. A read-only connection, so a cache this user may only read is
    read; SQLite's WAL lets it read while another process holds the write lock (diskcache's own open
    writes its settings and would wait up to a minute for that lock). Rows are decoded by the same
    JSON-only rules as Store's; a refused or invalid row is skipped."""
    directory = _folder(directory)
    db = directory / "configs" / "cache.db"
    if not db.is_file():
        return []
    _warn_if_empty(db)
    disk = json_only_disk()(str(directory / "configs"), compress_level=0)
    rows = None
    for flags in ("mode=ro", "mode=ro&immutable=1"):  # immutable: a read-only folder holds no -shm file to open
        try:
            with contextlib.closing(sqlite3.connect(f"file:{quote(str(db))}?{flags}", uri=True, timeout=1.0)) as conn:
                rows = conn.execute("SELECT key, raw, mode, filename, value FROM Cache").fetchall()
            break
        except sqlite3.OperationalError as e:
            error = e
        except sqlite3.DatabaseError as e:
            raise _unavailable(directory, e) from None
    if rows is None:
        raise _unavailable(directory, error)
    winners = []
    for key, raw, mode, filename, value in rows:
        try:
            if disk.get(key, raw) is REFUSED:
                continue
            winners.append(Winner.from_record(disk.fetch(mode, filename, value, False)))
        except (RefusedRow, ValueError, TypeError, OSError):
            continue  # a corrupt or foreign row is ignored, never trusted
    return winners


def _folder(directory: Path | str | None) -> Path:
    """The cache folder: `directory`, or the user's (AUTOFUSE_CACHE_DIR)."""
    return Path(directory) if directory is not None else user_cache_dir()


def check_cache_dir(directory: Path) -> None:
    """AutofuseError where the cache folder cannot be one: a file stands there."""
    if directory.exists() and not directory.is_dir():
        raise AutofuseError(f"the autofuse cache folder {directory} is a file, not a folder: set AUTOFUSE_CACHE_DIR to "
                            "a folder")


def exists(directory: Path | str | None = None) -> bool:
    """Whether a cache was ever written there (read-only commands open none that is not)."""
    directory = _folder(directory)
    check_cache_dir(directory)
    return (directory / "configs").exists()


class Store:
    """The tuning cache of one directory."""

    def __init__(self, directory: Path | str | None = None, timeout: float = 60.0) -> None:
        import diskcache  # here, not at the top: `import autofuse` need not load SQLite

        self.directory = _folder(directory)
        self._refused = 0
        check_cache_dir(self.directory)
        for part in _PARTS:
            _warn_if_empty(self.directory / part / "cache.db")
        settings = dict(
            disk=json_only_disk(),
            disk_compress_level=0,
            eviction_policy="none",  # tuned results are never culled for space
            timeout=timeout,  # seconds a write waits for another process's lock
        )
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CacheUnavailable(f"cannot create the autofuse cache folder {self.directory}: {e.strerror} (set "
                                   "AUTOFUSE_CACHE_DIR to a folder you can write)") from None
        try:
            self._cache = diskcache.Cache(str(self.directory / "configs"), **settings)
            self._trials = diskcache.Cache(str(self.directory / "trials"), **settings)
            len(self._cache), len(self._trials)  # reads the databases' pages: damage shows here, not later
        except _DAMAGE as e:
            raise self._damaged(e) from None

    def _damaged(self, error: BaseException) -> CacheUnavailable:
        return _unavailable(self.directory, error)

    @staticmethod
    def repair(directory: Path | str | None = None) -> Path:
        """Remove the cache's databases (only those: the folder may hold kernels and logs too), so that
        the next Store starts them afresh."""
        directory = _folder(directory)
        for part in _PARTS:
            target = directory / part
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
        return directory

    def close(self) -> None:
        self._cache.close()
        self._trials.close()

    def _read(self, cache, name):
        """The value at `name`, or None for a missing or refused row."""
        try:
            return cache.get(name)
        except RefusedRow as e:
            self._refuse(str(e))
            return None
        except _DAMAGE as e:
            raise self._damaged(e) from None

    def _names(self, cache) -> list:
        try:
            names = list(cache.iterkeys())
        except _DAMAGE as e:
            raise self._damaged(e) from None
        if REFUSED in names:
            self._refuse("a key that is not JSON")
        return [name for name in names if name is not REFUSED]

    def _refuse(self, why: str) -> None:
        self._refused += 1
        if self._refused == 1:  # one warning per store; every such row is ignored
            logger.warning("autofuse: ignoring cache rows in %s that are not plain JSON (%s)", self.directory, why)

    # winners
    def get_winner(self, key: TuningKey) -> Winner | None:
        record = self._read(self._cache, key.id())
        if record is None:
            return None
        try:
            return Winner.from_record(record)
        except ValueError:
            return None  # a corrupt entry is ignored, never trusted

    def put_winner(self, winner: Winner, *, replace: bool = False) -> Winner:
        """Store `winner` unless the key's stored record outranks it (`outranked_by`; `replace` stores it
        anyway); returns the record the key holds afterwards. The read and the write are one transaction,
        so a first-use check that started before a tune stored its winner cannot overwrite it later."""
        with self._writing():
            return self._put_winner(winner, replace)

    @contextlib.contextmanager
    def _writing(self):
        """A write, with what SQLite or diskcache raise for a read-only, locked or damaged cache as one line."""
        try:
            yield
        except _DAMAGE as e:
            raise self._damaged(e) from None
        except Exception as e:  # diskcache.Timeout: another process held the write lock past `timeout`
            if type(e).__name__ != "Timeout":
                raise
            raise self._damaged(e) from None

    def _put_winner(self, winner: Winner, replace: bool) -> Winner:
        with self._cache.transact():
            stored = self.get_winner(winner.key)
            why = None if replace or stored is None else outranked_by(winner, stored)
            if why is not None:
                logger.warning("autofuse: kept the stored record of %s (n=%d, k=%d, M bucket %d): %s", winner.key.op,
                               winner.key.n, winner.key.k, winner.key.m_bucket, why)
                return stored
            self._cache.set(winner.key.id(), winner.to_record())
        return winner

    def put_winners(self, winners: list[Winner], *, replace: bool = False) -> list[Winner]:
        """All or nothing, in one transaction; returns the records the keys hold afterwards."""
        with self._writing(), self._cache.transact():
            return [self._put_winner(winner, replace) for winner in winners]

    def winners(self) -> Iterator[Winner]:
        for name in self._names(self._cache):
            record = self._read(self._cache, name)
            if record is not None:
                try:
                    yield Winner.from_record(record)
                except ValueError:
                    continue

    # trials
    def put_trial(self, key: TuningKey, trial: TrialRecord) -> None:
        self._trials.set(f"{key.id()}|{config_id(trial.config)}", trial.to_json())

    def trials(self, key: TuningKey) -> list[TrialRecord]:
        prefix = f"{key.id()}|"
        out = []
        for name in self._names(self._trials):
            if isinstance(name, str) and name.startswith(prefix):
                data = self._read(self._trials, name)
                try:
                    out.append(TrialRecord.from_json(data))
                except ValueError:
                    continue
        return out

    def clear_trials(self, key: TuningKey) -> None:
        prefix = f"{key.id()}|"
        with self._trials.transact():
            for name in self._names(self._trials):
                if isinstance(name, str) and name.startswith(prefix):
                    self._trials.delete(name)

    def clear(self) -> int:
        """Remove every winner and trial; returns how many winners there were."""
        with self._writing():
            self._trials.clear()
            return self._cache.clear()
