"""Read a JSON file a user handed us, with one-line errors for the usual problems."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from .errors import AutofuseError

# A config export of every public shape on two GPUs is well under 1 MB; far larger files are not
# exports, and decoding them costs every process that reads them.
MAX_FILE_BYTES = 64 * 1024 * 1024


def read_json(path: Path | str, what: str = "file", *, only_regular: bool = False):
    """Decoded JSON of `path`; AutofuseError naming the file for unreadable or invalid content:
    missing or unreadable, larger than MAX_FILE_BYTES, not UTF-8 text, not JSON, nested too deep,
    a number too long to convert. `only_regular`: refuse anything but a regular file (for files found
    through a setting, which every process reads: a FIFO there would block them all), opened without
    blocking and checked on the open file, so a path cannot be swapped for one in between. A file the
    user named (a shapes file given as `<(...)`, say) may be a pipe; it is read no further than
    MAX_FILE_BYTES either way, so a device such as /dev/zero ends in an error, not in exhausted memory."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_NONBLOCK if only_regular else 0))
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if only_regular and not stat.S_ISREG(info.st_mode):
                raise AutofuseError(f"{path.name}: not a regular file, so not a {what}")
            if info.st_size > MAX_FILE_BYTES:
                raise AutofuseError(f"{path.name}: {info.st_size / 2**20:.0f} MB is too large for a {what} "
                                    f"(at most {MAX_FILE_BYTES // 2**20} MB)")
            data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise AutofuseError(f"{path.name}: too large for a {what} (at most {MAX_FILE_BYTES // 2**20} MB)")
        text = data.decode("utf-8")
    except OSError as e:
        raise AutofuseError(f"cannot read {what} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise AutofuseError(f"{path.name}: not a {what} (not UTF-8 text: binary data?)") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise AutofuseError(f"{path.name}: not valid JSON, truncated or damaged (line {e.lineno}, column "
                            f"{e.colno}: {e.msg})") from None
    except RecursionError:
        raise AutofuseError(f"{path.name}: JSON nested too deeply to be a {what}") from None
    except ValueError as e:  # e.g. an integer of thousands of digits
        raise AutofuseError(f"{path.name}: not a {what} ({str(e)[:80]})") from None
