"""The default corpus: the copy of Multi30k task 1 shipped as package data in `vaswani_hf/corpora/multi30k` (see its
README for origin, terms and citation), read with no network access.

Bad input (an unknown split or language, a missing folder or file) raises `CheckError` (`vaswani_hf.checks`, a
`ValueError`) that says how to fix it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ..checks import CheckError
from .datasets import load_parallel_dataset

__all__ = ["MULTI30K_ENV", "MULTI30K_SPLITS", "load_multi30k", "multi30k_dir", "multi30k_file"]


#: split name -> file stem in vaswani_hf/corpora/multi30k
MULTI30K_SPLITS = {"train": "train", "validation": "val", "test": "test_2016_flickr"}
MULTI30K_ENV = "VASWANI_MULTI30K_DIR"


def multi30k_dir() -> Path:
    """Directory of the shipped Multi30k copy: `$VASWANI_MULTI30K_DIR` if set, else `corpora/multi30k` inside
    the `vaswani_hf` package (its package data, in a checkout and in any install alike).

    Raises:
        CheckError: the directory does not exist (an install that left out the package data, or a wrong
            `VASWANI_MULTI30K_DIR`); the message says to reinstall, fix the variable or pass explicit paths.
    """
    env = os.environ.get(MULTI30K_ENV)
    # this module lives in vaswani_hf/data/: the package folder, which holds corpora/, is its parent's parent
    d = Path(env) if env else Path(__file__).resolve().parent.parent / "corpora" / "multi30k"
    if not d.is_dir():
        raise CheckError(
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
        raise CheckError(f"unknown Multi30k split {split!r}; choose from {', '.join(MULTI30K_SPLITS)}.")
    if lang not in ("de", "en"):
        raise CheckError(f"Multi30k task 1 has languages 'de' and 'en', not {lang!r}.")
    d = multi30k_dir()
    stem = MULTI30K_SPLITS[split]
    p = d / "tok" / f"{stem}.lc.norm.tok.{lang}.gz" if tokenized_lowercased else d / f"{stem}.{lang}.gz"
    if not p.is_file():
        raise CheckError(f"{p}: shipped Multi30k file missing; reinstall vaswani-hf or restore it from git "
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
            raise CheckError(f"Multi30k task 1 has languages 'de' and 'en', not {lang!r}.")
    d = multi30k_dir()
    bad = [s for s in splits if s not in MULTI30K_SPLITS]
    if bad:
        raise CheckError(f"unknown Multi30k split(s) {bad}; choose from {', '.join(MULTI30K_SPLITS)}.")
    return load_parallel_dataset(
        {s: d / MULTI30K_SPLITS[s] for s in splits}, source_lang, target_lang, empty_lines=empty_lines
    )
