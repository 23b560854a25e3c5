"""Parallel-data loading and token-budget batching shared by the training scripts.

Everything here works offline. The default corpus is the copy of Multi30k task 1 shipped as package data in
`vaswani_hf/corpora/multi30k` (see its README for origin, terms and citation); nothing is downloaded unless the
caller explicitly asks for a Hugging Face Hub dataset with `load_parallel_dataset(hub_dataset=...)`.

Records have the layout used by the `transformers` translation examples::

    {"translation": {"de": "Zwei junge weiße Männer ...", "en": "Two young, White males ..."}}

Batching follows §5.1 of "Attention Is All You Need" ("Sentence pairs were batched together by approximate
sequence length. Each training batch contained a set of sentence pairs containing approximately 25000 source
tokens and 25000 target tokens") in the form fairseq implements it (`--max-tokens`): see
`TokenBudgetBatchSampler`.

At scale (docs/data.md): local files stream into memory-mapped Arrow files cached by their content, lengths come from
the Arrow offsets, batches are packed with numpy and padded from Arrow (`PaddedBatches`), and
`StreamingTokenBudgetBatches` batches a stream larger than memory a pool at a time.

Bad input raises `DataError` (`vaswani_hf.checks.CheckError`, a `ValueError`) whose message names the
file, line or field and says how to fix it.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import logging
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np
import torch
from torch.utils.data import IterableDataset, Sampler

from .checks import CheckError

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

__all__ = [
    "DataError",
    "ParallelText",
    "read_lines",
    "split_lines",
    "read_parallel_text",
    "read_parallel_jsonl",
    "parallel_files",
    "load_parallel_dataset",
    "multi30k_dir",
    "multi30k_file",
    "load_multi30k",
    "MULTI30K_SPLITS",
    "tokenize_dataset",
    "Encoder",
    "example_lengths",
    "iter_sentences",
    "iter_lines",
    "iter_parallel_text",
    "iter_parallel_jsonl",
    "content_key",
    "TokenBudgetBatchSampler",
    "PaddedBatches",
    "StreamingTokenBudgetBatches",
    "stream_parallel_pairs",
    "padding_fraction",
]


# Bad or missing training/evaluation data: the one error type of `vaswani_hf.checks`, under the name data code reads.
DataError = CheckError


# --------------------------------------------------------------------------------------------------------------
# Reading files
# --------------------------------------------------------------------------------------------------------------

_EMPTY_LINE_POLICIES = ("skip", "error", "keep")


def _check_empty_lines_policy(empty_lines: str) -> None:
    if empty_lines not in _EMPTY_LINE_POLICIES:
        raise DataError(f"empty_lines={empty_lines!r} is not one of {_EMPTY_LINE_POLICIES}.")


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
        DataError: as `read_lines` (raised when the bad line or the end of an empty file is reached).
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found (or not a regular file). Check the path/prefix and language code.")
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
                        raise DataError(
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
        raise DataError(f"{path}: cannot read the file ({e}). If it is not gzip-compressed, drop the .gz "
                        f"suffix.") from None
    if lineno == 0:
        raise DataError(f"{path}: file is empty (0 lines). Expected one sentence per line.")


def read_lines(path: PathLike) -> list[str]:
    """Read a UTF-8 text file (plain or `.gz`) as a list of lines, one sentence a line (`iter_lines` streams them).

    Lines end at `\\n`, `\\r\\n` or a lone `\\r` (Python's universal newlines: files saved with old Mac
    line ends hold one sentence a line too), never at U+2028 or other Unicode separators inside a sentence, which
    would shift the alignment with the other language (`split_lines`). The line end is removed and surrounding
    whitespace is stripped. A final line without a line end counts as a line; a trailing line end does not add one.

    Raises:
        DataError: the file does not exist, is empty (no lines), is not valid gzip, or has non-UTF-8 bytes
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


def _empty_policy(pairs, empty_lines, where_src, where_tgt, counts):
    """Stream `(index, src, tgt)` -> `(src, tgt)` under the empty-line policy, counting skipped pairs in
    `counts["skipped"]` and all pairs in `counts["pairs"]`; where_* are callables index -> str naming the location."""
    _check_empty_lines_policy(empty_lines)
    for i, s, t in pairs:
        counts["pairs"] += 1
        if empty_lines == "keep" or (s and t):
            yield s, t
            continue
        if empty_lines == "error":
            side = where_src(i) if not s else where_tgt(i)
            raise DataError(
                f"{side}: empty sentence. Remove the pair from both files, or load with empty_lines='skip' "
                f"to drop pairs with an empty side."
            )
        counts["skipped"] += 1


def _new_counts() -> dict[str, int]:
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


