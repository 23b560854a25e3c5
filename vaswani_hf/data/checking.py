"""The one check of parallel data, called by every door that reads it (the in-memory loaders, the streams, and the
training commands before any work): the splits a command needs are there (`check_splits`), every record is a
`{"translation": {source_lang: str, target_lang: str}}` object (`translation_pair`, as each record is read), and each
split holds at least one pair with both sides non-empty (`first_pair`). `check_parallel_data` runs all three on local
files or a dataset (a Hub name, or a local folder in the Hub's layout) by reading only up to the first usable pair of
each split.

Bad input raises `CheckError` (`vaswani_hf.checks`, a `ValueError`) naming the file and line, or the dataset, split
and row, what is wrong and what to do.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..checks import CheckError
from .reading import (
    check_empty_lines_policy,
    empty_policy,
    is_jsonl,
    iter_parallel_jsonl,
    iter_parallel_text,
    new_counts,
)
from .records import translation_pair

__all__ = ["check_parallel_data", "check_splits", "first_pair", "translation_pair"]

#: the splits the commands read, in the order they are checked
SPLITS = ("train", "validation", "test")
_LAYOUT = ("a folder in the Hub's layout holds train.jsonl (and validation.jsonl, test.jsonl), one "
           '{"translation": {...}} object a line')


def check_splits(present: Iterable[str], required: Sequence[str], where: str, *, hint: str = _LAYOUT) -> None:
    """Refuse data without a split a command needs (`required`, e.g. ("train",)); `hint` says what to give.

    Raises:
        CheckError: naming the missing split, the splits present and the layout expected.
    """
    present = list(present)
    for split in required:
        if split not in present:
            raise CheckError(f"{where} has no {split!r} split (splits: {', '.join(present) or 'none'}); {hint}.")


def first_pair(pairs: Iterable[tuple[str, str]], where: str) -> tuple[str, str]:
    """The first pair of a reader's pairs (already under the empty-line policy), or an error when it yields none.

    Raises:
        CheckError: no pair with both sides non-empty (an empty split, blank lines only, or every pair with an
            empty side); and whatever the reader raises for its first records.
    """
    with contextlib.closing(iter(pairs)) if hasattr(pairs, "close") else contextlib.nullcontext(iter(pairs)) as it:
        for pair in it:
            return pair
    raise CheckError(f"{where}: no sentence pair with both sides non-empty (the split is empty, holds blank lines "
                     f"only, or every pair has an empty side). Give data with at least one pair.")


def _empty_files(folder: Path) -> list[Path]:
    """Data files of a folder in the Hub's layout that hold nothing but white space (`datasets` fails on them with
    an error that names no file)."""
    empty = []
    for path in sorted([*folder.glob("*.*"), *folder.glob("data/*.*")]):
        if not path.is_file() or path.name.startswith(".") or path.suffix.lower() in (".md", ".py", ".lock"):
            continue
        size = path.stat().st_size
        if size == 0 or (size <= 1 << 16 and not path.read_bytes().strip()):
            empty.append(path)
    return empty


def open_dataset(hub_dataset: str, hub_config: str | None = None, **kwargs):
    """`datasets.load_dataset(hub_dataset, hub_config, **kwargs)` with its failures as `CheckError`s that name the
    dataset (and, in a local folder, the empty file at fault).

    Raises:
        CheckError: an empty data file in a local folder, no data found, splits that do not hold the same kind of
            records, or a dataset that cannot be reached.
    """
    import datasets

    if Path(hub_dataset).is_dir():
        empty = _empty_files(Path(hub_dataset))
        if empty:
            raise CheckError(f"{empty[0]}: the file is empty; each split of a dataset folder needs at least one "
                             f"record ({_LAYOUT}). Remove the file or fill it.")
        check_one_set_per_split(Path(hub_dataset))
    try:
        return datasets.load_dataset(hub_dataset, hub_config, **kwargs)
    except CheckError:
        raise
    except Exception as error:  # datasets' own (StopIteration, SplitsNotFoundError, CastError, ...) name no record
        raise CheckError(f"dataset {hub_dataset!r}: datasets cannot read it ({_reason(error)}). Check the name, or "
                         f"that every split holds the same kind of records: {_LAYOUT}.") from None


_SHARD = re.compile(r"^(?P<set>.+)-\d+-of-\d+(?P<suffix>\..+)?$")


def folder_split_files(folder: Path) -> dict[str, list[Path]]:
    """The files `datasets.load_dataset(folder)` reads into each split of a folder without a loading script or a
    README `configs:` section: every file whose name starts with the split's name or one of its aliases (`test` takes
    `test2017.jsonl` too, `validation` takes `dev.jsonl`). {} for a folder that configures its own splits."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    readme = folder / "README.md"
    if any(folder.glob("*.py")) or (readme.is_file() and "configs:" in readme.read_text(errors="replace")):
        return {}
    try:
        files = DataFilesDict.from_patterns(get_data_patterns(str(folder)), base_path=str(folder))
    except Exception:  # no pattern matched: load_dataset's own error names it
        return {}
    return {str(split): sorted(Path(name) for name in names) for split, names in files.items()}


