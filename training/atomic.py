"""Atomic writes: a reader never sees a half-written output file, and a failure or a kill in the middle of a write
leaves the previous file as it was (a temporary file in the same folder, then `os.replace`). The file gets the mode
`open()` gives under the user's umask (`tempfile` makes it 0600).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

from vaswani_hf.checks import follow_umask


def _write_atomic(path: str | os.PathLike, write: Callable[[TextIO], None]) -> None:
    """`write(handle)` into a hidden temporary file beside `path` (".<name>.*.tmp"), then rename it to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            write(handle)
        follow_umask(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write `data` as indented UTF-8 JSON to `path`, atomically."""

    def write(handle: TextIO) -> None:
        json.dump(data, handle, indent=2, ensure_ascii=False)
        handle.write("\n")

    _write_atomic(path, write)


def write_lines_atomic(path: str | os.PathLike, lines: Iterable[str]) -> None:
    """Write one line per item of `lines` to `path`, atomically (a failing iterator leaves the old file)."""
    _write_atomic(path, lambda handle: handle.writelines(line + "\n" for line in lines))