def _lang_file(prefix: Path, lang: str) -> Path:
    plain, gz = Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")
    if plain.is_file() and gz.is_file():
        raise DataError(f"both {plain} and {gz} exist; remove one so it is clear which to read.")
    if plain.is_file():
        return plain
    if gz.is_file():
        return gz
    present = _find_lang_files(prefix)
    if present:
        raise DataError(
            f"no file for language {lang!r} at prefix {prefix} (looked for {plain} and {gz}). Languages present "
            f"for this prefix: {', '.join(sorted(present))}. Pass source_lang/target_lang from these."
        )
    raise DataError(
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
        DataError: as `read_parallel_text`; a line-count difference is found when the shorter file ends.
    """
    if source_lang == target_lang:
        raise DataError(f"source_lang and target_lang are both {source_lang!r}; they must differ.")
    prefix = Path(prefix)
    src_path, tgt_path = _lang_file(prefix, source_lang), _lang_file(prefix, target_lang)
    counts = _new_counts() if counts is None else counts

    def aligned():
        src_lines, tgt_lines = iter_lines(src_path), iter_lines(tgt_path)
        n = 0
        for n, (s, t) in enumerate(itertools.zip_longest(src_lines, tgt_lines), start=1):
            if s is None or t is None:
                n_src = n - 1 + sum(1 for _ in src_lines) + (s is not None)
                n_tgt = n - 1 + sum(1 for _ in tgt_lines) + (t is not None)
                raise DataError(
                    f"line counts differ: {src_path} has {n_src} lines but {tgt_path} has {n_tgt} lines. "
                    f"Parallel files must be aligned line by line (one sentence per line, same number of lines)."
                )
            yield n, s, t

    yield from _empty_policy(aligned(), empty_lines, lambda n: f"{src_path}:{n}", lambda n: f"{tgt_path}:{n}", counts)


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
        DataError: missing file / unknown language (lists the languages present), empty file, non-UTF-8 bytes
            (file:line), different line counts (names both files and both counts), empty line with
            `empty_lines="error"`, `source_lang == target_lang`.
    """
    counts = _new_counts()
    pairs = list(iter_parallel_text(prefix, source_lang, target_lang, empty_lines=empty_lines, counts=counts))
    origin = " + ".join(map(str, parallel_files(prefix, source_lang, target_lang)))
    return _collected(pairs, counts, source_lang, target_lang, origin)


def _collected(pairs, counts, source_lang, target_lang, origin) -> ParallelText:
    skipped = counts["skipped"]
    if skipped:
        logger.warning("%s: skipped %d of %d pairs with an empty side", origin, skipped, counts["pairs"])
    if not pairs:
        raise DataError(f"{origin}: no non-empty sentence pairs left after skipping {skipped} empty ones.")
    src, tgt = (list(side) for side in zip(*pairs))
    return ParallelText(src, tgt, source_lang, target_lang, skipped, origin)


def iter_parallel_jsonl(
    path: PathLike, source_lang: str, target_lang: str, *, empty_lines: str = "skip",
    counts: dict[str, int] | None = None,
) -> Iterator[tuple[str, str]]:
    """Stream the pairs of a JSON-lines file in constant memory (what `read_parallel_jsonl` collects). `counts`, if
    given, receives `pairs` (records read) and `skipped`.

    Raises:
        DataError: as `read_parallel_jsonl`.
    """
    if source_lang == target_lang:
        raise DataError(f"source_lang and target_lang are both {source_lang!r}; they must differ.")
    path = Path(path)
    counts = _new_counts() if counts is None else counts

    def records():
        for lineno, line in enumerate(iter_lines(path), start=1):
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno}).") from None
            tr = rec.get("translation") if isinstance(rec, dict) else None
            if not isinstance(tr, dict):
                raise DataError(
                    f"{path}:{lineno}: expected an object with a 'translation' object, e.g. "
                    f'{{"translation": {{"{source_lang}": "...", "{target_lang}": "..."}}}}; got {line[:80]!r}.'
                )
            for lang in (source_lang, target_lang):
                if lang not in tr:
                    raise DataError(
                        f"{path}:{lineno}: language {lang!r} not in this record's 'translation'; codes present: "
                        f"{', '.join(sorted(map(str, tr))) or '(none)'}. Pass source_lang/target_lang from these."
                    )
                if not isinstance(tr[lang], str):
                    raise DataError(
                        f"{path}:{lineno}: translation[{lang!r}] must be a string, got {type(tr[lang]).__name__}."
                    )
            yield lineno, tr[source_lang].strip(), tr[target_lang].strip()

    yield from _empty_policy(records(), empty_lines, lambda n: f"{path}:{n} (translation[{source_lang!r}])",
                             lambda n: f"{path}:{n} (translation[{target_lang!r}])", counts)
    if counts["pairs"] == 0:
        raise DataError(f"{path}: no JSON records (only blank lines).")


def read_parallel_jsonl(
    path: PathLike, source_lang: str, target_lang: str, *, empty_lines: str = "skip"
) -> ParallelText:
    """Read a JSON-lines file (plain or `.gz`), one `{"translation": {"de": ..., "en": ...}}` object a line, into
    memory (`iter_parallel_jsonl` streams it).

    Blank lines are ignored. Extra languages and extra top-level fields are ignored.
    `empty_lines` applies to empty sentence strings, as in `read_parallel_text`.

    Raises:
        DataError: missing/empty/non-UTF-8 file; invalid JSON, missing `translation` field, missing language
            (lists the codes that record has) or non-string sentence, each with file:line.
    """
    counts = _new_counts()
    pairs = list(iter_parallel_jsonl(path, source_lang, target_lang, empty_lines=empty_lines, counts=counts))
    return _collected(pairs, counts, source_lang, target_lang, str(path))


def _is_jsonl(path: Path) -> bool:
    name = path.name[:-3] if path.name.endswith(".gz") else path.name
    return name.endswith(".jsonl") or name.endswith(".json")


def _translation_features(source_lang: str, target_lang: str):
    import datasets

    return datasets.Features({"translation": datasets.Translation(languages=[source_lang, target_lang])})


_content_keys: dict[tuple[str, int, int], str] = {}


def content_key(paths: Sequence[PathLike]) -> str:
    """SHA-256 of the files' bytes (in order): the cache key of the Arrow copy, so an edited file is read again and an
    unchanged one, even touched or copied, is not. Remembered per (path, size, mtime) within a process."""
    digest = hashlib.sha256()
    for path in paths:
        path = Path(path)
        stat = path.stat()
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        if key not in _content_keys:
            file_digest = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    file_digest.update(block)
            _content_keys[key] = file_digest.hexdigest()
        digest.update(_content_keys[key].encode())
    return digest.hexdigest()


def _generate_records(source: str, source_lang: str, target_lang: str, empty_lines: str, content: str):
    """Records of one local source, streamed (the generator `datasets.Dataset.from_generator` writes to Arrow);
    `content` is unused here but keys the cache."""
    path = Path(source)
    counts = _new_counts()
    read = iter_parallel_jsonl if _is_jsonl(path) else iter_parallel_text
    for s, t in read(path, source_lang, target_lang, empty_lines=empty_lines, counts=counts):
        yield {"translation": {source_lang: s, target_lang: t}}
    if counts["skipped"]:
        logger.warning("%s: skipped %d of %d pairs with an empty side", source, counts["skipped"], counts["pairs"])


def parallel_files(source: PathLike, source_lang: str, target_lang: str) -> list[Path]:
    """The files a source of `load_parallel_dataset` reads: the JSON-lines file, or the two files
    `{prefix}.{lang}[.gz]` of a prefix (as found on disk; `{prefix}.{lang}` where neither exists)."""
    path = Path(source)
    if _is_jsonl(path):
        return [path]
    files = []
    for lang in (source_lang, target_lang):
        plain, gz = Path(f"{path}.{lang}"), Path(f"{path}.{lang}.gz")
        files.append(gz if gz.is_file() and not plain.is_file() else plain)
    return files


