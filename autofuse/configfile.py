"""The config file format: tuned configs exported and imported as one versioned JSON file.

    {"format": "autofuse-configs", "schema_version": 1, "autofuse": "0.1.0",
     "gpus": ["NVIDIA H200"], "tritons": ["3.6.0"], "template_hashes": {"linear": "..." or ["...", ...], ...},
     "bucket_rule": {"name": "pow2+tokens", "max": 16384},
     "records": [{"key": {...}, "config": {...} | "library:<name>", "time_ms": ..., "baseline_ms": ...,
                  "heuristic_ms": ..., "trials": ..., "tune_seconds": ..., "policy": "optuna"}],
     "sha256": "<sha256 of the canonical JSON of records>"}

Reading validates everything (header, every record, the checksum, that each record's GPU,
Triton and template hash are the header's) and fails with one line naming the problem; an
import writes all records in one transaction or none.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from ._version import __version__
from .errors import AutofuseError, shown
from .jsonfile import read_json
from .key import M_BUCKET_RULE, MAX_M_BUCKET
from .store import Store, Winner

FORMAT = "autofuse-configs"
# The public shapes on two GPUs, tuned for training too, are a few hundred records.
MAX_RECORDS = 20000
SCHEMA_VERSION = 1
_HEADER = {"format", "schema_version", "autofuse", "gpus", "tritons", "template_hashes", "bucket_rule", "records",
           "sha256"}


def _checksum(records: list) -> str:
    canonical = json.dumps(records, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def template_hashes(pairs: Iterable[tuple[str, str]]) -> dict[str, str | list[str]]:
    """The header's template_hashes from (template, hash) pairs: a template's hash, or the sorted list of its hashes
    where ops of one template hash apart (an fp8 op renders the dense Linear's template with other variants)."""
    found: dict[str, set[str]] = {}
    for template, digest in pairs:
        found.setdefault(template, set()).add(digest)
    return {t: next(iter(h)) if len(h) == 1 else sorted(h) for t, h in sorted(found.items())}


def build_document(winners: Iterable[Winner]) -> dict:
    winners = sorted(winners, key=lambda w: w.key.id())
    records = [w.to_record() for w in winners]
    hashes = template_hashes((w.key.template, w.key.template_hash) for w in winners)
    return {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "autofuse": __version__,
        "gpus": sorted({w.key.gpu for w in winners}),
        "tritons": sorted({w.key.triton for w in winners}),
        "template_hashes": hashes,
        "bucket_rule": {"name": M_BUCKET_RULE, "max": MAX_M_BUCKET},
        "records": records,
        "sha256": _checksum(records),
    }


def export_winners(store: Store, path: Path | str, gpu: str | None = None) -> int:
    """Write the store's winners (only `gpu`'s, if given) to `path` atomically; returns the count."""
    winners = [w for w in store.winners() if gpu is None or w.key.gpu == gpu]
    if not winners:
        have = sorted({w.key.gpu for w in store.winners()})
        held = f"configs for: {', '.join(have)}" if have else "no tuned configs (run `autofuse tune` first)"
        raise AutofuseError(f"nothing to export{f' for GPU {gpu!r}' if gpu else ''}; the cache holds {held}")
    write_export(winners, path)
    return len(winners)


def write_export(winners: Iterable[Winner], path: Path | str) -> None:
    """Write `winners` as a config export to `path` atomically (a file beside it, renamed over it): a run
    cut off leaves the old file or the new one, never half of one."""
    document = build_document(winners)
    path = Path(path)
    if not path.parent.is_dir():  # a typo in -o would otherwise make folders nobody asked for
        raise AutofuseError(f"cannot write {path}: the folder {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    # mkstemp makes the file 0600; an export is meant to be shipped and read by other users (a
    # runtime user in an image): the mode a plainly created file gets, the umask respected.
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    with os.fdopen(fd, "w") as f:
        json.dump(document, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def parse_document(document, source: str) -> list[Winner]:
    """Validate a decoded export; AutofuseError with a one-line reason on any problem."""
    def bad(problem: str):
        raise AutofuseError(f"{source}: {problem}")

    if not isinstance(document, dict):
        bad("not an autofuse config export (expected a JSON object)")
    if document.get("format") != FORMAT:
        bad(f"not an autofuse config export (format is {shown(document.get('format'))})")
    version = document.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:  # true and 1.0 equal 1 in Python: not a version
        bad(f"schema version {shown(version)} is not supported (this autofuse reads {SCHEMA_VERSION})")
    if set(document) != _HEADER:
        bad(f"header fields wrong: missing {sorted(_HEADER - set(document))}, unknown "
            f"{shown(sorted(set(document) - _HEADER), 80)}")
    records = document["records"]
    if not isinstance(records, list):
        bad("'records' must be a list")
    if len(records) > MAX_RECORDS:
        bad(f"{len(records)} records; an export holds at most {MAX_RECORDS} (every process reads them all)")
    if not isinstance(document["sha256"], str) or document["sha256"] != _checksum(records):
        bad("checksum mismatch: the records were changed or cut after export")
    for name in ("gpus", "tritons"):
        if not isinstance(document[name], list) or not all(isinstance(v, str) and v.isprintable()
                                                           for v in document[name]):
            bad(f"'{name}' must be a list of printable strings")
    hashes = document["template_hashes"]
    if not isinstance(hashes, dict) or not all(
            isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(h, str) for h in v))
            for v in hashes.values()):
        bad("'template_hashes' must map template names to a hash or a list of hashes")
    rule = document["bucket_rule"]
    if not isinstance(rule, dict) or rule.get("name") != M_BUCKET_RULE:
        bad(f"bucket rule {shown(rule)} is not {M_BUCKET_RULE!r}")
    winners = []
    seen = set()
    for i, record in enumerate(records):
        try:
            winner = Winner.from_record(record)
        except (ValueError, TypeError) as e:
            bad(f"record {i}: {e}")
        key = winner.key
        if key.gpu not in document["gpus"] or key.triton not in document["tritons"]:
            bad(f"record {i}: GPU {shown(key.gpu)} / Triton {shown(key.triton)} not in the header")
        listed = hashes.get(key.template)
        if key.template_hash not in ([listed] if isinstance(listed, str) else listed or []):
            bad(f"record {i}: template hash {key.template_hash} is not among the header's")
        if key in seen:
            bad(f"record {i}: duplicate key {key.id()}")
        seen.add(key)
        winners.append(winner)
    return winners


def read_export(path: Path | str, *, only_regular: bool = False) -> list[Winner]:
    return parse_document(read_json(path, "config export", only_regular=only_regular), Path(path).name)
