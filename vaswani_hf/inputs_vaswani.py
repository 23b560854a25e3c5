"""What the model is given, checked where transformers or torch would fail deep inside or not at all: token ids inside
the vocabulary (`check_input_ids`), masks and labels that fit the ids they go with (`check_model_inputs`), labels
inside the target vocabulary (`check_labels`), encoder rows that pair with the decoder's (`check_encoder_rows`),
generation settings of the right types (`check_generation_values`), and of a saved folder: a config.json that holds
every field a save writes (`check_config_fields`) and a generation_config.json that agrees with it
(`check_generation_file`). Each raises a `ValueError` that says what was wrong and how to put it right.

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
        ValueError: `ids` is not a `(batch, length)` tensor of integers with at least one row and one column
            (`check_ids_layout`), or an id is negative or not less than `vocab_size` (CPU tensors).
    """
    if torch.compiler.is_compiling():
        return
    check_ids_layout(ids, name)
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


def check_ids_layout(ids, name: str) -> None:
    """Refuse token ids that are not a `(batch, length)` tensor of integers with at least one sentence of at least one
    token: torch fails on them deep inside (a reshape of 0 elements, an embedding of float indices, a 1-D row
    broadcast against d_model). Shape and dtype only: no device sync.

    Raises:
        ValueError: naming `name`, what it is and what to pass.
    """
    if not torch.is_tensor(ids):
        raise ValueError(f"{name} must be a torch tensor of token ids (batch, length), got {type(ids).__name__}: "
                         "pass the tokenizer's output with return_tensors='pt'.")
    if ids.ndim != 2 or 0 in ids.shape:
        raise ValueError(f"{name} must be a (batch, length) tensor with at least one sentence of at least one token "
                         f"(the tokenizer ends each with </s>), got shape {tuple(ids.shape)}: add the batch "
                         "dimension with ids[None] for one sentence.")
    if ids.dtype not in _ID_DTYPES:
        raise ValueError(f"{name} must hold integer token ids (torch.long), got {ids.dtype}: pass the tokenizer's ids, "
                         "or ids.long() if they are whole numbers.")


_ID_DTYPES = (torch.int64, torch.int32)  # what nn.Embedding indexes with


def _rows_and_length(ids, embeds, name: str) -> tuple[int, int] | None:
    """(batch, length) of the ids (layout checked) or of the embeddings `(B, L, D)`; None if neither is given."""
    if ids is not None:
        check_ids_layout(ids, name)
        return ids.shape[0], ids.shape[1]
    if torch.is_tensor(embeds) and embeds.ndim == 3:
        return embeds.shape[0], embeds.shape[1]
    return None


def _check_mask(mask, name: str, ids_name: str, rows: int | None, widths: tuple[int, ...] | None,
                values: bool) -> None:
    """A (rows, width) mask of 1 (token) and 0 (padding), as integers or booleans, with a token in every row."""
    if not torch.is_tensor(mask):
        raise ValueError(f"{name} must be a torch tensor of 1 (token) and 0 (padding), got {type(mask).__name__}: "
                         "pass the tokenizer's attention_mask with return_tensors='pt'.")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        # an additive mask (0 keep, -inf drop) would read as its inverse here, where 0 is padding
        raise ValueError(f"{name} must hold 1 (token) and 0 (padding) as integers or booleans, got {mask.dtype}: pass "
                         f"the tokenizer's attention_mask, or mask.long() of a 0/1 mask (an additive mask of 0 and "
                         f"-inf is (mask == 0).long()).")
    if mask.ndim != 2:
        raise ValueError(f"{name} must be a (batch, length) tensor like {ids_name}, got shape {tuple(mask.shape)}.")
    if rows is not None and mask.shape[0] != rows:
        raise ValueError(f"{name} has {mask.shape[0]} rows but {ids_name} has {rows}: pass one mask row per "
                         f"sentence (the tokenizer's attention_mask of the same batch).")
    if widths is not None and mask.shape[1] not in widths:
        raise ValueError(f"{name} has {mask.shape[1]} positions but {ids_name} has {widths[0]}: pass the mask of the "
                         f"same padded batch (one 1 or 0 per token).")
    if not values or mask.device.type != "cpu" or torch.jit.is_tracing():
        return  # values are read on a CPU only: on a GPU reading them would be a host sync per call
    if mask.dtype != torch.bool:
        odd = mask.ne(0) & mask.ne(1)
        if bool(odd.any()):
            raise ValueError(f"{name} holds {int(mask[odd][0])}, where 1 marks a token and 0 padding: pass a mask of "
                             f"1s and 0s (the tokenizer's attention_mask).")
    empty = mask.eq(0).all(dim=1)
    if bool(empty.any()):
        raise ValueError(f"{name} row {int(empty.nonzero()[0, 0])} is all 0: that sentence has no token to attend to, "
                         f"and its output would be made of padding. Every row needs a 1 for each of its tokens "
                         f"(ending in </s>); drop an empty sentence from the batch.")


