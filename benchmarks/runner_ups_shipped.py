"""Tune once more, on this GPU, every shipped record whose winner is a library path fast enough for an
un-graphed call's host time to matter (time under checked.HOST_BOUND_MS) and that keeps no runner-up kernel,
and write the file back with the tuner's new records. Issue 15: where a library path wins such a key, an
un-graphed call races it against the best correct kernel (plain.py), which the record must name
(store.Winner.runner_up); the shipped records were tuned before records kept one.

  python benchmarks/runner_ups_shipped.py cache/nvidia-h100-triton-3.6.0.json [--trials 24] [--seconds 10]

Each key goes through `autofuse tune`'s own path (driver.tune_key: library candidates, the heuristic and the
policy's picks, each verified against the reference, the fastest retimed side by side, choose_winner with the
host-bound margin), into a throwaway cache; its new record replaces the old one, so a key may also change winner
(the tuner keeps a kernel within CHECK_MARGIN of a host-bound library path). Training ops are left as they are:
their calls are never raced. Rows of what changed are printed and written to DIR/runner-ups-<file>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from autofuse import ops
from autofuse.checked import HOST_BOUND_MS
from autofuse.configfile import read_export, write_export
from autofuse.configs import Library
from autofuse.key import current_environment
from autofuse.store import Store
from autofuse.tune.driver import Job, tune_key


def _wanted(w, gpu: str) -> bool:
    return (w.key.gpu == gpu and isinstance(w.config, Library) and w.time_ms < HOST_BOUND_MS
            and w.runner_up is None and not ops.get(w.key.op).training)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--seconds", type=float, default=10.0, help="time budget per key")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--device", default="cuda", help="cpu only to try the script under TRITON_INTERPRET=1")
    args = parser.parse_args()
    device = torch.device(args.device)
    gpu = current_environment(device).gpu
    winners = read_export(args.file)
    todo = [i for i, w in enumerate(winners) if _wanted(w, gpu)]
    print(f"{args.file}: {len(todo)} of {len(winners)} records to tune again on {gpu}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        store = Store(folder)
        try:
            for n, i in enumerate(todo, 1):
                old = winners[i]
                start = time.perf_counter()
                result = tune_key(Job(old.key, old.key.m_bucket, f"shipped {old.key.op}"), store, device,
                                  trials=args.trials, time_budget_s=args.seconds)
                new = result.winner
                winners[i] = new
                row = dict(op=old.key.op, n=old.key.n, k=old.key.k, M=old.key.m_bucket,
                           activation=old.key.activation, old=old.config.short(), old_ms=old.time_ms,
                           new=new.config.short(), new_ms=new.time_ms, baseline_ms=new.baseline_ms,
                           runner_up=None if new.runner_up is None else new.runner_up.short(),
                           runner_up_ms=new.runner_up_ms, trials=new.trials, failures=result.failures,
                           seconds=round(time.perf_counter() - start, 1))
                rows.append(row)
                print(f"[{n}/{len(todo)}] {json.dumps(row)}", flush=True)
                write_export(winners, args.file)  # after every key: a run cut off keeps what it finished
        finally:
            store.close()
    kept = sum(r["runner_up"] is not None for r in rows)
    changed = sum(r["new"] != r["old"] for r in rows)
    print(f"{args.file}: {len(rows)} records tuned again, {kept} keep a runner-up kernel, {changed} changed winner",
          flush=True)
    Path(args.out, f"runner-ups-{Path(args.file).stem}.json").write_text(json.dumps({"gpu": gpu, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