def _load_split(source: PathLike, source_lang: str, target_lang: str, empty_lines: str):
    """One local source -> a memory-mapped Arrow `Dataset`, written once per file content and reused after (the
    `datasets` cache), streaming the files so the corpus is never held in Python objects."""
    import datasets
    from datasets.exceptions import DatasetGenerationError

    if source_lang == target_lang:
        raise DataError(f"source_lang and target_lang are both {source_lang!r}; they must differ.")
    path = Path(source)
    files = [path] if _is_jsonl(path) else [_lang_file(path, source_lang), _lang_file(path, target_lang)]
    for file in files:
        if not file.is_file():
            raise DataError(f"{file}: file not found (or not a regular file). Check the path/prefix and language "
                            f"code.")
    kwargs = {"source": str(path.resolve()), "source_lang": source_lang, "target_lang": target_lang,
              "empty_lines": empty_lines, "content": content_key(files)}
    try:
        dataset = datasets.Dataset.from_generator(_generate_records, features=_translation_features(
            source_lang, target_lang), gen_kwargs=kwargs)
    except DatasetGenerationError as error:  # the reader's own message, not datasets' wrapper
        cause = error.__cause__
        while cause is not None and not isinstance(cause, CheckError):
            cause = cause.__cause__
        if cause is None:
            raise
        raise cause from None
    if len(dataset) == 0:
        raise DataError(f"{source}: no non-empty sentence pairs left after skipping the empty ones.")
    return dataset


def _check_languages(ds, source_lang: str, target_lang: str, where: str = "") -> None:
    """Raise a DataError naming the codes present when a language is missing from the 'translation' records."""
    present = sorted(ds[0]["translation"])
    for lang in (source_lang, target_lang):
        if lang not in present:
            raise DataError(f"{where}language {lang!r} not in the dataset's 'translation' column; codes present: "
                            f"{', '.join(present)}.")


def _load_hub(hub_dataset, hub_config, source_lang, target_lang, empty_lines, hub_kwargs, num_proc=None):
    """A Hub dataset (or a local folder in the Hub's layout) -> `DatasetDict` of stripped pairs, cleaned batch by batch
    on its memory-mapped Arrow files (in `num_proc` processes), the result cached by `datasets`."""
    import datasets

    dsd = datasets.load_dataset(hub_dataset, hub_config, **(hub_kwargs or {}))
    if isinstance(dsd, datasets.Dataset):
        dsd = datasets.DatasetDict({"train": dsd})
    out = {}
    for split, ds in dsd.items():
        if "translation" not in ds.column_names:
            raise DataError(
                f"Hub dataset {hub_dataset!r} split {split!r} has no 'translation' column (columns: "
                f"{', '.join(ds.column_names)}). Convert it to {{'translation': {{src: ..., tgt: ...}}}} records "
                f"and save as JSON lines."
            )
        if len(ds) == 0:
            raise DataError(f"Hub dataset {hub_dataset!r} split {split!r} is empty.")
        _check_languages(ds, source_lang, target_lang, f"Hub dataset {hub_dataset!r} split {split!r}: ")
        where = f"Hub dataset {hub_dataset!r} split {split!r} row"
        cleaned = ds.map(_clean_batch, batched=True, with_indices=True, num_proc=num_proc,
                         remove_columns=ds.column_names, features=_translation_features(source_lang, target_lang),
                         fn_kwargs={"source_lang": source_lang, "target_lang": target_lang,
                                    "empty_lines": empty_lines, "where": where}, desc=f"Reading {split}")
        skipped = len(ds) - len(cleaned)
        if skipped:
            logger.warning("Hub %s/%s: skipped %d pairs with an empty side", hub_dataset, split, skipped)
        if len(cleaned) == 0:
            raise DataError(f"{where}s: no non-empty sentence pairs left after skipping {skipped} empty ones.")
        out[split] = cleaned
    return datasets.DatasetDict(out)


def _clean_batch(batch, indices, *, source_lang, target_lang, empty_lines, where):
    rows = ((i, (t[source_lang] or "").strip(), (t[target_lang] or "").strip())
            for i, t in zip(indices, batch["translation"]))
    pairs = _empty_policy(rows, empty_lines, lambda i: f"{where} {i} ({source_lang})",
                          lambda i: f"{where} {i} ({target_lang})", _new_counts())
    return {"translation": [{source_lang: s, target_lang: t} for s, t in pairs]}


def load_parallel_dataset(
    sources: PathLike | Mapping[str, PathLike] | None = None,
    source_lang: str = "de",
    target_lang: str = "en",
    *,
    empty_lines: str = "skip",
    hub_dataset: str | None = None,
    hub_config: str | None = None,
    hub_kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
):
    """Load sentence pairs as memory-mapped `datasets` objects with records `{"translation": {src: ..., tgt: ...}}`.

    Args:
        sources: either one source (returns a `datasets.Dataset`) or a mapping `split -> source` (returns a
            `datasets.DatasetDict`, e.g. `{"train": ".../train", "validation": ".../val"}`). A source is
            (a) a prefix of parallel text files `{prefix}.{lang}` / `{prefix}.{lang}.gz`, one sentence a line,
            or (b) a JSON-lines file ending in `.jsonl`/`.json` (optionally `.gz`), one
            `{"translation": {"de": ..., "en": ...}}` object a line.
        source_lang, target_lang: translation direction (default De→En, as Multi30k is usually reported).
        empty_lines: `"skip"` (default: drop pairs with an empty side, log the count), `"error"` (raise with
            file:line) or `"keep"`.
        hub_dataset, hub_config, hub_kwargs: instead of `sources`, call
            `datasets.load_dataset(hub_dataset, hub_config, **hub_kwargs)` (network access unless cached; only
            used when given). Must have a `translation` column. Returns a `DatasetDict`. `hub_dataset` may also be
            a local folder in the Hub's layout (`train.jsonl`, `validation.jsonl`, `test.jsonl`, ...).
        num_proc: processes that clean a Hub dataset's rows (default: this one).

    Local sources are streamed into Arrow files in the `datasets` cache, keyed by the files' content: a second load
    of unchanged files reads the cached copy, and no split is ever held in Python objects.

    Raises:
        DataError: see `read_parallel_text` / `read_parallel_jsonl`; also when both or neither of
            `sources` and `hub_dataset` are given.
    """
    import datasets

    _check_empty_lines_policy(empty_lines)
    if (sources is None) == (hub_dataset is None):
        raise DataError("pass exactly one of `sources` (local files) or `hub_dataset` (a Hub dataset name).")
    if hub_dataset is not None:
        return _load_hub(hub_dataset, hub_config, source_lang, target_lang, empty_lines, hub_kwargs, num_proc)
    if isinstance(sources, Mapping):
        if not sources:
            raise DataError("`sources` is an empty mapping; give at least one split, e.g. {'train': prefix}.")
        return datasets.DatasetDict(
            {split: _load_split(src, source_lang, target_lang, empty_lines) for split, src in sources.items()}
        )
    return _load_split(sources, source_lang, target_lang, empty_lines)


