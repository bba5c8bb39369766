"""The status lines the tuner shows while it runs: one per key, with the key's and the whole run's ETA."""

from __future__ import annotations

import statistics
import sys
import time


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def duration(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class RunProgress:
    """A whole run's keys: hands each key its status line and works out the run's ETA from the keys
    finished so far (the mean time of a finished key, for each key still to come)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.key_seconds: list[float] = []
        self.total = 0

    def for_key(self, index: int, total: int) -> ProgressLine:
        self.total = total
        return ProgressLine(f"[{index}/{total}]", self, keys_after=total - index)

    def run_eta(self, key_eta: float | None, keys_after: int) -> float | None:
        """This key's ETA plus the keys after it at the mean time of a finished key; None until known."""
        if key_eta is None or (keys_after and not self.key_seconds):
            return None
        return key_eta + (keys_after * statistics.mean(self.key_seconds) if keys_after else 0.0)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


class ProgressLine:
    """One status line per key: rewritten in place on a terminal, printed every few trials otherwise,
    and once more when the key ends (not twice, where the last line printed already says it)."""

    def __init__(self, position: str, run: RunProgress | None = None, keys_after: int = 0) -> None:
        self.position, self.run, self.keys_after = position, run, keys_after
        self.tty = sys.stderr.isatty()
        self.last = self.printed = ""

    def __call__(self, p) -> None:
        budget = f"/{p.trials_budget}" if p.trials_budget else ""
        best = f"{p.best_ms:.4f} ms" if p.best_ms is not None else "-"
        resumed = f" (resumed {p.resumed})" if p.resumed else ""
        exhausted = " (search space exhausted)" if p.exhausted else ""
        if p.final:
            tail = f"done in {duration(p.elapsed_s)}"
        else:
            run_eta = self.run.run_eta(p.eta_s, self.keys_after) if self.run else None
            tail = f"ETA key {'?' if p.eta_s is None else duration(p.eta_s)}"
            if self.run is not None and self.keys_after:
                tail += f", run {'?' if run_eta is None else duration(run_eta)}"
        self.last = (f"{self.position} {p.job.label} M={p.job.M}: trial {p.trials_done}{budget}{exhausted}{resumed} "
                     f"best {best} library {p.baseline_ms:.4f} ms {tail}")
        if p.final:
            if self.run is not None:
                self.run.key_seconds.append(p.elapsed_s)
            self._print(end="\n")
        elif self.tty:
            self._print(end="")
        elif p.trials_done % 5 == 0:
            self._print(end="\n")

    def _print(self, end: str) -> None:
        if not self.tty and self.last == self.printed:
            return
        print(("\r" + self.last.ljust(110)) if self.tty else self.last, end=end, file=sys.stderr, flush=True)
        self.printed = self.last
