"""What a decision gives: a Choice (a kernel config or a library path, and where it came from)."""

from __future__ import annotations

import dataclasses
import enum

from ..configs import KernelConfig, Library


class Source(str, enum.Enum):
    """Where a choice came from. The values are what `config_sources` reports (with ":<file>" or
    ":<key id>" after shipped and nearest)."""

    USER_CACHE = "user-cache"  # tuned on this machine (autofuse tune, cache import)
    CHECKED = "checked"  # a first-use check compared it with the library paths and stored it
    SHIPPED = "shipped"  # a pretuned file: the package's cache/ or AUTOFUSE_CACHE_PATH
    NEAREST = "nearest"  # the nearest tuned key of the same problem: not yet checked here
    HEURISTIC = "heuristic"  # the built-in heuristic: not yet checked here
    PENDING = "library: not checked yet"  # no check could run yet: the eager library path meanwhile
    CHECK_FAILED = "library: the check failed"  # the eager library path for the rest of the process

    __str__ = str.__str__
    __format__ = str.__format__

    @property
    def unchecked(self) -> bool:
        """Whether nothing compared this choice on this GPU and key (a first-use check must)."""
        return self in (Source.NEAREST, Source.HEURISTIC)


@dataclasses.dataclass(frozen=True)
class Choice:
    """What an op runs at one M: a kernel config or a library path, and where that choice came from."""

    config: KernelConfig | Library
    source: Source
    time_ms: float | None = None  # the tuned or checked winner's time, where the choice is one
    # Where tuning or a check chose a library path: the fastest correct kernel it compared, and its time
    # (store.Winner.runner_up), which an un-graphed decode call may run instead (choose/race.py).
    runner_up: KernelConfig | None = None
    runner_up_ms: float | None = None
    detail: str = ""  # the shipped file's name, the nearest key's id

    def __post_init__(self) -> None:
        object.__setattr__(self, "source", Source(self.source))

    @property
    def kernel(self) -> KernelConfig | None:
        """The kernel config, or None where a library path runs."""
        return self.config if isinstance(self.config, KernelConfig) else None

    @property
    def origin(self) -> str:
        """Where it came from as config_sources reports it: user-cache, checked, shipped:<file>,
        nearest:<key id>, heuristic, or one of the library stand-ins."""
        return f"{self.source.value}:{self.detail}" if self.detail else self.source.value

    @classmethod
    def of(cls, winner, source: Source, detail: str = "") -> Choice:
        """The choice a stored winner (store.Winner) makes."""
        return cls(winner.config, source, winner.time_ms, winner.runner_up, winner.runner_up_ms, detail)

    def kernel_instead(self) -> Choice | None:
        """This choice with its runner-up kernel in place of its library path, or None where it has none."""
        if self.runner_up is None or self.kernel is not None:
            return None
        return Choice(self.runner_up, self.source, self.runner_up_ms, detail=self.detail)


def pending(choices: dict[str, Choice]) -> bool:
    """Whether a table holds a choice made before its check could run (a module must not keep it)."""
    return any(c.source is Source.PENDING for c in choices.values())