# --------------------------------------------------------------------------------------------------------------
# Shipped Multi30k
# --------------------------------------------------------------------------------------------------------------

#: split name -> file stem in vaswani_hf/corpora/multi30k
MULTI30K_SPLITS = {"train": "train", "validation": "val", "test": "test_2016_flickr"}
MULTI30K_ENV = "VASWANI_MULTI30K_DIR"


def multi30k_dir() -> Path:
    """Directory of the shipped Multi30k copy: `$VASWANI_MULTI30K_DIR` if set, else `corpora/multi30k` inside
    the `vaswani_hf` package (its package data, in a checkout and in any install alike).

    Raises:
        DataError: the directory does not exist (an install that left out the package data, or a wrong
            `VASWANI_MULTI30K_DIR`); the message says to reinstall, fix the variable or pass explicit paths.
    """
    env = os.environ.get(MULTI30K_ENV)
    d = Path(env) if env else Path(__file__).resolve().parent / "corpora" / "multi30k"
    if not d.is_dir():
        raise DataError(
            f"Multi30k directory {d} not found. The data is package data of vaswani_hf "
            f"(vaswani_hf/corpora/multi30k): reinstall the package, set {MULTI30K_ENV} to a folder holding the same "
            f"files, or pass explicit file prefixes to load_parallel_dataset()."
        )
    return d


def multi30k_file(split: str, lang: str, *, tokenized_lowercased: bool = False) -> Path:
    """Path of one shipped Multi30k file.

    Args:
        split: `"train"`, `"validation"` or `"test"` (test = test_2016_flickr).
        lang: `"de"` or `"en"`.
        tokenized_lowercased: if True, the official lowercased, punctuation-normalized, Moses-tokenized
            reference (`tok/*.lc.norm.tok.{lang}.gz`) used for "tokenized BLEU" (see `vaswani_hf.bleu`).
    """
    if split not in MULTI30K_SPLITS:
        raise DataError(f"unknown Multi30k split {split!r}; choose from {', '.join(MULTI30K_SPLITS)}.")
    if lang not in ("de", "en"):
        raise DataError(f"Multi30k task 1 has languages 'de' and 'en', not {lang!r}.")
    d = multi30k_dir()
    stem = MULTI30K_SPLITS[split]
    p = d / "tok" / f"{stem}.lc.norm.tok.{lang}.gz" if tokenized_lowercased else d / f"{stem}.{lang}.gz"
    if not p.is_file():
        raise DataError(f"{p}: shipped Multi30k file missing; reinstall vaswani-hf or restore it from git "
                        f"(vaswani_hf/corpora/multi30k).")
    return p


def load_multi30k(
    source_lang: str = "de",
    target_lang: str = "en",
    *,
    splits: Sequence[str] = ("train", "validation", "test"),
    empty_lines: str = "skip",
):
    """The default dataset: shipped Multi30k task 1 as a `DatasetDict` (train 29,000 / validation 1,014 /
    test 1,000 pairs; test = test2016 Flickr), De→En by default, with no network access.

    Example::

        >>> dsd = load_multi30k()              # De -> En
        >>> dsd["train"][0]["translation"]["en"]
        'Two young, White males are outside near many bushes.'
    """
    for lang in (source_lang, target_lang):
        if lang not in ("de", "en"):
            raise DataError(f"Multi30k task 1 has languages 'de' and 'en', not {lang!r}.")
    d = multi30k_dir()
    bad = [s for s in splits if s not in MULTI30K_SPLITS]
    if bad:
        raise DataError(f"unknown Multi30k split(s) {bad}; choose from {', '.join(MULTI30K_SPLITS)}.")
    return load_parallel_dataset(
        {s: d / MULTI30K_SPLITS[s] for s in splits}, source_lang, target_lang, empty_lines=empty_lines
    )


# --------------------------------------------------------------------------------------------------------------
# Tokenization
# --------------------------------------------------------------------------------------------------------------


def tokenize_dataset(
    dataset,
    tokenizer,
    source_lang: str,
    target_lang: str,
    max_length: int | None = None,
    *,
    max_target_length: int | None = None,
    num_proc: int | None = None,
    batch_size: int = 1000,
    keep_translation: bool = False,
):
    """Tokenize a `Dataset`/`DatasetDict` of `{"translation": ...}` records with any HF tokenizer.

    Produces `input_ids`, `attention_mask` (source) and `labels` (target token ids, as the tokenizer
    returns them for `text_target=`; e.g. ending in `</s>`), ready for
    `transformers.DataCollatorForSeq2Seq`.

    Args:
        max_length: truncate source sequences to this many tokens (`None`: no truncation).
        max_target_length: same for labels; defaults to `max_length`.
        keep_translation: keep the original `translation` column (default: removed).

    Raises:
        DataError: no `translation` column, or a language missing from it (lists the codes present);
            non-positive `max_length`.
    """
    import datasets

    if max_target_length is None:
        max_target_length = max_length
    for name, v in (("max_length", max_length), ("max_target_length", max_target_length)):
        if v is not None and (not isinstance(v, int) or v <= 0):
            raise DataError(f"{name} must be a positive int or None, got {v!r}.")
    parts = dataset.values() if isinstance(dataset, datasets.DatasetDict) else [dataset]
    for ds in parts:
        if "translation" not in ds.column_names:
            raise DataError(
                f"dataset has no 'translation' column (columns: {', '.join(ds.column_names)}); load it with "
                f"vaswani_hf.data.load_parallel_dataset()."
            )
        if len(ds):
            _check_languages(ds, source_lang, target_lang)

    return dataset.map(
        _tokenize_batch,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        remove_columns=None if keep_translation else ["translation"],
        fn_kwargs={"encode_source": Encoder(tokenizer, max_length),
                   "encode_target": Encoder(tokenizer, max_target_length, target=True),
                   "source_lang": source_lang, "target_lang": target_lang},
        desc="Tokenizing",
    )


