"""Time every kernel record of a shipped config file once more beside its op's library paths, replayed in turn
(Evaluator.retimed_side_by_side: what `autofuse tune` now does before its fastest trial may win), on this GPU,
and write the file back. A record whose kernel loses side by side becomes that library path; the others keep
their config with the side-by-side times. Library records, and records of another GPU, stay as they are.

  python benchmarks/reconfirm_shipped.py cache/nvidia-h100-triton-3.6.0.json [--out DIR]

The shipped records were tuned before the tuner retimed its winner: the fastest of 8-20 trials timed one by one
against library times taken once, at the start (RESULTS.md, issue 16, eighth session).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from autofuse.configfile import read_export, write_export
from autofuse.configs import KernelConfig, Library
from autofuse.evaluator import Evaluator, choose_winner


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name()
    device = torch.device("cuda")
    winners, rows = [], []
    for w in read_export(args.file):
        if w.key.gpu != gpu or isinstance(w.config, Library):
            winners.append(w)
            continue
        start = time.perf_counter()
        evaluator = Evaluator(w.key, w.key.m_bucket, device)
        try:
            with torch.no_grad():
                library_ms = evaluator.library_ms()
                record = evaluator.evaluate(w.config)  # compiled and verified again on fresh inputs
                if record.status == "ok":
                    record, library_ms = evaluator.retimed_side_by_side(record, library_ms, list(library_ms))
        finally:
            evaluator.close()
        # The tuner's own rule, on the retimed record; the record's trials, heuristic time and policy stay.
        chosen = choose_winner(w.key, {w.config: record}, library_ms, w.config, 0.0, w.policy,
                               confirmed=record if record.status == "ok" else None)
        keep = isinstance(chosen.config, KernelConfig)
        new = dataclasses.replace(w, config=chosen.config, time_ms=chosen.time_ms, baseline_ms=chosen.baseline_ms)
        winners.append(new)
        row = dict(op=w.key.op, n=w.key.n, k=w.key.k, M=w.key.m_bucket, activation=w.key.activation,
                   config=w.config.short(), recorded_ms=w.time_ms, recorded_baseline_ms=w.baseline_ms,
                   status=record.status, side_by_side_ms=record.time_ms, library_ms=library_ms, kept=keep,
                   seconds=round(time.perf_counter() - start, 1))
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_export(winners, args.file)
    flipped = [r for r in rows if not r["kept"]]
    print(f"{args.file}: {len(rows)} kernel records retimed, {len(flipped)} became library paths", flush=True)
    Path(args.out, f"reconfirm-{Path(args.file).stem}.json").write_text(json.dumps({"gpu": gpu, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
