"""Reading parallel text from files: UTF-8 lines (plain or `.gz`), the aligned pair `{prefix}.{src}` /
`{prefix}.{tgt}`, and JSON lines of `{"translation": {...}}` records, either into memory (`read_*`, `ParallelText`) or
streamed in constant memory (`iter_*`).

Lines end at `\\n`, `\\r\\n` or a lone `\\r`, never at a Unicode separator inside a sentence (`split_lines`). Bad input
raises `CheckError` (`vaswani_hf.checks`, a `ValueError`) whose message names the file and line and says how to fix it.
"""

from __future__ import annotations

import gzip
import itertools
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from ..checks import CheckError
from .records import translation_pair

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

__all__ = [
    "ParallelText",
    "iter_lines",
    "iter_parallel_jsonl",
    "iter_parallel_text",
    "parallel_files",
    "read_lines",
    "read_parallel_jsonl",
    "read_parallel_text",
    "split_lines",
]


_EMPTY_LINE_POLICIES = ("skip", "error", "keep")


def check_empty_lines_policy(empty_lines: str) -> None:
    if empty_lines not in _EMPTY_LINE_POLICIES:
        raise CheckError(f"empty_lines={empty_lines!r} is not one of {_EMPTY_LINE_POLICIES}.")


def _open_binary(path: Path):
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


_LINE_END = re.compile(rb"\r\n|\r|\n")


def split_lines(raw: bytes) -> list[bytes]:
    """Bytes -> lines without their ends: `\\n`, `\\r\\n` and a lone `\\r` end a line (so a file with
    CR-only line ends is not read as one long line); Unicode separators such as U+2028 do not. A trailing line end
    adds no empty line."""
    chunks = _LINE_END.split(raw)
    if chunks and chunks[-1] == b"":
        chunks.pop()
    return chunks


_CHUNK = 1 << 20


