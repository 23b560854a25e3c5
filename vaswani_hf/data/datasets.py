"""Memory-mapped `datasets.Dataset`s of sentence pairs: local files (read by `reading`) streamed into Arrow files in
the `datasets` cache, keyed by the files' content (`content_key`), or a Hugging Face Hub dataset (or a local folder in
the Hub's layout) cleaned batch by batch on its own Arrow files; and, for corpora larger than memory, pair streams read
afresh each epoch (`stream_parallel_pairs`).

Nothing is downloaded unless the caller explicitly asks for a Hub dataset (`load_parallel_dataset(hub_dataset=...)`,
`stream_parallel_pairs(hub_dataset=...)`). Records have the layout used by the `transformers` translation examples::

    {"translation": {"de": "Zwei junge weiße Männer ...", "en": "Two young, White males ..."}}

Bad input raises `CheckError` (`vaswani_hf.checks`, a `ValueError`) naming the file and line, or the dataset, split
and row.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..checks import CheckError
from .caches import load_with_healing, map_with_healing
from .checking import first_pair, hub_pairs, open_dataset, source_pairs
from .reading import (
    PathLike,
    check_empty_lines_policy,
    empty_policy,
    is_jsonl,
    iter_parallel_jsonl,
    iter_parallel_text,
    lang_file,
    new_counts,
)
from .records import translation_pair

logger = logging.getLogger(__name__)

__all__ = ["content_key", "load_parallel_dataset", "stream_parallel_pairs"]


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
    counts = new_counts()
    read = iter_parallel_jsonl if is_jsonl(path) else iter_parallel_text
    for s, t in read(path, source_lang, target_lang, empty_lines=empty_lines, counts=counts):
        yield {"translation": {source_lang: s, target_lang: t}}
    if counts["skipped"]:
        logger.warning("%s: skipped %d of %d pairs with an empty side", source, counts["skipped"], counts["pairs"])



def _load_split(source: PathLike, source_lang: str, target_lang: str, empty_lines: str):
    """One local source -> a memory-mapped Arrow `Dataset`, written once per file content and reused after (the
    `datasets` cache), streaming the files so the corpus is never held in Python objects."""
    import datasets
    from datasets.exceptions import DatasetGenerationError
    from datasets.io.generator import GeneratorDatasetInputStream

    if source_lang == target_lang:
        raise CheckError(f"source_lang and target_lang are both {source_lang!r}; they must differ.")
    path = Path(source)
    files = [path] if is_jsonl(path) else [lang_file(path, source_lang), lang_file(path, target_lang)]
    for file in files:
        if not file.is_file():
            raise CheckError(f"{file}: file not found (or not a regular file). Check the path/prefix and language "
                            f"code.")
    first_pair(source_pairs(path, source_lang, target_lang, empty_lines), str(source))  # before datasets' own error
    kwargs = {"source": str(path.resolve()), "source_lang": source_lang, "target_lang": target_lang,
              "empty_lines": empty_lines, "content": content_key(files)}
    features = _translation_features(source_lang, target_lang)

    def load():
        try:
            return datasets.Dataset.from_generator(_generate_records, features=features, gen_kwargs=kwargs)
        except DatasetGenerationError as error:  # the reader's own message, not datasets' wrapper
            cause = error.__cause__
            while cause is not None and not isinstance(cause, CheckError):
                cause = cause.__cause__
            if cause is None:
                raise
            raise cause from None

    def builder(cache_dir):  # the builder from_generator makes, to find its cache folder
        return GeneratorDatasetInputStream(_generate_records, features=features, gen_kwargs=kwargs,
                                           cache_dir=cache_dir).builder

    dataset = load_with_healing(load, builder)  # a damaged cache entry is named, removed and written again
    if len(dataset) == 0:
        raise CheckError(f"{source}: no non-empty sentence pairs left after skipping the empty ones.")
    return dataset


def _check_languages(ds, source_lang: str, target_lang: str, where: str = "dataset ") -> None:
    """Raise a CheckError when the first record is not a 'translation' object holding both languages
    (`translation_pair`)."""
    translation_pair(ds[0], source_lang, target_lang, f"{where}row 0")


def _load_hub(hub_dataset, hub_config, source_lang, target_lang, empty_lines, hub_kwargs, num_proc=None):
    """A Hub dataset (or a local folder in the Hub's layout) -> `DatasetDict` of stripped pairs, cleaned batch by batch
    on its memory-mapped Arrow files (in `num_proc` processes), the result cached by `datasets`."""
    import datasets

    kwargs = dict(hub_kwargs or {})
    # the builder load_dataset makes (without its reading options), to find its cache folder
    built = {k: v for k, v in kwargs.items() if k not in ("split", "keep_in_memory", "num_proc", "verification_mode",
                                                          "save_infos", "streaming", "cache_dir")}
    dsd = load_with_healing(lambda: open_dataset(hub_dataset, hub_config, **kwargs),
                            lambda cache_dir: datasets.load_dataset_builder(hub_dataset, hub_config,
                                                                            cache_dir=cache_dir, **built),
                            kwargs.get("cache_dir"))
    if isinstance(dsd, datasets.Dataset):
        dsd = datasets.DatasetDict({"train": dsd})
    named = (hub_kwargs or {}).get("split")  # one split asked for: messages name it, not the "train" it is kept as
    out = {}
    for split, ds in dsd.items():
        where = f"Hub dataset {hub_dataset!r} split {named if isinstance(named, str) else split!r}"
        first_pair(hub_pairs(ds, source_lang, target_lang, empty_lines, where), where)
        where = f"{where} row"
        cleaned = map_with_healing(ds, _clean_batch, batched=True, with_indices=True, num_proc=num_proc,
                                   remove_columns=ds.column_names,
                                   features=_translation_features(source_lang, target_lang),
                                   fn_kwargs={"source_lang": source_lang, "target_lang": target_lang,
                                              "empty_lines": empty_lines, "where": where}, desc=f"Reading {split}")
        skipped = len(ds) - len(cleaned)
        if skipped:
            logger.warning("Hub %s/%s: skipped %d pairs with an empty side", hub_dataset, split, skipped)
        if len(cleaned) == 0:
            raise CheckError(f"{where}s: no non-empty sentence pairs left after skipping {skipped} empty ones.")
        out[split] = cleaned
    return datasets.DatasetDict(out)


def _clean_batch(batch, indices, *, source_lang, target_lang, empty_lines, where):
    rows = ((i, *translation_pair(record, source_lang, target_lang, f"{where} {i}"))
            for i, record in zip(indices, ({"translation": t} for t in batch["translation"])))
    pairs = empty_policy(rows, empty_lines, lambda i: f"{where} {i} ({source_lang})",
                          lambda i: f"{where} {i} ({target_lang})", new_counts())
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
        CheckError: see `read_parallel_text` / `read_parallel_jsonl`; also when both or neither of
            `sources` and `hub_dataset` are given.
    """
    import datasets

    check_empty_lines_policy(empty_lines)
    if (sources is None) == (hub_dataset is None):
        raise CheckError("pass exactly one of `sources` (local files) or `hub_dataset` (a Hub dataset name).")
    if hub_dataset is not None:
        return _load_hub(hub_dataset, hub_config, source_lang, target_lang, empty_lines, hub_kwargs, num_proc)
    if isinstance(sources, Mapping):
        if not sources:
            raise CheckError("`sources` is an empty mapping; give at least one split, e.g. {'train': prefix}.")
        return datasets.DatasetDict(
            {split: _load_split(src, source_lang, target_lang, empty_lines) for split, src in sources.items()}
        )
    return _load_split(sources, source_lang, target_lang, empty_lines)


def stream_parallel_pairs(source: PathLike | None = None, source_lang: str = "de", target_lang: str = "en", *,
                          empty_lines: str = "skip", hub_dataset: str | None = None, hub_config: str | None = None,
                          split: str = "train"):
    """A callable that streams the `(source, target)` pairs of one split afresh at each call, for
    `StreamingTokenBudgetBatches`: local files (a prefix of parallel text files or a JSON-lines file, read by
    `iter_parallel_text` / `iter_parallel_jsonl`) or a Hub dataset (or local folder in the Hub's layout) opened with
    `datasets.load_dataset(..., streaming=True)`. Nothing is read until it is called.

    Raises:
        CheckError: both or neither of `source` and `hub_dataset` given.
    """
    if (source is None) == (hub_dataset is None):
        raise CheckError("pass exactly one of `source` (local files) or `hub_dataset` (a Hub dataset name or folder).")
    if source is not None:
        path = Path(source)
        read = iter_parallel_jsonl if is_jsonl(path) else iter_parallel_text
        return lambda: read(path, source_lang, target_lang, empty_lines=empty_lines)

    def pairs():
        rows = open_dataset(hub_dataset, hub_config, split=split, streaming=True)
        where = f"Hub dataset {hub_dataset!r} split {split!r}"
        yield from hub_pairs(rows, source_lang, target_lang, empty_lines, where)

    return pairs