def check_model_inputs(input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                       inputs_embeds=None, decoder_inputs_embeds=None, encoder_outputs=None, cache=None,
                       labels=None) -> None:
    """Refuse model inputs that do not fit together, which torch reports as a size mismatch deep inside or not at all
    (an all-zero mask row gives a finite loss over nothing). Checks what is given, as `forward` and `generate()` take
    it:

    - `input_ids`, `decoder_input_ids`: `check_ids_layout` (`(batch, length)` integers, not empty);
    - `attention_mask`: the `(batch, length)` of the encoder input (`input_ids`, `inputs_embeds` or `encoder_outputs`),
      1 and 0 as integers or booleans (never floats: an additive mask would read inverted); on a CPU, where the
      encoder runs in this call (no `encoder_outputs`), values 0 or 1 with a 1 in every row;
    - `decoder_attention_mask`: one row per decoder row, as wide as the decoder input (P + T with a cache of P
      positions; a static cache's width is not checked), and the same values on a CPU; or a ready 4-D mask as
      `generate()` builds for a static cache, `(batch, 1, T, keys)`, boolean or additive;
    - `labels`: `(batch, length)` of torch.long, the shape of the decoder input where that is given, else one row per
      encoder row.

    Values are read on CPU tensors only (no device sync), and nothing is checked under `torch.compile` or export.

    Raises:
        ValueError: naming the argument, what is wrong and what to pass.
    """
    if torch.compiler.is_compiling():
        return
    if encoder_outputs is not None:
        states = encoder_outputs[0]
        encoder = tuple(states.shape[:2]) if torch.is_tensor(states) and states.ndim == 3 else None
        encoder_name = "encoder_outputs"
    else:
        encoder = _rows_and_length(input_ids, inputs_embeds, "input_ids")
        encoder_name = "input_ids" if input_ids is not None else "inputs_embeds"
    decoder = _rows_and_length(decoder_input_ids, decoder_inputs_embeds, "decoder_input_ids")
    decoder_name = "decoder_input_ids" if decoder_input_ids is not None else "decoder_inputs_embeds"
    if attention_mask is not None:
        _check_mask(attention_mask, "attention_mask", encoder_name, encoder and encoder[0], encoder and encoder[1:],
                    values=encoder_outputs is None)
    static = cache is not None and getattr(cache, "is_compileable", False)
    if torch.is_tensor(decoder_attention_mask) and decoder_attention_mask.ndim == 4:  # generate()'s, static cache
        shape, dtype = tuple(decoder_attention_mask.shape), decoder_attention_mask.dtype
        if (decoder is not None and shape[:3] != (decoder[0], 1, decoder[1])) or not (
                dtype == torch.bool or dtype.is_floating_point):
            raise ValueError(f"decoder_attention_mask of 4 dimensions must be a ready (batch, 1, T, keys) mask, "
                             f"boolean (True attends) or additive (0 attends), for {decoder_name} of shape "
                             f"{decoder}; got {shape} of {dtype}. Pass the (batch, length) 1/0 mask instead.")
    elif decoder_attention_mask is not None:
        widths = None if decoder is None or static else \
            (decoder[1] + (cache.get_seq_length() if cache is not None else 0),)
        _check_mask(decoder_attention_mask, "decoder_attention_mask", decoder_name, decoder and decoder[0], widths,
                    values=True)
    if labels is not None:
        _check_labels_layout(labels, decoder, decoder_name, encoder, encoder_name)


