"""What every suite shares: its command line's --out, where raw results go (benchmarks/results/<gpu>/), and
the run information each result file carries (GPU, host, versions, commit, date, command), so that
RESULTS.md can name the command, commit and date of every number it states."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the suites' common --out (the suite's docstring as its help)."""
    made = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    made.add_argument("--out", default=None,
                      help="folder for the raw JSON (default: benchmarks/results/<gpu>/)")
    return made


def selected(made: argparse.ArgumentParser, only: str | None, count: int) -> list[int]:
    """The indices `--only` names (comma-separated), or all `count`; a parser error for one out of range."""
    indices = list(range(count)) if only is None else [int(i) for i in only.split(",")]
    if any(not 0 <= i < count for i in indices):
        made.error(f"--only takes indices below --mlps ({count})")
    return indices


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def out_dir(out: str | None, gpu: str | None = None) -> Path:
    """`out`, or results/<slug of `gpu`, default this machine's>/; made if missing."""
    folder = Path(out) if out else RESULTS / re.sub(r"[^a-z0-9]+", "-", (gpu or gpu_name()).lower()).strip("-")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def run_info() -> dict:
    """What a number needs beside it to be reproduced."""
    import torch
    import triton

    git = dict(capture_output=True, text=True, cwd=Path(__file__).parent)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **git).stdout.strip() or "unknown"
    # A tree that differs from its commit (edits, or a copy of a checkout over another commit's .git) says so.
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **git).stdout.strip():
        commit += " with uncommitted changes"
    return dict(gpu=gpu_name(), host=platform.processor() or platform.machine(), torch=torch.__version__,
                triton=triton.__version__, python=platform.python_version(), commit=commit,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
                command="python " + " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]))


def write(folder: Path, name: str, payload: dict, run: dict | None = None) -> Path:
    """payload, with the run's information (default: this process's, run_info) under "run", as folder/name
    (written beside and renamed: a killed run leaves the previous file whole)."""
    path = folder / name
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"run": run_info() if run is None else run, **payload}, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    print(f"wrote {path}", file=sys.stderr)
    return path


def race_of(module, M: int, residual: bool = False):
    """The un-graphed race (autofuse.choose.race.Raced) of `module`'s table entry at M rows, or None where its entry
    has one table (no race) or no call at M has bound one yet."""
    from autofuse.choose.race import Raced

    weight = module._reference_weight()
    entry = module._bound.get(module._key(M, weight, residual))
    return entry if isinstance(entry, Raced) else None

