"""The status line the tuner shows for each key while it runs."""

from __future__ import annotations

import sys


class ProgressLine:
    """One status line per key: rewritten in place on a terminal, printed every few trials otherwise."""

    def __init__(self, position: str) -> None:
        self.position = position
        self.tty = sys.stderr.isatty()
        self.last = ""

    def __call__(self, p) -> None:
        budget = f"/{p.trials_budget}" if p.trials_budget else ""
        best = f"{p.best_ms:.4f} ms" if p.best_ms is not None else "-"
        eta = f"{p.eta_s:.0f}s" if p.eta_s is not None else "?"
        resumed = f" (resumed {p.resumed})" if p.resumed else ""
        self.last = (f"{self.position} {p.job.label} M={p.job.M}: trial {p.trials_done}{budget}{resumed} "
                     f"best {best} baseline {p.baseline_ms:.4f} ms ETA {eta}")
        if self.tty:
            print("\r" + self.last.ljust(110), end="", file=sys.stderr, flush=True)
        elif p.trials_done % 5 == 0:
            print(self.last, file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.tty:
            print("\r" + self.last.ljust(110), file=sys.stderr, flush=True)
        else:
            print(self.last, file=sys.stderr, flush=True)
