"""The status lines the tuner shows while it runs: one per key, with the key's and the whole run's ETA."""

from __future__ import annotations

import sys
import time


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def duration(seconds: float) -> str:
    seconds = max(int(round(seconds)), 0)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class RunProgress:
    """A whole run's keys: hands each key its status line and works out the run's ETA from the keys
    finished so far. Keys differ in cost: `weights` (one per key, in run order; all equal if not given)
    say by how much, and the keys still to come are charged the finished keys' seconds per weight."""

    def __init__(self, weights: list[float] | None = None) -> None:
        self.start = time.perf_counter()
        self.weights = weights
        self.key_seconds: list[float] = []
        self.key_weights: list[float] = []
        self.total = 0

    def for_key(self, index: int, total: int) -> ProgressLine:
        self.total = total
        return ProgressLine(f"[{index}/{total}]", self, keys_after=total - index)

    def _weight(self, index: int) -> float:
        return self.weights[index] if self.weights is not None and index < len(self.weights) else 1.0

    def run_eta(self, key_eta: float | None, keys_after: int) -> float | None:
        """This key's ETA plus the keys after it at the finished keys' seconds per weight; None until known."""
        if key_eta is None or (keys_after and not self.key_seconds):
            return None
        if not keys_after:
            return key_eta
        per_weight = sum(self.key_seconds) / sum(self.key_weights)
        later = sum(self._weight(i) for i in range(self.total - keys_after, self.total))
        return key_eta + per_weight * later

    def finished(self, seconds: float, keys_after: int) -> None:
        self.key_seconds.append(seconds)
        self.key_weights.append(self._weight(self.total - keys_after - 1))

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
                self.run.finished(p.elapsed_s, self.keys_after)
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
