"""Translating lists of sentences with a trained model: length-sorted batches through `generate()` (or another
decoding function, such as the paper's in `paper.py`), output in input order. Used by the training scripts'
evaluation, the `vaswani-translate` command and the demo page."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence

import torch


def translate_sentences(
    model,
    tokenizer,
    sentences: Sequence[str],
    *,
    batch_size: int = 64,
    num_beams: int | None = None,
    length_penalty: float | None = None,
    max_new_tokens: int | None = None,
    max_source_length: int | None = None,
    generate_fn: Callable | None = None,
    progress: Callable | None = None,
    workers: int | None = None,
    **generate_kwargs,
) -> list[str]:
    """Translate `sentences`; returns one detokenized string per input, in input order.

    Sentences are sorted by length and cut into batches of `batch_size`, so that little padding is computed; a
    padded batch gives the same translations as one sentence at a time. An empty sentence (or one of whitespace only)
    translates to "" without a model call: given only `</s>`, a model would invent a sentence.

    Args:
        model: a `VaswaniForConditionalGeneration` (or any seq2seq LM); it is put in eval mode.
        tokenizer: its tokenizer.
        batch_size: sentences per `generate()` call (default 64).
        num_beams, length_penalty: default to the model's generation config (beam 4, 0.6 for paper models), the
            penalty applied as `generate()` does: the score divided by |Y|^length_penalty.
        max_new_tokens: cap on output length; default: source length + 50 (§6.1).
        max_source_length: truncate sources to this many tokens (default: no truncation).
        generate_fn: `fn(model, input_ids=..., attention_mask=..., **kwargs) -> ids` to use instead of
            `model.generate` (e.g. the paper's GNMT-penalty decoding, `vaswani_hf.decoding.paper_generate`).
        progress: optional callable taking the number of sentences just finished (e.g. a tqdm `update`).
        workers: batches decoded side by side on a CPU, each on one of torch's threads (default: torch's thread
            count; 1: one batch at a time on all threads). The translations are the same either way.
    Raises:
        ValueError: an empty list, a non-string item, `batch_size` / `num_beams` / `max_new_tokens` /
            `max_source_length` / `workers` < 1, a non-finite `length_penalty`, or a sentence longer than the model
            takes (see `VaswaniConfig.max_positions`): refused before any batch is translated.
    """
    if isinstance(sentences, str):
        raise ValueError("translate_sentences: pass a list of sentences, not a single string.")
    sentences = list(sentences)
    if not sentences:
        raise ValueError("translate_sentences: the input list is empty; there is nothing to translate.")
    for i, s in enumerate(sentences):
        if not isinstance(s, str):
            raise ValueError(f"translate_sentences: item {i} is {type(s).__name__}, not str.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"translate_sentences: batch_size must be an integer >= 1, got {batch_size!r}.")
    if num_beams is not None and (isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1):
        raise ValueError(f"translate_sentences: num_beams must be an integer >= 1, got {num_beams!r}.")
    for name, value in (("max_new_tokens", max_new_tokens), ("max_source_length", max_source_length),
                        ("workers", workers)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"translate_sentences: {name} must be an integer >= 1 or None, got {value!r}.")
    if length_penalty is not None and not math.isfinite(length_penalty):
        raise ValueError(f"translate_sentences: length_penalty must be a finite number, got {length_penalty!r}.")
    model.eval()
    device = next(model.parameters()).device
    outputs = [""] * len(sentences)
    kept = [i for i, s in enumerate(sentences) if s.strip()]  # the empty ones stay ""
    if progress is not None and len(kept) < len(sentences):
        progress(len(sentences) - len(kept))
    if not kept:
        return outputs
    encoded = dict(zip(kept, tokenizer([sentences[i] for i in kept], truncation=max_source_length is not None,
                                       max_length=max_source_length)["input_ids"]))
    limit = _position_limit(model)
    if limit is not None:
        longest = max(kept, key=lambda i: len(encoded[i]))
        length = len(encoded[longest])
        if length > limit:
            reason = (f"max_position_embeddings={limit} of this model's learned positions"
                      if model.config.position_embedding_type == "learned" else
                      f"the {limit} positions this model attends over (attention would hold {length}^2 scores per head "
                      "and sentence)")
            raise ValueError(f"translate_sentences: sentence {longest}: Sequence of {length} tokens is longer than "
                             f"{reason}; nothing was translated. Truncate the input (max_source_length=...) or split "
                             "it into sentences.")
    order = sorted(kept, key=lambda i: len(encoded[i]))
    if num_beams is not None:
        generate_kwargs["num_beams"] = num_beams
    if length_penalty is not None:
        generate_kwargs["length_penalty"] = length_penalty
    generate = generate_fn or (lambda m, **kw: m.generate(**kw))

    def translate(index: list[int]) -> list[str]:
        with torch.inference_mode():  # per thread
            batch = tokenizer.pad({"input_ids": [encoded[i] for i in index]}, return_tensors="pt")
            batch = {k: v.to(device) for k, v in batch.items()}
            new_tokens = max_new_tokens if max_new_tokens is not None else batch["input_ids"].shape[1] + 50
            # max_length counts the decoder start token too; outputs stop where the model's positions end.
            max_length = new_tokens + 1 if limit is None else min(new_tokens + 1, limit)
            ids = generate(model, **batch, max_length=max_length, **generate_kwargs)
            return tokenizer.batch_decode(ids, skip_special_tokens=True)

    batches = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    # generate()'s fast paths held for the whole call: the weights, which do not change in it, are packed once rather
    # than once a batch (about 7 ms a call at the cpu preset; nested generate() calls find them installed)
    hold = getattr(model, "inference_fast_paths", None)  # our models' (VaswaniGenerationMixin), remote code's too
    with hold() if callable(hold) else contextlib.nullcontext():
        for index, texts in zip(batches, map_batches(translate, batches, device, workers), strict=True):
            for i, text in zip(index, texts):
                outputs[i] = text.strip()
            if progress is not None:
                progress(len(index))
    return outputs


def map_batches(function: Callable, batches: list, device: torch.device, workers: int | None = None):
    """`function` over `batches`, in order. On a CPU with several threads and several batches, the batches are
    decoded side by side, one thread of torch's each (`workers`, default: torch's thread count): a beam search's small
    products and its Python bookkeeping gain less from two threads sharing each product than from two searches."""
    if workers is None:
        workers = torch.get_num_threads() if device.type == "cpu" else 1
    workers = max(1, min(workers, len(batches)))
    if workers == 1:
        yield from map(function, batches)
        return
    from concurrent.futures import ThreadPoolExecutor

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="translate") as pool:
            yield from pool.map(function, batches)
    finally:
        torch.set_num_threads(threads)


def _position_limit(model) -> int | None:
    """The most positions a source or target of `model` may have (`VaswaniConfig.max_positions`), or `None` for
    another model."""
    return getattr(model.config, "max_positions", None) if getattr(model.config, "model_type", None) == "vaswani" \
        else None


__all__ = ["map_batches", "translate_sentences"]
