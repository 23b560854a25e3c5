"""Tokenizing `{"translation": ...}` records with any Hugging Face tokenizer: the `input_ids`, `attention_mask` and
`labels` of a dataset (`tokenize_dataset`, with `datasets.map`), texts to ids with a plain fast tokenizer's
`tokenizers` backend (`Encoder`), and one language's sentences streamed from Arrow for BPE training (`iter_sentences`).

Bad input raises `CheckError` (`vaswani_hf.checks`, a `ValueError`) that names the column or language at fault.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..checks import CheckError
from .caches import map_with_healing
from .datasets import _check_languages

__all__ = ["Encoder", "iter_sentences", "tokenize_dataset"]


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

    The result is cached by `datasets` beside the dataset's Arrow files; a cached file found damaged
    (`caches.map_with_healing`) is named in a warning, removed and computed again.

    Raises:
        CheckError: no `translation` column, or a language missing from it (lists the codes present);
            non-positive `max_length`.
    """
    import datasets

    if max_target_length is None:
        max_target_length = max_length
    for name, v in (("max_length", max_length), ("max_target_length", max_target_length)):
        if v is not None and (not isinstance(v, int) or v <= 0):
            raise CheckError(f"{name} must be a positive int or None, got {v!r}.")
    parts = dataset.values() if isinstance(dataset, datasets.DatasetDict) else [dataset]
    for ds in parts:
        if "translation" not in ds.column_names:
            raise CheckError(
                f"dataset has no 'translation' column (columns: {', '.join(ds.column_names)}); load it with "
                f"vaswani_hf.data.load_parallel_dataset()."
            )
        if len(ds):
            _check_languages(ds, source_lang, target_lang)

    return map_with_healing(  # a damaged cache file of an earlier run is named, removed and written again
        dataset,
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
