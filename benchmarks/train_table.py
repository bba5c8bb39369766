"""Reads train_bench.py's or train_profile.py's JSON lines on stdin and prints them as short lines: one per
provider with its step and forward ms, peak GiB, rounds and configs; or, for a profile row, its kernels.
Lines that are not JSON pass through."""

from __future__ import annotations

import json
import sys


def main() -> None:
    for line in sys.stdin:
        try:
            row = json.loads(line)
        except ValueError:
            print(line.rstrip()[:300])
            continue
        if "kernels" in row:
            print("==", row["shape"], row["M"], row["provider"], "total us", row["total_us"])
            for name, us in row["kernels"].items():
                print("   ", us, name)
            for name, us in row.get("ops", {}).items():
                print("    op", us, name)
        elif "shape" in row:
            rounds = [round(v, 2) for v in row.get("step_ms_rounds", [])]
            print(row["shape"], row["M"], row["provider"], "step ms", round(row.get("ms", 0), 3), "fwd ms",
                  round(row.get("forward_ms", 0), 3), "peak GiB", round(row.get("peak_gib", 0), 4), rounds,
                  row.get("configs", ""), "" if row.get("status", "ok") == "ok" else row["status"])
        else:
            print(json.dumps(row)[:300])


if __name__ == "__main__":
    main()