def check_one_set_per_split(folder: Path) -> None:
    """Each split of a dataset folder is one set of records: one file, or the shards of one (`train-00000-of-00002`).

    Raises:
        CheckError: a split would join files of several sets (`test.jsonl` and `test2017.jsonl` are both `test` to
            `datasets`), naming them.
    """
    for split, files in folder_split_files(folder).items():
        sets = {(_SHARD.match(path.name) or re.match(r"(?P<set>.*)", path.name))["set"] for path in files}
        if len(sets) > 1:
            raise CheckError(
                f"dataset folder {folder}: its {split!r} split would join {len(files)} files of different sets "
                f"({', '.join(path.name for path in files)}): datasets reads every file whose name starts with "
                f"'{split}' or an alias of it as that split. Keep one file (or the shards of one) per split in the "
                "folder, and move the others out, or give each its own folder.")


def _reason(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def dataset_rows(rows: Iterable[Any], where: str) -> Iterator[tuple[int, Any]]:
    """`(row number, record)` of a dataset split as read, a failure of `datasets` while reading (records of another
    kind than the first split's) as a `CheckError` naming the split and row."""
    i = 0
    iterator = iter(rows)
    while True:
        try:
            record = next(iterator)
        except StopIteration:
            return
        except CheckError:
            raise
        except Exception as error:  # a CastError from pyarrow names no split or row
            raise CheckError(f"{where} {i}: cannot be read ({_reason(error)}). Every split must hold the same kind of "
                             f"records: {_LAYOUT}.") from None
        yield i, record
        i += 1


def check_parallel_data(sources: Mapping[str, Any] | None = None, source_lang: str = "de", target_lang: str = "en",
                        *, hub_dataset: str | None = None, hub_config: str | None = None,
                        required: Sequence[str] = ("train",), empty_lines: str = "skip",
                        flags: Mapping[str, str] | None = None) -> list[str]:
    """The one check of a command's parallel data before any work: the `required` splits are there, and each split
    (of train, validation, test) yields a valid first record and at least one pair with both sides non-empty under
    `empty_lines`. Reads each split only up to its first usable pair.

    Args:
        sources: local files, split -> source (a `{prefix}.{lang}` prefix or a JSON-lines file), or
        hub_dataset, hub_config: a dataset opened with `datasets.load_dataset(..., streaming=True)`: a local folder in
            the Hub's layout, or a Hub name (read over the network unless cached).
        required: the splits the command cannot do without.
        flags: split -> the command's flag that gave its source, to name in messages ("--train_file").

    Returns:
        the splits present, of train, validation and test.

    Raises:
        CheckError: both or neither of `sources` and `hub_dataset`; the same language twice; a missing split; an
            empty file or split; a record of another layout, with a missing language or a non-string sentence (file
            and line, or dataset, split and row); or what the readers raise for the first records.
    """
    check_empty_lines_policy(empty_lines)
    if (sources is None) == (hub_dataset is None):
        raise CheckError("pass exactly one of `sources` (local files) or `hub_dataset` (a dataset name or folder).")
    if source_lang == target_lang:
        raise CheckError(f"source_lang and target_lang are both {source_lang!r}; they must differ.")
    if sources is not None:
        check_splits(sources, required, "the data")
        for split, source in sources.items():
            where = f"{flags[split]} {source}" if flags and split in flags else f"{split} split ({source})"
            first_pair(source_pairs(source, source_lang, target_lang, empty_lines), where)
        return [split for split in SPLITS if split in sources]
    where = f"Hub dataset {hub_dataset!r}"
    splits = open_dataset(hub_dataset, hub_config, streaming=True)
    check_splits(splits, required, where)
    for split in SPLITS:
        if split in splits:
            first_pair(hub_pairs(splits[split], source_lang, target_lang, empty_lines, f"{where} split {split!r}"),
                       f"{where} split {split!r}")
    return [split for split in SPLITS if split in splits]


def source_pairs(source, source_lang: str, target_lang: str, empty_lines: str):
    """The pairs of one local source as read (`iter_parallel_jsonl` or `iter_parallel_text`)."""
    read = iter_parallel_jsonl if is_jsonl(Path(source)) else iter_parallel_text
    return read(Path(source), source_lang, target_lang, empty_lines=empty_lines)


def hub_pairs(rows: Iterable[Any], source_lang: str, target_lang: str, empty_lines: str, where: str,
              counts: dict[str, int] | None = None) -> Iterator[tuple[str, str]]:
    """The pairs of a dataset split's records as read, each record checked (`translation_pair`) and the empty-line
    policy applied; `where` names the split ("Hub dataset 'x' split 'train'")."""
    def indexed():
        for i, record in dataset_rows(rows, f"{where} row"):
            yield (i, *translation_pair(record, source_lang, target_lang, f"{where} row {i}"))

    yield from empty_policy(indexed(), empty_lines, lambda i: f"{where} row {i} ({source_lang})",
                             lambda i: f"{where} row {i} ({target_lang})", new_counts() if counts is None else counts)
