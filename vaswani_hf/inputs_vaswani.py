"""What the model is given, checked where transformers or torch would fail deep inside or not at all: token ids inside
the vocabulary (`check_input_ids`), labels inside the target vocabulary (`check_labels`), encoder rows that pair with
the decoder's (`check_encoder_rows`), and generation settings of the right types (`check_generation_values`). Each
raises a `ValueError` that says what was wrong and how to put it right.

It imports only torch: transformers copies it beside the model code (relative imports) for `trust_remote_code=True`.
"""

import math
import numbers
from collections.abc import Callable, Mapping

import torch


def check_labels(labels: torch.Tensor, vocab_size: int) -> None:
    """Raise a clear error for labels outside [0, vocab_size) other than -100 (no loss there), where that costs no
    device sync and no graph break (CPU tensors, eager); on a GPU the loss kernel's device-side assert stops instead.

    Raises:
        ValueError: naming the first such label.
    """
    if labels.device.type != "cpu" or torch.compiler.is_compiling():
        return
    bad = labels.ne(-100) & (labels.lt(0) | labels.ge(vocab_size))
    if bool(bad.any()):
        raise ValueError(f"labels hold token id {int(labels[bad][0])}, outside this model's target vocabulary of "
                         f"{vocab_size} entries (-100 marks positions without loss). The tokenizer does not match the "
                         "model: use the tokenizer saved with it.")


def check_input_ids(ids: torch.Tensor, vocab_size: int, name: str = "input_ids") -> None:
    """Raise a clear error for token ids outside the embedding table (a tokenizer/model vocabulary mismatch); the
    stacks call it on entry. On a GPU it is an asynchronous device assertion (no host sync); a compiled or exported
    forward skips it (check the ids before the call there: `check_input_ids(ids, model.config.vocab_size)`).

    Raises:
        ValueError: an id is negative or not less than `vocab_size` (CPU tensors).
    """
    if torch.compiler.is_compiling() or not ids.numel():
        return
    if ids.device.type != "cpu":
        torch._assert_async(((ids >= 0) & (ids < vocab_size)).all(),
                            f"{name} holds a token id outside this model's vocabulary of {vocab_size} entries")
        return
    high, low = int(ids.max()), int(ids.min())
    if high >= vocab_size or low < 0:
        raise ValueError(
            f"{name} holds token id {high if high >= vocab_size else low}, outside this model's vocabulary of "
            f"{vocab_size} entries. The tokenizer does not match the model: load the tokenizer saved with the model, "
            "or resize the embeddings with model.resize_token_embeddings(len(tokenizer))."
        )


def check_encoder_rows(attention: Callable, batch: int, rows: int) -> None:
    """Encoder-decoder attention needs one encoder row per decoder row; an `attention` function that declares
    `shares_encoder_rows` (kernels_vaswani.py's, which `generate()` runs) also takes one row per k consecutive
    decoder rows (a sentence's beams).

    Raises:
        ValueError: the rows do not pair up that way.
    """
    shared = getattr(attention, "shares_encoder_rows", False)
    if rows != batch and not (shared and batch % rows == 0):
        raise ValueError(
            f"Encoder-decoder attention got {batch} decoder rows for {rows} encoder rows: pass one encoder row per "
            f"decoder row (repeat_interleave the encoder output and its mask)"
            + (", or k consecutive decoder rows per encoder row." if shared else "."))


# Generation settings whose wrong type transformers reports deep inside a decoding loop, or not at all.
_INTEGERS = ("num_beams", "num_return_sequences", "max_length", "max_new_tokens", "min_length", "min_new_tokens",
             "top_k", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "num_beam_groups")
_AT_LEAST_ONE = ("num_beams", "num_return_sequences")  # transformers divides by them or sizes tensors with them
_NUMBERS = ("length_penalty", "temperature", "top_p", "min_p", "typical_p", "repetition_penalty",
            "encoder_repetition_penalty", "diversity_penalty", "epsilon_cutoff", "eta_cutoff", "max_time")
_FLAGS = ("do_sample", "use_cache", "output_scores", "output_logits", "output_attentions", "output_hidden_states",
          "return_dict_in_generate", "renormalize_logits", "remove_invalid_values")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "forced_bos_token_id",
              "forced_eos_token_id")
GENERATION_FIELDS = _INTEGERS + _NUMBERS + _FLAGS + _TOKEN_IDS + ("early_stopping",)


def _is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_generation_values(values: Mapping, where: str) -> None:
    """Refuse generation settings (`GenerationConfig` fields or `generate()` keywords) of the wrong type, which
    transformers would report as a `TypeError` deep in its decoding loop (`length_penalty="x"`) or not at all
    (`max_length=3.5`). Names not in `GENERATION_FIELDS` and `None` values are not checked.

    Args:
        values: field name -> value.
        where: what the values come from, for the message (a file, "generate()").
    Raises:
        ValueError: naming `where`, the field, its value and the type it must have.
    """
    for name, value in values.items():
        if value is None or name not in GENERATION_FIELDS:
            continue
        if name in _INTEGERS:
            minimum = 1 if name in _AT_LEAST_ONE else None
            good = _is_integer(value) and (minimum is None or value >= minimum)
            expected = "an integer >= 1" if minimum else "an integer"
        elif name in _NUMBERS:
            good = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            expected = "a finite number"
        elif name in _FLAGS:
            good, expected = isinstance(value, bool), "true or false"
        elif name == "early_stopping":
            good, expected = isinstance(value, bool) or value == "never", 'true, false or "never"'
        else:  # token ids; eos_token_id may list several
            ids = value if name == "eos_token_id" and isinstance(value, (list, tuple)) else [value]
            good = bool(ids) and all(_is_integer(i) and i >= 0 for i in ids)
            expected = "a token id (an integer >= 0)" + (" or a list of them" if name == "eos_token_id" else "")
        if not good:
            raise ValueError(f"{where}: {name} must be {expected}, got {value!r}. Pass or write it as "
                             f"{expected.split(' (')[0]} (in JSON without quotes for numbers and true/false).")
