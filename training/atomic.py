"""Atomic writes: a reader never sees a half-written output file, and a failure or a kill in the middle of a write
leaves the previous file as it was (a temporary file in the same folder, then `os.replace`). The file gets the mode
`open()` gives under the user's umask (`tempfile` makes it 0600).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from typing import Any, TextIO

from vaswani_hf.checks import replace_file_atomically


def _write_atomic(path: str | os.PathLike, write: Callable[[TextIO], None]) -> None:
    """`write(handle)` into a hidden temporary file beside `path` (".<name>.*.tmp"), then rename it to `path`."""
    def write_text(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            write(handle)

    replace_file_atomically(path, write_text)


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write `data` as indented UTF-8 JSON to `path`, atomically."""

    def write(handle: TextIO) -> None:
        json.dump(data, handle, indent=2, ensure_ascii=False)
        handle.write("\n")

    _write_atomic(path, write)


def write_lines_atomic(path: str | os.PathLike, lines: Iterable[str]) -> None:
    """Write one line per item of `lines` to `path`, atomically (a failing iterator leaves the old file)."""
    _write_atomic(path, lambda handle: handle.writelines(line + "\n" for line in lines))