def _check_labels_layout(labels, decoder, decoder_name: str, encoder, encoder_name: str) -> None:
    if not torch.is_tensor(labels) or labels.ndim != 2 or 0 in labels.shape or labels.dtype != torch.long:  # the loss
        what = f"shape {tuple(labels.shape)} of {labels.dtype}" if torch.is_tensor(labels) else type(labels).__name__
        raise ValueError(f"labels must be a (batch, length) tensor of target token ids (torch.long, -100 where no loss "
                         f"is wanted) with at least one token per row, got {what}: pass the tokenizer's text_target "
                         "ids.")
    if decoder is not None and tuple(labels.shape) != tuple(decoder):
        raise ValueError(f"labels have shape {tuple(labels.shape)} but {decoder_name} has {tuple(decoder)}: pass one "
                         f"label per decoder position, or leave {decoder_name} out (it is made from the labels).")
    if decoder is None and encoder is not None and labels.shape[0] != encoder[0]:
        raise ValueError(f"labels have {labels.shape[0]} rows but {encoder_name} has {encoder[0]} sentences: pass one "
                         "row of labels per source sentence.")


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
# The largest |length_penalty|: transformers computes |Y| ** alpha as a Python float, which overflows (OverflowError)
# for alpha above ~128 at 256 tokens; 20 keeps it finite for any length (the searched alphas lie in 0-2.5).
MAX_LENGTH_PENALTY = 20