def _tokenize_batch(batch, *, encode_source, encode_target, source_lang, target_lang):
    source = encode_source([t[source_lang] for t in batch["translation"]])
    return {"input_ids": source, "attention_mask": [[1] * len(ids) for ids in source],
            "labels": encode_target([t[target_lang] for t in batch["translation"]])}


class Encoder:
    """Texts -> token ids (`list[list[int]]`), as `tokenizer(texts, truncation=..., max_length=...)["input_ids"]`
    (with `text_target=` for `target=True`) gives them.

    A plain fast tokenizer (`PreTrainedTokenizerFast`, the joint BPE's class) is run through its `tokenizers` backend's
    `encode_batch_fast` on a copy with the truncation set: the same ids (tests/test_data.py), computed without offsets
    or Python `BatchEncoding` objects, 1.7x faster. Any other tokenizer (a subclass, a slow one, one with its own
    target mode) takes the ordinary call.
    """

    def __init__(self, tokenizer, max_length: int | None, *, target: bool = False):
        from transformers import PreTrainedTokenizerFast

        self.tokenizer, self.max_length, self.target = tokenizer, max_length, target
        self.backend = None
        if type(tokenizer) is PreTrainedTokenizerFast:
            from tokenizers import Tokenizer

            original = tokenizer.backend_tokenizer
            self.backend = Tokenizer.from_str(original.to_str())
            self.backend.encode_special_tokens = original.encode_special_tokens  # split_special_tokens=True
            if max_length is None:
                self.backend.no_truncation()
            else:
                self.backend.enable_truncation(max_length)
            self.backend.no_padding()

    def __call__(self, texts: list[str]) -> list[list[int]]:
        if self.backend is not None:
            return [encoding.ids for encoding in self.backend.encode_batch_fast(texts)]
        truncation = {"truncation": self.max_length is not None, "max_length": self.max_length}
        if self.target:
            return self.tokenizer(text_target=texts, **truncation)["input_ids"]
        return self.tokenizer(texts, **truncation)["input_ids"]


def iter_sentences(dataset, lang: str, batch_size: int = 10_000) -> Iterator[str]:
    """Stream one language's sentences from a `Dataset` of `{"translation": ...}` records, read from its Arrow data a
    batch at a time (for BPE training on corpora larger than memory)."""
    for table in dataset.select_columns(["translation"]).with_format("arrow").iter(batch_size=batch_size):
        yield from table.column("translation").combine_chunks().field(lang).to_pylist()


