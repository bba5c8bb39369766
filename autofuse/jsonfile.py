"""Read a JSON file a user handed us, with one-line errors for the usual problems."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import AutofuseError


def read_json(path: Path | str, what: str = "file"):
    """Decoded JSON of `path`; AutofuseError naming the file for unreadable or invalid content."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise AutofuseError(f"cannot read {what} {path}: {e.strerror}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise AutofuseError(f"{path.name}: not valid JSON, truncated or damaged (line {e.lineno}, column "
                            f"{e.colno}: {e.msg})") from None