def _is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_generation_values(values: Mapping, where: str) -> None:
    """Refuse generation settings (`GenerationConfig` fields or `generate()` keywords) of the wrong type, which
    transformers would report as a `TypeError` deep in its decoding loop (`length_penalty="x"`) or not at all
    (`max_length=3.5`), or a `length_penalty` beyond +-`MAX_LENGTH_PENALTY`, whose |Y|**alpha overflows in
    transformers' beam search. Names not in `GENERATION_FIELDS` and `None` values are not checked.

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
            if good and name == "length_penalty" and abs(value) > MAX_LENGTH_PENALTY:
                good, expected = False, f"a number from -{MAX_LENGTH_PENALTY} to {MAX_LENGTH_PENALTY}"
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


# The fields of config.json that decide the weights' shapes or what the model computes; `save_pretrained` writes every
# one, and a config.json without one would build another model from the defaults without a word.
REQUIRED_CONFIG_FIELDS = ("vocab_size", "target_vocab_size", "d_model", "encoder_layers", "decoder_layers", "num_heads",
                          "d_ff", "dropout", "attention_dropout", "activation_dropout", "activation_function",
                          "normalize_before", "position_embedding_type", "max_position_embeddings",
                          "share_encoder_decoder_embeddings", "tie_word_embeddings", "scale_embedding",
                          "layer_norm_eps", "pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")
LENGTH_PENALTY_STYLES = ("hf", "gnmt")  # the forms generate() applies (generation_vaswani.length_penalty_style)


def check_length_penalty_style(style, num_beams, early_stopping, where: str) -> None:
    """Refuse a length penalty form other than "hf" (score / |Y|^alpha, transformers) or "gnmt" (score /
    ((5 + |Y|) / 6)^alpha, the paper's, §6.1), and "gnmt" in a beam search (`num_beams` > 1) without
    `early_stopping=True`: transformers' stopping rules for other settings assume |Y|^alpha.

    Raises:
        ValueError: naming `where` ("generate()", a generation_config.json), the setting and what it must be.
    """
    if style not in LENGTH_PENALTY_STYLES:
        raise ValueError(f"{where}: length_penalty_style must be 'hf' (score / |Y|^alpha) or 'gnmt' (the paper's "
                         f"score / ((5 + |Y|) / 6)^alpha), got {style!r}.")
    if style == "gnmt" and (num_beams or 1) > 1 and early_stopping is not True:
        raise ValueError(f"{where}: length_penalty_style='gnmt' needs early_stopping=True in a beam search (got "
                         f"{early_stopping!r}): transformers' stopping rules for other settings assume the |Y|^alpha "
                         f"penalty.")


def check_config_fields(values: Mapping, where: str) -> None:
    """Refuse a saved config.json that lacks a field of `REQUIRED_CONFIG_FIELDS` (edited by hand, or written by other
    code): the default would stand in for it, and the model built would not be the one whose weights lie beside it
    (transformers then speaks of `ignore_mismatched_sizes`) or would compute something else (another activation).
    The values themselves are checked by `VaswaniConfig`.

    Raises:
        ValueError: naming `where` and the missing fields.
    """
    missing = [name for name in REQUIRED_CONFIG_FIELDS if name not in values]
    if missing:
        raise ValueError(f"{where}: no {', '.join(missing)} field{'s' if len(missing) > 1 else ''}; a saved config "
                         "holds every field of the model (its sizes, layout and special token ids), and a default in "
                         "place of a missing one would build another model than the weights'. Copy the folder's "
                         "config.json again, or write it anew from the model: model.config.save_pretrained(folder).")


def check_generation_file(values: Mapping, where: str, config: Mapping | None = None) -> None:
    """Refuse a saved generation_config.json that `generate()` would apply wrongly or only fail on deep inside:
    settings of the wrong type (`check_generation_values`: num_beams a positive integer, ...), a
    `length_penalty_style` other than "hf" or "gnmt" ("gnmt" with beams needs `early_stopping: true`), and, given the
    folder's `config` (config.json's fields), special token ids outside the model's target vocabulary or other than
    the config's (the output would stop or start on another token), and a file with neither `decoder_start_token_id`
    nor `bos_token_id` (transformers' generate() has no start token then).

    Raises:
        ValueError: naming `where`, the field and what it must be.
    """
    check_generation_values(values, where)
    if values.get("length_penalty_style") is not None:
        check_length_penalty_style(values["length_penalty_style"], values.get("num_beams"),
                                   values.get("early_stopping"), where)
    if config is None:
        return
    if values.get("decoder_start_token_id") is None and values.get("bos_token_id") is None:
        raise ValueError(f"{where}: no decoder_start_token_id (nor bos_token_id): generate() would not know the token "
                         f"decoding starts with (config.json says {config.get('decoder_start_token_id')!r}). Write "
                         f"the generation config anew from the model: model.generation_config.save_pretrained(folder).")
    vocabulary = config.get("target_vocab_size") or config.get("vocab_size")
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        value, ours = values.get(name), config.get(name)
        if value is None:
            continue
        ids = value if isinstance(value, (list, tuple)) else [value]
        if _is_integer(vocabulary) and any(i >= vocabulary for i in ids):
            raise ValueError(f"{where}: {name} is {value!r}, outside the model's vocabulary of {vocabulary} entries "
                             f"(config.json). Write the generation config anew from the model: "
                             f"model.generation_config.save_pretrained(folder).")
        theirs = ours if isinstance(ours, list) else [ours]
        if not theirs or not all(_is_integer(i) and 0 <= i < (vocabulary if _is_integer(vocabulary) else i + 1)
                                 for i in theirs):
            continue  # no id, or an impossible one: config.json's own check names it
        agrees = value == ours or (name == "eos_token_id" and _is_integer(ours) and ours in ids)
        if not agrees:
            raise ValueError(f"{where}: {name} is {value!r} but config.json says {ours!r}: generate() would start, "
                             f"stop or pad on another token than the model was trained with. Write the generation "
                             f"config anew from the model: model.generation_config.save_pretrained(folder).")