def _list_lengths(dataset, column: str) -> np.ndarray:
    """Lengths of a list column, read from the Arrow offsets (no Python list per example)."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(dataset.data.column(column)).to_numpy(zero_copy_only=False).astype(np.int64)
    indices = getattr(dataset, "_indices", None)  # after select()/shuffle(): rows of the underlying table
    if indices is not None:
        lengths = lengths[indices.column(0).to_numpy()]
    return lengths


def example_lengths(dataset, source_column: str = "input_ids", target_column: str = "labels"):
    """Per-example token counts `(src_lengths, tgt_lengths)` (int64 numpy arrays of shape `(len(dataset),)`) of a
    tokenized dataset, for `TokenBudgetBatchSampler`, read from the Arrow offsets without materializing the ids.

    Raises:
        DataError: a column is missing (tokenize first with `tokenize_dataset`).
    """
    for c in (source_column, target_column):
        if c not in dataset.column_names:
            raise DataError(
                f"column {c!r} not in dataset (columns: {', '.join(dataset.column_names)}); tokenize first "
                f"with tokenize_dataset()."
            )
    return _list_lengths(dataset, source_column), _list_lengths(dataset, target_column)


# --------------------------------------------------------------------------------------------------------------
# Token-budget batching
# --------------------------------------------------------------------------------------------------------------


def _as_lengths(x, name: str) -> np.ndarray:
    try:
        a = np.asarray(x)
    except Exception as e:  # pragma: no cover - exotic inputs
        raise DataError(f"{name} must be a sequence of non-negative ints ({e}).") from None
    if a.ndim != 1:
        raise DataError(f"{name} must be 1-D (one length per example), got shape {a.shape}.")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        if np.issubdtype(a.dtype, np.floating) and np.all(np.isfinite(a)) and np.all(a == np.round(a)):
            a = a.astype(np.int64)
        else:
            raise DataError(f"{name} must hold integer token counts, got dtype {a.dtype}.")
    a = a.astype(np.int64)
    if a.size and a.min() < 0:
        i = int(np.argmin(a))
        raise DataError(f"{name}[{i}] = {a[i]} is negative; lengths are token counts.")
    return a


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Batches of example indices holding at most `max_tokens` padded tokens, like fairseq `--max-tokens`.

    Paper §5.1: "Sentence pairs were batched together by approximate sequence length. Each training batch
    contained a set of sentence pairs containing approximately 25000 source tokens and 25000 target tokens."

    Algorithm (per epoch, deterministic given `seed` and `epoch`):

    1. Order examples by source length, then target length (as fairseq's `LanguagePairDataset`), ties broken
       by a random permutation drawn from `seed + epoch` (only same-length examples are reordered, so the
       batch *sizes* are the same every epoch while their contents vary).
    2. Greedily pack consecutive examples while `max(max(src_i, tgt_i) over the batch) * batch_size <=
       max_tokens` (fairseq's `num_tokens` = max of source and target length, counted padded) and, if given,
       `batch_size <= max_sentences`.
    3. Shuffle the batch order with `seed + epoch` (if `shuffle`; otherwise keep length order and no
       tie-break noise, e.g. for evaluation).
    4. Distributed: if `num_replicas > 1` the batch list is padded to a multiple of `num_replicas` by
       repeating batches from its start (the only duplicates; at most `num_replicas - 1` batches), then rank
       `r` takes batches `r, r + num_replicas, ...`. Every example is seen at least once per epoch on some
       rank, none is dropped, and every rank gets `len(self)` batches, so collective ops stay in step.
       If you pass the DataLoader through `accelerate.Accelerator.prepare`, keep `num_replicas=1`:
       accelerate shards batch samplers across processes itself (`even_batches=True` pads the same way).

    An example whose `max(src, tgt)` exceeds `max_tokens` makes the constructor raise (fairseq asserts the
    same), telling you to raise `max_tokens` or drop long examples (e.g. truncate with
    `tokenize_dataset(max_length=...)`); `skip_oversize=True` instead leaves them out and counts them in
    `num_skipped` (logged; like fairseq's `--skip-invalid-size-inputs-valid-test`).

    Call `set_epoch` before each epoch (as with `DistributedSampler`); otherwise every epoch repeats
    the order of epoch 0.

    Args:
        src_lengths: token count of each example's source (e.g. from `example_lengths`).
        tgt_lengths: token count of each target; `None` uses the source lengths only.
        max_tokens: token budget per batch (padded, per rank). Paper: ~25000 per side on 8 GPUs.
        max_sentences: optional cap on examples per batch.
        shuffle: shuffle batch order and break ties randomly (training); False for evaluation.
        seed: base random seed; must be the same on all ranks.
        num_replicas, rank: distributed split (defaults: single process).
        skip_oversize: see above.

    Raises:
        DataError: lengths of different sizes / negative / non-integer, `max_tokens` or `max_sentences` not
            a positive int, `rank` outside `[0, num_replicas)`, an oversize example (unless skipped), or no
            examples.
    """

    def __init__(
        self,
        src_lengths: Sequence[int],
        tgt_lengths: Sequence[int] | None = None,
        max_tokens: int = 4096,
        *,
        max_sentences: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        skip_oversize: bool = False,
        num_batches_multiple: int | None = None,
    ):
        src = _as_lengths(src_lengths, "src_lengths")
        tgt = src if tgt_lengths is None else _as_lengths(tgt_lengths, "tgt_lengths")
        if len(src) != len(tgt):
            raise DataError(f"src_lengths has {len(src)} entries but tgt_lengths has {len(tgt)}; one per example.")
        if len(src) == 0:
            raise DataError("no examples: src_lengths is empty.")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens <= 0:
            raise DataError(f"max_tokens must be a positive int, got {max_tokens!r}.")
        if max_sentences is not None and (
            isinstance(max_sentences, bool) or not isinstance(max_sentences, (int, np.integer)) or max_sentences <= 0
        ):
            raise DataError(f"max_sentences must be a positive int or None, got {max_sentences!r}.")
        if not isinstance(num_replicas, (int, np.integer)) or num_replicas < 1:
            raise DataError(f"num_replicas must be an int >= 1, got {num_replicas!r}.")
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < num_replicas:
            raise DataError(f"rank must be in [0, num_replicas={num_replicas}), got {rank!r}.")
        self.src_lengths, self.tgt_lengths = src, tgt
        self.num_tokens = np.maximum(np.maximum(src, tgt), 1)
        self.max_tokens, self.max_sentences = int(max_tokens), max_sentences
        self.shuffle, self.seed = shuffle, int(seed)
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        if num_batches_multiple is None:
            num_batches_multiple = self.num_replicas
        if isinstance(num_batches_multiple, bool) or not isinstance(num_batches_multiple, (int, np.integer)) or \
                num_batches_multiple < 1:
            raise DataError(f"num_batches_multiple must be an int >= 1, got {num_batches_multiple!r}.")
        self.num_batches_multiple = int(num_batches_multiple)
        self.epoch = 0

        over = np.nonzero(self.num_tokens > self.max_tokens)[0]
        if len(over) and not skip_oversize:
            show = ", ".join(f"#{i} ({self.num_tokens[i]} tokens)" for i in over[:5])
            raise DataError(
                f"{len(over)} example(s) longer than max_tokens={self.max_tokens}: {show}"
                f"{' ...' if len(over) > 5 else ''}. Raise --max_tokens to at least {int(self.num_tokens.max())}, "
                f"truncate/filter long examples (e.g. tokenize_dataset(max_length=...)), or pass "
                f"skip_oversize=True to leave them out."
            )
        self.num_skipped = int(len(over))
        if self.num_skipped:
            logger.warning("TokenBudgetBatchSampler: skipping %d example(s) longer than max_tokens=%d",
                           self.num_skipped, self.max_tokens)
        keep = np.ones(len(src), dtype=bool)
        keep[over] = False
        self._valid = np.nonzero(keep)[0]
        if len(self._valid) == 0:
            raise DataError(f"all {len(src)} examples are longer than max_tokens={self.max_tokens}.")
        self._sizes = self._batch_sizes(self._order(0))  # the same every epoch: only equal lengths are reordered

    # -- internals ------------------------------------------------------------------------------------------
    def _order(self, epoch: int) -> np.ndarray:
        idx = self._valid
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch, 0])
            idx = idx[rng.permutation(len(idx))]
        # stable sorts: primary key source length, secondary target length (fairseq LanguagePairDataset)
        idx = idx[np.argsort(self.tgt_lengths[idx], kind="stable")]
        idx = idx[np.argsort(self.src_lengths[idx], kind="stable")]
        return idx

    def _batch_sizes(self, order: np.ndarray) -> np.ndarray:
        """Greedy packing in `order`: each batch takes examples while (longest so far) x (count) fits the budget. A loop
        over batches, not examples: each step reads a window no longer than the batch can be, with numpy."""
        ntok = self.num_tokens[order]
        cap = self.max_sentences or len(order)
        sizes, start, n = [], 0, len(order)
        while start < n:
            width = min(n - start, cap, self.max_tokens // int(ntok[start]))
            longest = np.maximum.accumulate(ntok[start:start + width])
            fits = longest * np.arange(1, width + 1) <= self.max_tokens  # true, then false: both factors grow
            size = width if fits[-1] else int(np.argmin(fits))
            sizes.append(size)
            start += size
        return self._even_out(np.asarray(sizes, dtype=np.int64))

    def _even_out(self, sizes: np.ndarray) -> np.ndarray:
        """Split the largest batches in two until their count is a multiple of `num_batches_multiple`, so every
        process gets as many batches as the others and no example twice. Only the sizes are split (the same every
        epoch); a batch of one example cannot be split, and `__iter__` then repeats batches."""
        need = (-len(sizes)) % self.num_batches_multiple
        while need:
            splittable = np.nonzero(sizes >= 2)[0]
            if not len(splittable):
                break
            chosen = np.zeros(len(sizes), dtype=bool)
            chosen[splittable[np.argsort(-sizes[splittable], kind="stable")[:need]]] = True
            first = np.where(chosen, sizes // 2, sizes)
            halves = np.stack([first, sizes - first], axis=1).ravel()  # each split batch's two halves in place
            sizes = halves[halves > 0]
            need = (-len(sizes)) % self.num_batches_multiple
        return sizes

    def _epoch_batches(self, epoch: int) -> list[np.ndarray]:
        order = self._order(epoch)
        batches = np.split(order, np.cumsum(self._sizes)[:-1])
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch, 1])
            batches = [batches[j] for j in rng.permutation(len(batches))]
        return batches

    # -- public API -----------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Set the epoch used (with `seed`) for tie-breaking and batch shuffling. Call before each epoch."""
        self.epoch = int(epoch)

    def global_batches(self, epoch: int | None = None) -> list[list[int]]:
        """All batches of `epoch` (default: current) before the per-rank split, in iteration order."""
        return [b.tolist() for b in self._epoch_batches(self.epoch if epoch is None else int(epoch))]

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._epoch_batches(self.epoch)
        if self.num_replicas > 1:
            total = self.num_replicas * math.ceil(len(batches) / self.num_replicas)
            batches = batches + [batches[j % len(batches)] for j in range(total - len(batches))]
            batches = batches[self.rank::self.num_replicas]
        return (b.tolist() for b in batches)

    def __len__(self) -> int:
        """Batches this rank yields per epoch (the same on every rank and every epoch)."""
        return math.ceil(len(self._sizes) / self.num_replicas)

    @property
    def num_examples(self) -> int:
        """Examples covered per epoch (all of them minus `num_skipped`)."""
        return len(self._valid)


