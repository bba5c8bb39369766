"""Where autofuse's data folders live: `templates/` and `cache/`.

In the repository they sit at the top level, beside the package. A built wheel maps them into the
package (`autofuse/templates`, `autofuse/cache`, see pyproject.toml). Look inside the package
first, then beside it, so both an installed wheel and an editable checkout find them.
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path


def _data_dir(name: str) -> Path:
    packaged = Path(str(importlib.resources.files("autofuse"))) / name
    if packaged.is_dir():
        return packaged
    beside = Path(__file__).resolve().parent.parent / name
    if beside.is_dir():
        return beside
    raise FileNotFoundError(f"autofuse installation is incomplete: no '{name}' folder at {packaged} or {beside}")


def templates_dir() -> Path:
    return _data_dir("templates")


def shipped_cache_dir() -> Path:
    return _data_dir("cache")


def user_cache_dir() -> Path:
    """The user's autofuse folder (tuned configs, tuning journals): AUTOFUSE_CACHE_DIR, else
    $XDG_CACHE_HOME/autofuse, else ~/.cache/autofuse. Read on every call, so tests may change it."""
    root = os.environ.get("AUTOFUSE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "autofuse"
    )
    return Path(root)
