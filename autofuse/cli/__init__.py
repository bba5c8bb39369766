"""The `autofuse` command line: one click group (common.py), its commands in the modules beside this one
(tune; cache; show: show-kernel and kernel; measure: demo, bench and profile), each loaded when its
command runs."""

from __future__ import annotations

from .common import main

__all__ = ["main"]