def iter_lines(path: PathLike) -> Iterator[str]:
    """Stream a UTF-8 text file (plain or `.gz`) one line at a time, in constant memory: the lines `read_lines`
    returns, for files larger than memory.

    Raises:
        CheckError: as `read_lines` (raised when the bad line or the end of an empty file is reached).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckError(f"{path}: file not found (or not a regular file). Check the path/prefix and language code.")
    lineno = 0
    try:
        with _open_binary(path) as f:
            rest = b""
            while True:
                block = f.read(_CHUNK)
                data = rest + block
                if not block:
                    chunks = split_lines(data)
                    rest = b""
                else:
                    # a "\r" at the end of a block may be the first half of "\r\n": keep it for the next block
                    cut = len(data) - 1 if data.endswith(b"\r") else len(data)
                    chunks = _LINE_END.split(data[:cut])
                    rest = chunks.pop() + data[cut:]
                for chunk in chunks:
                    lineno += 1
                    try:
                        text = chunk.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise CheckError(
                            f"{path}:{lineno}: not valid UTF-8 (byte {chunk[e.start:e.start + 1]!r} at byte "
                            f"offset {e.start} of line {lineno}). Re-encode the file as UTF-8, e.g. "
                            f"`iconv -f latin1 -t utf-8`."
                        ) from None
                    if lineno == 1 and text.startswith("\ufeff"):
                        text = text[1:]
                    yield text.strip()
                if not block:
                    break
    except (OSError, EOFError) as e:  # gzip.BadGzipFile is an OSError
        raise CheckError(f"{path}: cannot read the file ({e}). If it is not gzip-compressed, drop the .gz "
                        f"suffix.") from None
    if lineno == 0:
        raise CheckError(f"{path}: file is empty (0 lines). Expected one sentence per line.")


def read_lines(path: PathLike) -> list[str]:
    """Read a UTF-8 text file (plain or `.gz`) as a list of lines, one sentence a line (`iter_lines` streams them).

    Lines end at `\\n`, `\\r\\n` or a lone `\\r` (Python's universal newlines: files saved with old Mac
    line ends hold one sentence a line too), never at U+2028 or other Unicode separators inside a sentence, which
    would shift the alignment with the other language (`split_lines`). The line end is removed and surrounding
    whitespace is stripped. A final line without a line end counts as a line; a trailing line end does not add one.

    Raises:
        CheckError: the file does not exist, is empty (no lines), is not valid gzip, or has non-UTF-8 bytes
            (the message gives the 1-based line number and byte offset within the line).
    """
    return list(iter_lines(path))


@dataclass
class ParallelText:
    """Aligned sentence pairs read from disk.

    Attributes:
        source, target: lists of equal length, one sentence each.
        source_lang, target_lang: language codes.
        skipped: number of pairs dropped because a side was empty (`empty_lines="skip"`).
        origin: human-readable description of where the pairs came from (file names).
    """

    source: list[str]
    target: list[str]
    source_lang: str
    target_lang: str
    skipped: int = 0
    origin: str = ""

    def __len__(self) -> int:
        return len(self.source)

    def to_records(self) -> list[dict[str, dict[str, str]]]:
        return [{"translation": {self.source_lang: s, self.target_lang: t}} for s, t in zip(self.source, self.target)]


def empty_policy(pairs, empty_lines, where_src, where_tgt, counts):
    """Stream `(index, src, tgt)` -> `(src, tgt)` under the empty-line policy, counting skipped pairs in
    `counts["skipped"]` and all pairs in `counts["pairs"]`; where_* are callables index -> str naming the location."""
    check_empty_lines_policy(empty_lines)
    for i, s, t in pairs:
        counts["pairs"] += 1
        if empty_lines == "keep" or (s and t):
            yield s, t
            continue
        if empty_lines == "error":
            side = where_src(i) if not s else where_tgt(i)
            raise CheckError(
                f"{side}: empty sentence. Remove the pair from both files, or load with empty_lines='skip' "
                f"to drop pairs with an empty side."
            )
        counts["skipped"] += 1


def new_counts() -> dict[str, int]:
    return {"pairs": 0, "skipped": 0}


def _find_lang_files(prefix: Path) -> dict[str, Path]:
    """Map language code -> existing file for files named `{prefix}.{code}` or `{prefix}.{code}.gz`."""
    found: dict[str, Path] = {}
    parent = prefix.parent if str(prefix.parent) else Path(".")
    if not parent.is_dir():
        return found
    stem = prefix.name + "."
    for p in sorted(parent.iterdir()):
        if not p.name.startswith(stem) or not p.is_file():
            continue
        code = p.name[len(stem):]
        if code.endswith(".gz"):
            code = code[:-3]
        if code and "." not in code:
            found.setdefault(code, p)
    return found


def lang_file(prefix: Path, lang: str) -> Path:
    plain, gz = Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")
    if plain.is_file() and gz.is_file():
        raise CheckError(f"both {plain} and {gz} exist; remove one so it is clear which to read.")
    if plain.is_file():
        return plain
    if gz.is_file():
        return gz
    present = _find_lang_files(prefix)
    if present:
        raise CheckError(
            f"no file for language {lang!r} at prefix {prefix} (looked for {plain} and {gz}). Languages present "
            f"for this prefix: {', '.join(sorted(present))}. Pass source_lang/target_lang from these."
        )
    raise CheckError(
        f"no file for language {lang!r} at prefix {prefix} (looked for {plain} and {gz}), and no file "
        f"{prefix}.<lang>[.gz] exists at all. Check the prefix: it is the path without the '.<lang>' suffix, "
        f"e.g. vaswani_hf/corpora/multi30k/train."
    )


def iter_parallel_text(
    prefix: PathLike, source_lang: str, target_lang: str, *, empty_lines: str = "skip",
    counts: dict[str, int] | None = None,
) -> Iterator[tuple[str, str]]:
    """Stream the aligned pairs of `{prefix}.{source_lang}[.gz]` and `{prefix}.{target_lang}[.gz]` in constant
    memory (what `read_parallel_text` collects). `counts`, if given, receives `pairs` and `skipped`.

    Raises:
        CheckError: as `read_parallel_text`; a line-count difference is found when the shorter file ends.
    """
    if source_lang == target_lang:
        raise CheckError(f"source_lang and target_lang are both {source_lang!r}; they must differ.")
    prefix = Path(prefix)
    src_path, tgt_path = lang_file(prefix, source_lang), lang_file(prefix, target_lang)
    counts = new_counts() if counts is None else counts

    def aligned():
        src_lines, tgt_lines = iter_lines(src_path), iter_lines(tgt_path)
        n = 0
        for n, (s, t) in enumerate(itertools.zip_longest(src_lines, tgt_lines), start=1):
            if s is None or t is None:
                n_src = n - 1 + sum(1 for _ in src_lines) + (s is not None)
                n_tgt = n - 1 + sum(1 for _ in tgt_lines) + (t is not None)
                raise CheckError(
                    f"line counts differ: {src_path} has {n_src} lines but {tgt_path} has {n_tgt} lines. "
                    f"Parallel files must be aligned line by line (one sentence per line, same number of lines)."
                )
            yield n, s, t

    yield from empty_policy(aligned(), empty_lines, lambda n: f"{src_path}:{n}", lambda n: f"{tgt_path}:{n}", counts)


def read_parallel_text(
    prefix: PathLike, source_lang: str, target_lang: str, *, empty_lines: str = "skip"
) -> ParallelText:
    """Read aligned files `{prefix}.{source_lang}[.gz]` and `{prefix}.{target_lang}[.gz]` into memory
    (`iter_parallel_text` streams them; `load_parallel_dataset` writes them to memory-mapped Arrow).

    Args:
        prefix: path without the language suffix, e.g. `vaswani_hf/corpora/multi30k/train`.
        source_lang, target_lang: language codes (file suffixes), e.g. `"de"`, `"en"`.
        empty_lines: `"skip"` (default) drops pairs where either side is empty or whitespace-only and logs
            the count (also in `ParallelText.skipped`); `"error"` raises naming the file and line number;
            `"keep"` keeps them.

    Raises:
        CheckError: missing file / unknown language (lists the languages present), empty file, non-UTF-8 bytes
            (file:line), different line counts (names both files and both counts), empty line with
            `empty_lines="error"`, `source_lang == target_lang`.
    """
    counts = new_counts()
    pairs = list(iter_parallel_text(prefix, source_lang, target_lang, empty_lines=empty_lines, counts=counts))
    origin = " + ".join(map(str, parallel_files(prefix, source_lang, target_lang)))
    return _collected(pairs, counts, source_lang, target_lang, origin)


def _collected(pairs, counts, source_lang, target_lang, origin) -> ParallelText:
    skipped = counts["skipped"]
    if skipped:
        logger.warning("%s: skipped %d of %d pairs with an empty side", origin, skipped, counts["pairs"])
    if not pairs:
        raise CheckError(f"{origin}: no non-empty sentence pairs left after skipping {skipped} empty ones.")
    src, tgt = (list(side) for side in zip(*pairs))
    return ParallelText(src, tgt, source_lang, target_lang, skipped, origin)


def iter_parallel_jsonl(
    path: PathLike, source_lang: str, target_lang: str, *, empty_lines: str = "skip",
    counts: dict[str, int] | None = None,
) -> Iterator[tuple[str, str]]:
    """Stream the pairs of a JSON-lines file in constant memory (what `read_parallel_jsonl` collects). `counts`, if
    given, receives `pairs` (records read) and `skipped`.

    Raises:
        CheckError: as `read_parallel_jsonl`.
    """
    if source_lang == target_lang:
        raise CheckError(f"source_lang and target_lang are both {source_lang!r}; they must differ.")
    path = Path(path)
    counts = new_counts() if counts is None else counts

    def records():
        for lineno, line in enumerate(iter_lines(path), start=1):
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise CheckError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno}).") from None
            yield (lineno, *translation_pair(rec, source_lang, target_lang, f"{path}:{lineno}"))

    yield from empty_policy(records(), empty_lines, lambda n: f"{path}:{n} (translation[{source_lang!r}])",
                             lambda n: f"{path}:{n} (translation[{target_lang!r}])", counts)
    if counts["pairs"] == 0:
        raise CheckError(f"{path}: no JSON records (only blank lines).")


def read_parallel_jsonl(
    path: PathLike, source_lang: str, target_lang: str, *, empty_lines: str = "skip"
) -> ParallelText:
    """Read a JSON-lines file (plain or `.gz`), one `{"translation": {"de": ..., "en": ...}}` object a line, into
    memory (`iter_parallel_jsonl` streams it).

    Blank lines are ignored. Extra languages and extra top-level fields are ignored.
    `empty_lines` applies to empty sentence strings, as in `read_parallel_text`.

    Raises:
        CheckError: missing/empty/non-UTF-8 file; invalid JSON, missing `translation` field, missing language
            (lists the codes that record has) or non-string sentence, each with file:line.
    """
    counts = new_counts()
    pairs = list(iter_parallel_jsonl(path, source_lang, target_lang, empty_lines=empty_lines, counts=counts))
    return _collected(pairs, counts, source_lang, target_lang, str(path))


def is_jsonl(path: Path) -> bool:
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return name.endswith(".jsonl") or name.endswith(".json")



def parallel_files(source: PathLike, source_lang: str, target_lang: str) -> list[Path]:
    """The files a source of `load_parallel_dataset` reads: the JSON-lines file, or the two files
    `{prefix}.{lang}[.gz]` of a prefix (as found on disk; `{prefix}.{lang}` where neither exists)."""
    path = Path(source)
    if is_jsonl(path):
        return [path]
    files = []
    for lang in (source_lang, target_lang):
        plain, gz = Path(f"{path}.{lang}"), Path(f"{path}.{lang}.gz")
        files.append(gz if gz.is_file() and not plain.is_file() else plain)
    return files