class PaddedBatches:
    """A tokenized `Dataset` read a batch at a time as one Arrow table and padded with numpy: the tensors
    `DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)` makes of the same rows (`input_ids` and
    `attention_mask` padded with `pad_token_id` and 0, `labels` with -100; the model shifts the labels into its
    decoder input itself), without a Python list per example: 7x faster a 25,000-token batch
    (benchmarks/bench_data.py), so the loader keeps up with an accelerator.

        batches = PaddedBatches(tokenized["train"], tokenizer.pad_token_id)
        loader = DataLoader(batches, batch_sampler=TokenBudgetBatchSampler(...), collate_fn=batches.collate)

    Raises:
        DataError: `input_ids` or `labels` missing from the dataset.
    """

    def __init__(self, dataset, pad_token_id: int, label_pad_token_id: int = -100):
        for column in ("input_ids", "labels"):
            if column not in dataset.column_names:
                raise DataError(f"column {column!r} not in dataset (columns: {', '.join(dataset.column_names)}); "
                                f"tokenize first with tokenize_dataset().")
        self.rows = dataset.select_columns(["input_ids", "labels"]).with_format("arrow")
        self.pad_token_id, self.label_pad_token_id = int(pad_token_id), int(label_pad_token_id)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitems__(self, indices: list[int]):
        return self.rows[list(indices)]

    def __getitem__(self, index: int):
        return self.rows[[index]]

    def collate(self, rows) -> dict[str, torch.Tensor]:
        """One Arrow table of rows (or a list of one-row tables) -> `{"input_ids", "attention_mask", "labels"}`, int64
        tensors of shape `(rows, longest)`."""
        import pyarrow as pa

        if isinstance(rows, list):
            rows = pa.concat_tables(rows)
        input_ids, attention_mask = _padded(rows.column("input_ids"), self.pad_token_id)
        labels, _ = _padded(rows.column("labels"), self.label_pad_token_id)
        return {"input_ids": input_ids, "attention_mask": attention_mask.long(), "labels": labels}


