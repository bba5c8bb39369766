"""The `autofuse` command line: one click group, its commands in the modules beside this one
(tune; cache; show: show-kernel and kernel; measure: demo, bench and profile)."""

from __future__ import annotations

from . import cache, measure, show, tune  # noqa: F401 - each module adds its commands to `main`
from .common import main

__all__ = ["main"]
