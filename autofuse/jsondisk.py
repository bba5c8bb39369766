"""The only way autofuse reads and writes its SQLite cache: diskcache's JSONDisk, less everything it
would do beyond JSON. A row is data from disk: never unpickled, and its filename never leaves the
cache folder."""

from __future__ import annotations

import os
import zlib


class RefusedRow(ValueError):
    """A cache row that is not plain JSON as autofuse writes it (a pickle, a file outside the cache)."""


REFUSED = object()  # what a refused key reads as: never a key autofuse wrote


def json_only_disk():
    """diskcache's JSONDisk, less everything it would do beyond reading and writing JSON: it never
    unpickles a key or value (diskcache would for a row whose mode says pickle, whoever wrote it),
    and reads and removes files only inside its own folder (a row's filename column is data)."""
    import diskcache  # here, not at the top: `import autofuse` need not load SQLite
    from diskcache.core import MODE_BINARY, MODE_RAW

    class JSONOnlyDisk(diskcache.JSONDisk):
        def get(self, key, raw):
            if not raw:  # a pickled key: JSONDisk writes its keys as raw bytes
                return REFUSED
            try:
                return super().get(key, raw)
            except (ValueError, TypeError, zlib.error):
                return REFUSED

        def fetch(self, mode, filename, value, read):
            if mode not in (MODE_RAW, MODE_BINARY) or read:
                raise RefusedRow(f"cache row of mode {mode} (autofuse writes only JSON)")
            if mode == MODE_BINARY and not self._inside(filename):
                raise RefusedRow(f"cache row names a file outside the cache: {filename!r}")
            try:
                return super().fetch(mode, filename, value, read)
            except (ValueError, TypeError, zlib.error) as e:
                raise RefusedRow(f"cache row is not JSON: {type(e).__name__}") from None

        def remove(self, file_path):
            if self._inside(file_path):  # clearing deletes only inside the cache folder
                super().remove(file_path)

        def _inside(self, filename) -> bool:
            if not isinstance(filename, str):
                return False
            root = os.path.realpath(self._directory)
            return os.path.realpath(os.path.join(root, filename)).startswith(root + os.sep)

    return JSONOnlyDisk