def _padded(column, value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An Arrow list column -> (ids padded on the right with `value`, the mask of real tokens)."""
    column = column.combine_chunks()
    lengths = np.diff(column.offsets.to_numpy())
    width = int(lengths.max()) if len(lengths) else 0
    mask = np.arange(width) < lengths[:, None]
    padded = np.full((len(lengths), width), value, dtype=np.int64)
    padded[mask] = column.flatten().to_numpy()  # row-major: the rows' tokens in order
    return torch.from_numpy(padded), torch.from_numpy(mask)


class StreamingTokenBudgetBatches(IterableDataset):
    """Token-budget batches (§5.1) from a stream of sentence pairs larger than memory: memory stays flat in the
    corpus size.

    The stream is read in pools of `pool_pairs` pairs. Each pool is tokenized (in one batched call of the fast
    tokenizer), cut into batches exactly as `TokenBudgetBatchSampler` cuts a corpus (sorted by length, packed to
    `max_tokens` padded tokens, batch order shuffled with `seed` and the epoch), and its batches are dealt to the
    processes in turn, the pool's batch count made a multiple of `num_replicas` by splitting its largest batches: every
    process gets the same number of batches and no pair twice. Pairs longer than the length limits are left out and
    counted in `num_dropped`; order across pools is the stream's (shuffle the corpus on disk once, as
    tensor2tensor's and fairseq's streaming readers expect). With DataLoader workers, worker `w` of `W` prepares
    pools `w, w + W, ...`; the DataLoader takes their batches in turn, so the order depends on `W`, not on timing.

    Each item is a list of `{"input_ids", "attention_mask", "labels"}` features, ready for
    `transformers.DataCollatorForSeq2Seq`: use `DataLoader(stream, batch_size=None, collate_fn=collator)`.
    A resumed run skips the batches it has already consumed (`skip_batches`): the stream is read again, so it must
    yield the same pairs in the same order.

    Args:
        pairs: a callable returning a fresh iterator of `(source, target)` strings each time (one per epoch), e.g.
            `lambda: iter_parallel_text(prefix, "en", "de")` (see `stream_parallel_pairs`).
        tokenizer: a fast tokenizer (`tokenizer(src)` and `tokenizer(text_target=tgt)` give the ids).
        max_tokens: token budget per batch per process (padded; fairseq's --max-tokens).
        max_source_length, max_target_length: longer pairs are left out (None: no limit besides `max_tokens`).
        pool_pairs: pairs read, tokenized and batched together (default 100,000; memory grows with it, not with the
            corpus).
        seed, shuffle: batch order within a pool (shuffled per epoch by default).
        num_replicas, rank: this process among the data-parallel ones.

    Raises:
        DataError: a bad budget, pool size or rank (see `TokenBudgetBatchSampler`).
    """

    def __init__(self, pairs, tokenizer, *, max_tokens: int, max_source_length: int | None = None,
                 max_target_length: int | None = None, pool_pairs: int = 100_000, seed: int = 0,
                 shuffle: bool = True, num_replicas: int = 1, rank: int = 0):
        if not callable(pairs):
            raise DataError("pairs must be a callable returning a fresh iterator of (source, target) pairs, e.g. "
                            "lambda: iter_parallel_text(prefix, 'en', 'de').")
        for name, value in (("max_tokens", max_tokens), ("pool_pairs", pool_pairs)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise DataError(f"{name} must be a positive int, got {value!r}.")
        if not isinstance(num_replicas, (int, np.integer)) or num_replicas < 1 or not 0 <= rank < num_replicas:
            raise DataError(f"rank must be in [0, num_replicas) with num_replicas >= 1, got rank={rank!r}, "
                            f"num_replicas={num_replicas!r}.")
        self.pairs, self.tokenizer = pairs, tokenizer
        self.max_tokens, self.pool_pairs = int(max_tokens), int(pool_pairs)
        self.max_source_length, self.max_target_length = max_source_length, max_target_length
        self.seed, self.shuffle, self.num_replicas, self.rank = int(seed), shuffle, int(num_replicas), int(rank)
        self.epoch, self.num_dropped = 0, 0
        self._encode_source, self._encode_target = Encoder(tokenizer, None), Encoder(tokenizer, None, target=True)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose batch order to draw (with `seed`); call before each epoch, as with `DistributedSampler`."""
        self.epoch = int(epoch)

    def _pool_batches(self, pool: list[tuple[str, str]], pool_index: int) -> Iterator[list[dict[str, list[int]]]]:
        # ids as one int32 array a pool and side, cut at offsets: a Python int per token would be 9x the memory
        sources, src = self._encode(self._encode_source, [s for s, _ in pool])
        targets, tgt = self._encode(self._encode_target, [t for _, t in pool])
        fits = np.maximum(np.maximum(src, tgt), 1) <= self.max_tokens
        if self.max_source_length is not None:
            fits &= src <= self.max_source_length
        if self.max_target_length is not None:
            fits &= tgt <= self.max_target_length
        kept = np.nonzero(fits)[0]
        self.num_dropped += len(pool) - len(kept)
        if not len(kept):
            return
        sampler = TokenBudgetBatchSampler(src[kept], tgt[kept], self.max_tokens, shuffle=self.shuffle,
                                          seed=self.seed * 1_000_003 + pool_index, num_replicas=self.num_replicas,
                                          rank=self.rank)
        sampler.set_epoch(self.epoch)
        src_starts, tgt_starts = np.cumsum(src) - src, np.cumsum(tgt) - tgt
        for batch in sampler:
            features = []
            for i in kept[batch].tolist():
                source = sources[src_starts[i]:src_starts[i] + src[i]].tolist()
                features.append({"input_ids": source, "attention_mask": [1] * len(source),
                                 "labels": targets[tgt_starts[i]:tgt_starts[i] + tgt[i]].tolist()})
            yield features

    @staticmethod
    def _encode(encoder, texts: list[str], chunk: int = 2000) -> tuple[np.ndarray, np.ndarray]:
        """All ids of `texts` in one int32 array, and each text's length."""
        ids, lengths = [], []
        for start in range(0, len(texts), chunk):
            encoded = encoder(texts[start:start + chunk])
            lengths.extend(map(len, encoded))
            ids.append(np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int32))
        return np.concatenate(ids) if ids else np.zeros(0, np.int32), np.asarray(lengths, dtype=np.int64)

    def __iter__(self) -> Iterator[list[dict[str, list[int]]]]:
        from torch.utils.data import get_worker_info

        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        stream = iter(self.pairs())
        for pool_index in itertools.count():
            pool = list(itertools.islice(stream, self.pool_pairs))
            if not pool:
                return
            if pool_index % num_workers == worker_id:
                yield from self._pool_batches(pool, pool_index)


def stream_parallel_pairs(source: PathLike | None = None, source_lang: str = "de", target_lang: str = "en", *,
                          empty_lines: str = "skip", hub_dataset: str | None = None, hub_config: str | None = None,
                          split: str = "train"):
    """A callable that streams the `(source, target)` pairs of one split afresh at each call, for
    `StreamingTokenBudgetBatches`: local files (a prefix of parallel text files or a JSON-lines file, read by
    `iter_parallel_text` / `iter_parallel_jsonl`) or a Hub dataset (or local folder in the Hub's layout) opened with
    `datasets.load_dataset(..., streaming=True)`. Nothing is read until it is called.

    Raises:
        DataError: both or neither of `source` and `hub_dataset` given.
    """
    if (source is None) == (hub_dataset is None):
        raise DataError("pass exactly one of `source` (local files) or `hub_dataset` (a Hub dataset name or folder).")
    if source is not None:
        path = Path(source)
        read = iter_parallel_jsonl if _is_jsonl(path) else iter_parallel_text
        return lambda: read(path, source_lang, target_lang, empty_lines=empty_lines)

    def hub_pairs():
        import datasets

        rows = datasets.load_dataset(hub_dataset, hub_config, split=split, streaming=True)
        indexed = ((i, (row["translation"][source_lang] or "").strip(), (row["translation"][target_lang] or "").strip())
                   for i, row in enumerate(rows))
        where = f"Hub dataset {hub_dataset!r} split {split!r} row"
        yield from _empty_policy(indexed, empty_lines, lambda i: f"{where} {i} ({source_lang})",
                                 lambda i: f"{where} {i} ({target_lang})", _new_counts())

    return hub_pairs


def padding_fraction(
    batches: Sequence[Sequence[int]], src_lengths: Sequence[int], tgt_lengths: Sequence[int] | None = None
) -> float:
    """Fraction of token slots that are padding when each batch's sources are padded to the batch's longest
    source and targets to the longest target (what `DataCollatorForSeq2Seq` does), summed over both sides:
    `sum(pad slots) / sum(all slots)` in [0, 1). `tgt_lengths=None` measures the source side only."""
    src = _as_lengths(src_lengths, "src_lengths")
    sides = [src] if tgt_lengths is None else [src, _as_lengths(tgt_lengths, "tgt_lengths")]
    total = real = 0
    for b in batches:
        if len(b) == 0:
            continue
        b = np.asarray(b, dtype=np.int64)
        for lens in sides:
            lb = lens[b]
            total += int(lb.max()) * len(b)
            real += int(lb.sum())
    if total == 0:
        raise DataError("padding_fraction: no tokens in the given batches.")
    return 1.0 - real / total
