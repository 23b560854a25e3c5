"""Cache entries checked before they are used: a damaged or partial entry is named in a warning, removed and built
again, so that a run never loads it.

- Arrow files of the `datasets` cache (a builder's folder: `Dataset.from_generator` for local files,
  `datasets.load_dataset` for a folder in the Hub's layout; and the `cache-*.arrow` files of `Dataset.map`):
  `arrow_file_problem` reads a file's schema and record batch headers (from its memory map, as `datasets` does when
  it opens the file, without reading the data) and finds a missing, empty, cut short or unreadable file, or one
  with fewer rows than its `dataset_info.json` says; `load_with_healing` and `map_with_healing` run a load, check
  what it read, and on a damaged entry warn, remove it and load once more. `datasets` itself writes every entry
  into a temporary name and renames it when complete, so a crash mid-write leaves nothing a later load reads.
  Bytes changed inside the text or token ids of a file whose structure is intact are not detected: that would need
  a digest of every file, read in full on every run.
- Folders written whole (the cached joint BPE): `write_manifest` records the SHA-256 of each file in
  `vaswani_cache.json`, written last into a temporary folder renamed into place; `manifest_problem` finds a missing
  or changed file, or no manifest (a folder never completed).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from ..checks import CheckError, read_json

logger = logging.getLogger(__name__)

__all__ = ["MANIFEST_NAME", "arrow_file_problem", "builder_entry_problem", "load_with_healing", "manifest_problem",
           "map_with_healing", "remove_damaged", "write_manifest"]

T = TypeVar("T")

# The IPC stream format's end-of-stream marker: continuation token, then a metadata length of 0.
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"
MANIFEST_NAME = "vaswani_cache.json"


def arrow_file_problem(path: str | os.PathLike, rows: int | None = None, schema=None) -> str | None:
    """What is wrong with the Arrow stream file `path` as `datasets` wrote it, or None when it is whole: missing,
    empty, unreadable (pyarrow's reason), cut short (no end-of-stream marker: a file cut between two record batches
    reads without error, short of rows), another number of rows than `rows`, or a schema other than `schema`."""
    import datasets
    import pyarrow as pa

    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    if size == 0:
        return "empty"
    try:
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_stream(source)
            if b"huggingface" in (reader.schema.metadata or {}):  # the features datasets reads back with the schema
                datasets.Features.from_arrow_schema(reader.schema)
            table = reader.read_all()  # zero-copy: the batches' headers are read, their data only mapped
            _validate_offsets(table)
            count = table.num_rows
            end = source.tell()
            source.seek(size - len(_END_OF_STREAM))
            tail = source.read(len(_END_OF_STREAM))
    except Exception as error:  # pyarrow's and datasets' errors on a damaged file are of many types
        return f"unreadable: {type(error).__name__}: {error}"
    if end != size or tail != _END_OF_STREAM:
        return "cut short (no end-of-stream marker)"
    if rows is not None and count != rows:
        return f"{count} rows where {rows} were written"
    if schema is not None and not reader.schema.remove_metadata().equals(schema.remove_metadata()):
        return f"schema {reader.schema.remove_metadata()} where {schema.remove_metadata()} was written"
    return None


def _bytes_type(kind):
    """`kind` with every string type as the binary type of the same layout (nested types included)."""
    import pyarrow as pa

    if pa.types.is_string(kind):
        return pa.binary()
    if pa.types.is_large_string(kind):
        return pa.large_binary()
    if pa.types.is_struct(kind):
        return pa.struct([field.with_type(_bytes_type(field.type)) for field in kind])
    if pa.types.is_list(kind):
        return pa.list_(kind.value_field.with_type(_bytes_type(kind.value_type)))
    if pa.types.is_large_list(kind):
        return pa.large_list(kind.value_field.with_type(_bytes_type(kind.value_type)))
    if pa.types.is_fixed_size_list(kind):
        return pa.list_(kind.value_field.with_type(_bytes_type(kind.value_type)), kind.list_size)
    return kind


def _validate_offsets(table) -> None:
    """Raise when a table's offsets (strings, lists) point outside its buffers, which would make a later read touch
    memory outside the file (a crash, not an error). Its strings are viewed as bytes: their UTF-8 is not read, so the
    check costs the offsets alone (a few hundredths of a second for a million sentence pairs)."""
    import pyarrow as pa

    table.validate()  # buffer sizes against lengths
    for column in table.columns:
        kind = _bytes_type(column.type)
        pa.chunked_array([chunk.view(kind) for chunk in column.chunks], kind).validate(full=True)


def builder_entry_problem(entry: str | os.PathLike) -> str | None:
    """What is wrong with a `datasets` builder's cache folder (`builder.cache_dir`), or None when it is whole or holds
    no finished dataset (no `dataset_info.json`: `datasets` then writes it afresh): `dataset_info.json` that does not
    parse, or an Arrow file it lists (`arrow_file_problem`) missing, damaged, or with other row counts or features."""
    import datasets
    from datasets.naming import filenames_for_dataset_split

    entry = Path(entry)
    if not (entry / "dataset_info.json").exists():
        return None
    try:
        info = datasets.DatasetInfo.from_dict(read_json(entry / "dataset_info.json"))
        splits = dict(info.splits or {})
        schema = info.features.arrow_schema if info.features is not None else None
    except Exception as error:  # any field damaged: the folder cannot be read as datasets wrote it
        return f"dataset_info.json unreadable: {error}"
    name = info.dataset_name or info.builder_name
    for split in splits.values():
        files = filenames_for_dataset_split(str(entry), name, split.name, "arrow", split.shard_lengths)
        rows = split.shard_lengths if split.shard_lengths and len(files) > 1 else [split.num_examples]
        for file, expected in zip(files, rows):
            problem = arrow_file_problem(file, expected, schema)
            if problem:
                return f"{Path(file).name} {problem}"
    return None


def remove_damaged(path: str | os.PathLike, problem: str, rebuild: str = "building it again") -> None:
    """Warn that the cache entry `path` (a file or a folder) is damaged, naming it and `problem`, and remove it."""
    path = Path(path)
    logger.warning("The cache entry %s is damaged (%s); removing it and %s.", path, problem, rebuild)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _cache_files(dataset) -> list[Path]:
    """The Arrow files behind a `Dataset` or every split of a `DatasetDict` (none for one held in memory)."""
    parts = dataset.values() if isinstance(dataset, dict) else [dataset]  # a DatasetDict is a dict
    return [Path(f["filename"]) for part in parts for f in part.cache_files]


def builder_entry(make_builder: Callable[[str | None], Any], cache_dir: str | os.PathLike | None) -> Path:
    """The cache folder of the builder `make_builder(cache_dir)` makes (`builder.cache_dir`). A builder reads its
    cached `dataset_info.json` when made, so a damaged one fails here: the folder is then found by making the same
    builder under an empty root and taking its path relative to that root."""
    import datasets

    try:
        return Path(make_builder(cache_dir).cache_dir)
    except Exception:  # the cached dataset_info.json of the entry is damaged: find the entry without reading it
        with tempfile.TemporaryDirectory() as root:
            relative = Path(make_builder(root).cache_dir).relative_to(root)
        return Path(cache_dir or datasets.config.HF_DATASETS_CACHE).expanduser() / relative


def load_with_healing(load: Callable[[], T], make_builder: Callable[[str | None], Any],
                      cache_dir: str | os.PathLike | None = None) -> T:
    """`load()` (a `datasets` call that builds and reads one builder's cache folder), with the folder checked: when
    `load()` fails on it, or what it read is damaged (`builder_entry_problem`), the folder is named in a warning,
    removed and built again by a second `load()`.

    `make_builder(cache_dir)` makes the builder `load()` uses (under another root when given), to find its folder
    when `load()` fails. A failure with the folder whole (bad input), or where no builder can be made, is raised as
    it is."""
    try:
        result = load()
    except Exception as error:
        try:
            entry = builder_entry(make_builder, cache_dir)
        except Exception:  # no builder for this input: the load's own error says why
            raise error from None
        problem = builder_entry_problem(entry)
        if problem is None:
            raise
        remove_damaged(entry, problem)
        return load()
    # a dataset read from no file (an Arrow file cut after its schema reads as 0 rows, held in memory): ask the builder
    entries = {file.parent for file in _cache_files(result)} or {builder_entry(make_builder, cache_dir)}
    for entry in sorted(entries):
        problem = builder_entry_problem(entry)
        if problem:
            remove_damaged(entry, problem)
            return load()
    return result


def _damaged(files: Iterable[Path]) -> list[tuple[Path, str]]:
    return [(file, problem) for file in files if (problem := arrow_file_problem(file))]


def map_with_healing(dataset, function, **kwargs):
    """`dataset.map(function, **kwargs)` (a `Dataset` or `DatasetDict`), its `cache-*.arrow` files checked: when the
    map fails on a damaged cache file beside `dataset`'s Arrow files, or the files it read are damaged
    (`arrow_file_problem`), each is named in a warning and removed, and the map runs once more (and writes them
    again). A `CheckError` and a failure with every cache file whole are raised as they are."""
    try:
        result = dataset.map(function, **kwargs)
    except CheckError:
        raise
    except Exception:
        folders = sorted({file.parent for file in _cache_files(dataset)})
        damaged = _damaged(file for folder in folders for file in sorted(folder.glob("cache-*.arrow")))
        if not damaged:
            raise
    else:
        damaged = _damaged(_cache_files(result))
        if not damaged:
            return result
    for file, problem in damaged:
        remove_damaged(file, problem, "computing it again")
    return dataset.map(function, **kwargs)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: str | os.PathLike) -> None:
    """Record the SHA-256 of every file of `folder` in `folder/vaswani_cache.json`: call it last, on a complete
    folder, before renaming it into the cache."""
    folder = Path(folder)
    files = {path.name: _sha256(path) for path in sorted(folder.iterdir()) if path.is_file()}
    (folder / MANIFEST_NAME).write_text(json.dumps({"sha256": files}, indent=1) + "\n", encoding="utf-8")


def manifest_problem(folder: str | os.PathLike) -> str | None:
    """What is wrong with a cache folder written with `write_manifest`, or None when every file it lists is there
    with the SHA-256 it had: no manifest (the folder was never completed), a manifest that does not parse, a file
    missing or changed (truncated, garbled, emptied)."""
    folder = Path(folder)
    if not (folder / MANIFEST_NAME).is_file():
        return f"no {MANIFEST_NAME} listing its files"
    try:
        files = read_json(folder / MANIFEST_NAME)["sha256"]
        if not isinstance(files, dict) or not files:
            raise CheckError(f"{folder / MANIFEST_NAME}: lists no files.")
    except (CheckError, KeyError, TypeError) as error:
        return f"{MANIFEST_NAME} unreadable: {error}"
    for name, digest in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} missing"
        if _sha256(path) != digest:
            return f"{name} changed since it was written (truncated or damaged)"
    return None
