"""Commands of the previous release under their new names, kept for one release: `vaswani-export` is
`vaswani-publish` and `vaswani-export-ct2` is `vaswani-convert-ct2` (the flags are the same). Each prints the new name
on stderr, then runs the new command with the same arguments.
"""

from __future__ import annotations

import sys


def _renamed(old: str, new: str, main, argv: list[str] | None) -> int:
    print(f"{old} is now {new} (same flags); the old name will be removed in the next release.", file=sys.stderr)
    sys.argv[0] = new
    return main(argv)


def export(argv: list[str] | None = None) -> int:
    """`vaswani-export`: `vaswani-publish`."""
    from .publish import main

    return _renamed("vaswani-export", "vaswani-publish", main, argv)


def export_ct2(argv: list[str] | None = None) -> int:
    """`vaswani-export-ct2`: `vaswani-convert-ct2`."""
    from .convert_ct2 import main

    return _renamed("vaswani-export-ct2", "vaswani-convert-ct2", main, argv)
