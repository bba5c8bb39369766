"""`autofuse tune --devices 0,1,...`: start one worker process per device, all pulling keys from one
Optuna storage (tune/worklist.py), with one progress line for all of them.

Each worker sees only its own GPU (CUDA_VISIBLE_DEVICES), so no two workers ever time on the same
GPU. The coordinator starts the workers, shows progress, and when they are done copies every
winner in the storage (including those other machines found) into this machine's cache.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from ..errors import AutofuseError, shown
from ..resources import user_cache_dir
from ..store import Store, Winner
from . import worklist
from .driver import Job
from .progress import duration, plural

logger = logging.getLogger("autofuse")


def parse_devices(text: str) -> list[str]:
    """"0,1,3" -> ["0", "1", "3"]; "cpu" entries run interpreter workers (tests, no GPU)."""
    devices = [d.strip() for d in text.split(",") if d.strip()]
    if not devices or not all(d == "cpu" or d.isdigit() for d in devices):
        raise AutofuseError(f"--devices must be comma-separated GPU indices such as 0,1 (or cpu), got {text!r}")
    gpus = [d for d in devices if d != "cpu"]
    if len(gpus) != len(set(gpus)):
        raise AutofuseError(f"--devices lists a GPU twice ({text}): two workers would time on one GPU")
    return devices


def default_storage() -> str:
    return str(user_cache_dir() / "tune-journal.log")


def _start_worker(i: int, device: str, worker_args: list[str], log_dir: Path):
    """(name, process, log file) of a worker that sees only its own device."""
    env = dict(os.environ)
    name = f"cpu{i}" if device == "cpu" else f"gpu{device}"
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env["CUDA_VISIBLE_DEVICES"] = device
        env.pop("TRITON_INTERPRET", None)
    log = open(log_dir / f"worker-{name}.log", "w")  # noqa: SIM115 - closed when the worker has exited
    cmd = [sys.executable, "-m", "autofuse.cli", "tune", *worker_args, "--worker", name]
    return name, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log


def _show_progress(procs: list, work_list, total: int, poll_s: float) -> None:
    """One status line for every worker (keys done, the run's ETA, each running key) until all exit."""
    tty = sys.stderr.isatty()
    last = ""
    started = time.monotonic()
    while any(p.poll() is None for _, p, _ in procs):
        time.sleep(poll_s)
        try:
            done, running = work_list.status()
        except Exception as e:  # noqa: BLE001 - a storage hiccup must not stop the workers
            running, done = [f"(storage unreadable: {shown(str(e), 100)})"], 0
        eta = (time.monotonic() - started) / done * (total - done) if done else None
        line = f"[{done}/{total} keys done, run ETA {'?' if eta is None else duration(eta)}] " + " | ".join(running)
        if line != last:
            print(("\r" if tty else "") + line[:200].ljust(120 if tty else 0), end="" if tty else "\n",
                  file=sys.stderr, flush=True)
            last = line
    if tty:
        print(file=sys.stderr)


def run_workers(devices: list[str], worker_args: list[str], plan, storage: str, log_dir: Path,
                poll_s: float = 0.5, replace: bool = False) -> tuple[list[Job], list[Winner]]:
    """Start one worker per device, then (while they start up) `plan()` -> (jobs, run name) here; show
    their progress until all have exited; merge the winners into this machine's cache (where a stored
    record outranks one, store.outranked_by, it stays unless `replace`). Returns the jobs and the
    records their keys hold now."""
    log_dir.mkdir(parents=True, exist_ok=True)
    # Opened once, before any worker starts (a storage that cannot be used ends the run here); a journal
    # storage then reads only what was appended since the last poll.
    shared = worklist.open_storage(storage)
    procs = [_start_worker(i, device, worker_args, log_dir) for i, device in enumerate(devices)]
    try:
        jobs, run = plan()
        work_list = worklist.WorkList(shared, run, jobs)
        logger.info("tuning %s on %s (%s), run %s, storage %s, worker logs in %s", plural(len(jobs), "key"),
                    plural(len(devices), "worker"), ", ".join(n for n, _, _ in procs), run, storage, log_dir)
        _show_progress(procs, work_list, len(jobs), poll_s)
    except BaseException:  # Ctrl-C, or a storage that became unusable: no worker outlives the run
        for _, p, _ in procs:
            p.terminate()
        raise
    finally:
        for _, _, log in procs:
            log.close()
    found = work_list.winners()
    store = Store(user_cache_dir())
    try:
        found = [store.put_winner(winner, replace=replace) for winner in found]
    finally:
        store.close()
    failed = [f"{name} (exit {p.returncode})" for name, p, _ in procs if p.returncode != 0]
    if len(found) < len(jobs):
        raise AutofuseError(f"{len(jobs) - len(found)} of {len(jobs)} keys were not tuned; workers that failed: "
                            f"{', '.join(failed) or 'none'}; see {log_dir}. Run the same command again to finish.")
    if failed:  # every key is tuned, by the others: still a failed run (exit non-zero), which says so
        raise AutofuseError(f"worker(s) {', '.join(failed)} failed, although the others finished every key and their "
                            f"winners are in the cache; see {log_dir}")
    return jobs, found
