"""The paper's decoding (§6.1): beam search with beam size 4, the GNMT length penalty with alpha = 0.6, and a maximum
output length of input length + 50, stopping early when possible.

    "we used beam search with a beam size of 4 and length penalty alpha = 0.6 [38]. [...] We set the maximum output
    length during inference to input length + 50, but terminate early when possible." (§6.1; [38] = Wu et al., 2016)

Two length penalties
--------------------
The score of a finished hypothesis Y is its summed log-probability divided by a length penalty lp(Y):

- `"gnmt"` (the paper, via GNMT, Wu et al. 2016, Eq. 14; tensor2tensor's beam search):
  `lp(Y) = ((5 + |Y|) / 6) ** alpha`;
- `"hf"` (transformers' `generate(length_penalty=alpha)`, also fairseq's `--lenpen` and CTranslate2's
  `length_penalty`): `lp(Y) = |Y| ** alpha`.

Both grow with |Y|, so both counter beam search's bias towards short outputs, but the GNMT penalty is milder (the 5
acts as a length offset): at alpha = 0.6 it divides the score of a 2-token hypothesis by 1.10 and of a 30-token one
by 2.88 (a 2.6-fold difference), where `|Y| ** 0.6` divides by 1.52 and 7.70 (5.1-fold). With the same alpha the
`"hf"` penalty therefore favours longer translations more, and the two can pick different hypotheses from the
same beam.

Here |Y| counts the tokens generated *including* the final `</s>` and *excluding* the decoder start token `<s>`
(tensor2tensor, fairseq and transformers all count this way; CTranslate2 leaves `</s>` out unless
`return_end_token=True`).

How it is built (no fork of transformers' beam search)
------------------------------------------------------
`beam_search_hypotheses` runs transformers' own beam search with `early_stopping=True` (a sentence is done as
soon as `num_beams` hypotheses ended in `</s>`, as in fairseq), `length_penalty=0.0` (the scores are raw sums of
log-probabilities) and `num_return_sequences=num_beams`, so it returns every finished hypothesis with its raw score.
Which hypotheses finish does not depend on the length penalty: beams are extended by raw score under any penalty.
`paper_generate` then divides each raw score by lp(Y) and keeps the best hypothesis per sentence.

When more than `num_beams` hypotheses finish at the last step, transformers keeps the `num_beams` with the best
raw scores. A hypothesis dropped that way has a lower raw score *and* is no longer than one that was kept, so it can
never be the best under a length penalty that grows with length (`alpha >= 0`): the pick equals the best over every
hypothesis that finished. With `length_penalty_style="hf"` the result is therefore exactly `model.generate(
num_beams=4, length_penalty=alpha, early_stopping=True)` (tested), apart from the length limit below.

Only the paper's settings apply: for the duration of the call the model's `generation_config` is replaced by one
that holds nothing else, so options saved with the model (`no_repeat_ngram_size`, `min_length`, ...) cannot change
the search.

The maximum length is per sentence: `SourceLengthLimitLogitsProcessor` lets a hypothesis of sentence `i`
produce at most `int(max_len_a * src_len_i + max_len_b)` tokens (`src_len_i` = the non-padding source tokens,
`</s>` included) by allowing only `</s>` as the last one, as fairseq does at its `max_len`; never more than the
decoder positions the model has (`config.max_positions` less the start token: a learned table cannot go further).
The `</s>` keeps its model log-probability, so scores stay true log-probabilities of the returned tokens.

tensor2tensor, the paper's code, stops differently: it keeps extending a sentence while an unfinished hypothesis could
still beat the finished ones under the penalty. The fairseq rule used here ends sooner; the two rarely choose
differently. The GNMT coverage penalty (beta) is not part of the paper's setup and is not implemented.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from ..inputs_vaswani import LENGTH_PENALTY_STYLES

# transformers marks empty slots of the finished-hypotheses buffer with -1e9; anything below this is such a slot.
_EMPTY_SCORE = -1.0e8

__all__ = [
    "LENGTH_PENALTY_STYLES",
    "FinishedHypotheses",
    "SourceLengthLimitLogitsProcessor",
    "beam_search_hypotheses",
    "gnmt_length_penalty",
    "hf_length_penalty",
    "length_penalty",
    "max_output_lengths",
    "paper_generate",
]


def gnmt_length_penalty(length: torch.Tensor | float, alpha: float = 0.6) -> torch.Tensor | float:
    """lp(Y) = ((5 + |Y|) / 6) ** alpha (Wu et al., 2016, Eq. 14), the penalty of §6.1.

    Args:
        length: |Y|, the number of generated tokens including `</s>` (scalar or tensor of any shape).
        alpha: the exponent (0.6 in the paper; 0 disables the penalty).
    Returns:
        the penalty, same shape as `length`; a hypothesis scores `sum(log p) / lp`.
    """
    return ((5.0 + length) / 6.0) ** alpha


def hf_length_penalty(length: torch.Tensor | float, alpha: float = 0.6) -> torch.Tensor | float:
    """lp(Y) = |Y| ** alpha, the penalty of transformers' `generate(length_penalty=alpha)` (and fairseq, CTranslate2).

    Args / returns as `gnmt_length_penalty`.
    """
    return length**alpha


def length_penalty(length: torch.Tensor | float, alpha: float, style: str = "gnmt") -> torch.Tensor | float:
    """The length penalty of `style` (`"gnmt"` or `"hf"`, see the module docstring).

    Raises:
        ValueError: an unknown style.
    """
    if style == "gnmt":
        return gnmt_length_penalty(length, alpha)
    if style == "hf":
        return hf_length_penalty(length, alpha)
    raise ValueError(f"length_penalty_style must be one of {LENGTH_PENALTY_STYLES}, got {style!r}.")


def max_output_lengths(attention_mask: torch.Tensor, max_len_a: float = 1.0, max_len_b: int = 50) -> torch.Tensor:
    """Per-sentence limit on generated tokens (`</s>` included): `int(max_len_a * src_len + max_len_b)` (§6.1:
    a = 1, b = 50).

    Args:
        attention_mask: `(B, S)` source mask, 1 for tokens and 0 for padding; `src_len` is its row sum.
    Returns:
        `(B,)` long tensor of limits.
    Raises:
        ValueError: a limit below 1 (no room even for `</s>`).
    """
    src_len = attention_mask.long().sum(dim=1).to(torch.float64)
    limits = torch.floor(max_len_a * src_len + max_len_b).long()
    if limits.numel() and int(limits.min()) < 1:
        raise ValueError(
            f"max_len_a={max_len_a}, max_len_b={max_len_b} give a maximum output length of {int(limits.min())} "
            "for some sentence; it must be at least 1 (room for </s>). The paper uses max_len_a=1, max_len_b=50."
        )
    return limits


class SourceLengthLimitLogitsProcessor(LogitsProcessor):
    """Allows only `</s>` as the last token a hypothesis may produce, so that sentence `i` gets at most
    `max_new_tokens[i]` generated tokens, `</s>` included (§6.1's "input length + 50" is
    `max_new_tokens = max_output_lengths(attention_mask)`).

    Works for greedy and beam search: the `B * k` rows that transformers passes are mapped to sentences as
    `row // k` (`generate` repeats each sentence `k` times in a row). The `</s>` score is left as the model gave
    it (transformers' `ForcedEOSTokenLogitsProcessor` sets it to 0 instead), so hypothesis scores remain true
    log-probabilities.

    Args:
        max_new_tokens: `(B,)` limits per sentence.
        eos_token_id: the id of `</s>`.
        decoder_prompt_length: tokens the decoder input starts with (1: the decoder start token).
    """

    def __init__(self, max_new_tokens: torch.Tensor, eos_token_id: int, decoder_prompt_length: int = 1):
        if max_new_tokens.dim() != 1:
            raise ValueError(f"max_new_tokens must be 1-D (one limit per sentence), got shape "
                             f"{tuple(max_new_tokens.shape)}.")
        self.max_new_tokens = max_new_tokens.long()
        self.eos_token_id = int(eos_token_id)
        self.decoder_prompt_length = decoder_prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """`input_ids` `(B * k, T)`, `scores` `(B * k, V)` -> scores with everything but `</s>` at -inf in the
        rows whose next token is their last allowed one."""
        rows, batch = input_ids.shape[0], self.max_new_tokens.numel()
        if rows % batch:
            raise ValueError(f"SourceLengthLimitLogitsProcessor was built for {batch} sentences but got {rows} rows.")
        limits = self.max_new_tokens.to(input_ids.device).repeat_interleave(rows // batch)  # (B * k,)
        generated = input_ids.shape[1] - self.decoder_prompt_length  # tokens generated before this step
        last = (generated + 1) >= limits  # (B * k,)
        if bool(last.any()):
            eos = scores[:, self.eos_token_id].clone()
            scores = scores.masked_fill(last[:, None], float("-inf"))
            scores[:, self.eos_token_id] = eos
        return scores

    def for_sentences(self, sentences: torch.LongTensor) -> SourceLengthLimitLogitsProcessor:
        """The processor of the sentences `sentences` (indices into this one's batch, in their order): what a beam
        search that leaves finished sentences out applies to the rows of the open ones."""
        return SourceLengthLimitLogitsProcessor(self.max_new_tokens.to(sentences.device).index_select(0, sentences),
                                                self.eos_token_id, self.decoder_prompt_length)


@dataclass
class FinishedHypotheses:
    """The finished hypotheses of a beam search, `K = num_beams` per sentence, best raw score first.

    Attributes:
        sequences: `(B, K, L)` token ids starting with the decoder start token; after the first `</s>` the
            positions hold `pad_token_id`.
        scores: `(B, K)` raw scores: the summed log-probabilities of the generated tokens, `</s>` included.
        lengths: `(B, K)` |Y|: tokens generated up to and including the first `</s>`.
        valid: `(B, K)` False for slots that no hypothesis filled (possible only for degenerate limits).
    """

    sequences: torch.LongTensor
    scores: torch.Tensor
    lengths: torch.LongTensor
    valid: torch.BoolTensor

    def rescore(self, alpha: float = 0.6, style: str = "gnmt") -> torch.Tensor:
        """`(B, K)` penalized scores `scores / lp(lengths)`; empty slots get `-inf`."""
        penalized = self.scores / length_penalty(self.lengths.to(self.scores.dtype), alpha, style)
        return penalized.masked_fill(~self.valid, float("-inf"))

    def best(self, alpha: float = 0.6, style: str = "gnmt") -> torch.LongTensor:
        """`(B,)` index in `K` of the best hypothesis under the length penalty."""
        return self.rescore(alpha, style).argmax(dim=1)


def _special_ids(model) -> tuple[int, int, int]:
    generation_config = getattr(model, "generation_config", None)
    config = model.config

    def pick(name: str) -> int:
        value = getattr(generation_config, name, None) if generation_config is not None else None
        if value is None:
            value = getattr(config, name, None)
        if isinstance(value, (list, tuple)):
            value = value[0]
        if value is None:
            raise ValueError(f"paper_generate: the model defines no {name}; set model.generation_config.{name}.")
        return int(value)

    return pick("eos_token_id"), pick("pad_token_id"), pick("decoder_start_token_id")


def _position_limited(model, limits: torch.Tensor) -> torch.Tensor:
    """`limits` capped at the outputs the model's decoder positions allow: `config.max_positions` less the decoder
    start token (a vaswani model; others unchanged)."""
    positions = getattr(model.config, "max_positions", None) if getattr(model.config, "model_type", None) == \
        "vaswani" else None
    return limits if positions is None else limits.clamp(max=max(int(positions) - 1, 1))


def _check_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pad_token_id: int, num_beams: int,
                  alpha: float, length_penalty_style: str) -> torch.Tensor:
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError("paper_generate: input_ids must be a (B, S) integer tensor of source token ids, got "
                         f"{type(input_ids).__name__} {tuple(getattr(input_ids, 'shape', ()))}.")
    if attention_mask is None:
        attention_mask = input_ids.ne(pad_token_id).long()
    elif attention_mask.shape != input_ids.shape:
        raise ValueError(f"paper_generate: attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                         f"{tuple(input_ids.shape)}.")
    if not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"paper_generate: num_beams must be a positive integer, got {num_beams!r}.")
    if not alpha >= 0:
        raise ValueError(f"paper_generate: alpha must be >= 0 (0 disables the length penalty), got {alpha!r}.")
    if length_penalty_style not in LENGTH_PENALTY_STYLES:
        raise ValueError(f"paper_generate: length_penalty_style must be one of {LENGTH_PENALTY_STYLES}, got "
                         f"{length_penalty_style!r}.")
    return attention_mask


def _generation_config(num_beams: int, max_new_tokens: int, eos: int, pad: int, start: int) -> GenerationConfig:
    return GenerationConfig(
        do_sample=False,
        num_beams=num_beams,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=start,
        decoder_start_token_id=start,
    )


_ONLY_LOCK = threading.Lock()
_ONLY_SAVED: dict[int, list] = {}  # id(model) -> [calls inside _only, the model's own generation config]


@contextmanager
def _only(model):
    """Run `generate` with the config passed to it and transformers' defaults only.

    `generate` fills every field that the passed config leaves unset from `model.generation_config`, so settings saved
    with the model (`no_repeat_ngram_size`, `min_length`, `repetition_penalty`, ...) would change the scores. During
    the call the model's config is an empty `GenerationConfig` (every caller passes its own `config` to `generate`),
    the same one for every thread inside `_only` at once: the first in saves the model's own, the last out puts it
    back, so searches side by side never leave one another's settings on the model.
    """
    with _ONLY_LOCK:
        entry = _ONLY_SAVED.get(id(model))
        if entry is None:
            entry = _ONLY_SAVED[id(model)] = [0, model.generation_config]
            model.generation_config = GenerationConfig()
        entry[0] += 1
    try:
        yield
    finally:
        with _ONLY_LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                model.generation_config = entry[1]
                del _ONLY_SAVED[id(model)]


def _first_eos_lengths(generated: torch.Tensor, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`generated` `(N, T)` (no start token) -> (|Y| up to and including the first `</s>`, has-`</s>`)."""
    is_eos = generated.eq(eos)
    has_eos = is_eos.any(dim=1)
    first = torch.where(has_eos, is_eos.int().argmax(dim=1),
                        torch.full_like(has_eos, generated.shape[1], dtype=torch.long))
    return first + has_eos.long(), has_eos


def _pad_after_eos(sequences: torch.Tensor, lengths: torch.Tensor, pad: int) -> torch.Tensor:
    """Positions after `1 + lengths` (start token + |Y|) become `pad` (transformers fills them with `</s>` when
    the pad id is 0)."""
    positions = torch.arange(sequences.shape[-1], device=sequences.device)
    return sequences.masked_fill(positions >= (1 + lengths).unsqueeze(-1), pad)


@torch.no_grad()
def beam_search_hypotheses(
    model,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    num_beams: int = 4,
    max_len_a: float = 1.0,
    max_len_b: int = 50,
) -> FinishedHypotheses:
    """Run transformers' beam search and return all `num_beams` finished hypotheses per sentence with raw scores.

    `generate` is called with `early_stopping=True`, `length_penalty=0.0`, `num_return_sequences=num_beams`,
    `sequences_scores` asked for (a Vaswani model's `output_sequences_scores`, another model's `output_scores`) and a
    `SourceLengthLimitLogitsProcessor` (see the module docstring).

    Args:
        model: a `VaswaniForConditionalGeneration` (any encoder-decoder `GenerationMixin` model works); put it
            in `eval()` mode first, or dropout makes the search random.
        input_ids: `(B, S)` source ids; attention_mask: `(B, S)` (default: `input_ids != pad_token_id`).
        num_beams: beam size, at least 2 (4 in the paper).
        max_len_a, max_len_b: at most `int(max_len_a * src_len + max_len_b)` generated tokens per sentence.
    Returns:
        `FinishedHypotheses` with `K = num_beams`.
    Raises:
        ValueError: bad shapes, `num_beams < 2`, limits below 1, a model without eos/pad/start ids.
    """
    eos, pad, start = _special_ids(model)
    attention_mask = _check_inputs(input_ids, attention_mask, pad, num_beams, 0.0, "gnmt")
    if num_beams < 2:
        raise ValueError("beam_search_hypotheses needs num_beams >= 2; for greedy search use "
                         "paper_generate(num_beams=1).")
    limits = _position_limited(model, max_output_lengths(attention_mask, max_len_a, max_len_b).to(input_ids.device))
    batch = input_ids.shape[0]
    config = _generation_config(num_beams, int(limits.max()), eos, pad, start)
    # a Vaswani model returns the finished scores without every step's (batch x beams, V) scores
    lean = hasattr(model, "lean_beam_search")
    config.update(early_stopping=True, length_penalty=0.0, num_return_sequences=num_beams, output_scores=not lean,
                  return_dict_in_generate=True)
    config.output_sequences_scores = lean
    with _only(model):
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            logits_processor=LogitsProcessorList([SourceLengthLimitLogitsProcessor(limits, eos)]),
        )
    sequences = out.sequences  # (B * K, 1 + T)
    scores = out.sequences_scores.float()  # (B * K,)
    lengths, has_eos = _first_eos_lengths(sequences[:, 1:], eos)
    valid = has_eos & scores.gt(_EMPTY_SCORE) & torch.isfinite(scores)
    sequences = _pad_after_eos(sequences, lengths, pad)
    return FinishedHypotheses(
        sequences=sequences.view(batch, num_beams, -1),
        scores=scores.view(batch, num_beams),
        lengths=lengths.view(batch, num_beams),
        valid=valid.view(batch, num_beams),
    )


@torch.no_grad()
def paper_generate(
    model,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    num_beams: int = 4,
    alpha: float = 0.6,
    max_len_a: float = 1.0,
    max_len_b: int = 50,
    length_penalty_style: str = "gnmt",
) -> torch.LongTensor:
    """Translate with the paper's decoding (§6.1): beam 4, GNMT length penalty alpha = 0.6, at most input length + 50
    tokens per sentence, stopping once `num_beams` hypotheses have finished.

    Args:
        model: a `VaswaniForConditionalGeneration` in `eval()` mode.
        input_ids: `(B, S)` source ids (as the tokenizer gives them, ending in `</s>`).
        attention_mask: `(B, S)`, 1 for tokens, 0 for padding (default: `input_ids != pad_token_id`).
        num_beams: beam size (default 4); 1 is greedy search, where no length penalty applies.
        alpha: length-penalty exponent (default 0.6); 0 ranks hypotheses by raw log-probability.
        max_len_a, max_len_b: at most `int(max_len_a * src_len + max_len_b)` generated tokens, `</s>` included,
            where `src_len` counts the non-padding source tokens (defaults 1 and 50), and at most the decoder
            positions the model has.
        length_penalty_style: `"gnmt"` (default): `((5 + |Y|) / 6) ** alpha` as in the paper; `"hf"`:
            `|Y| ** alpha` as `model.generate(length_penalty=alpha)` (see the module docstring).
    Returns:
        `(B, L)` token ids like `model.generate` returns: the decoder start token, the translation, `</s>`, then
        `pad_token_id` up to the longest translation in the batch. `tokenizer.batch_decode(ids,
        skip_special_tokens=True)` gives the text.
    Raises:
        ValueError: bad shapes or dtypes, `num_beams < 1`, `alpha < 0`, an unknown style, limits below 1.
    """
    eos, pad, start = _special_ids(model)
    attention_mask = _check_inputs(input_ids, attention_mask, pad, num_beams, alpha, length_penalty_style)
    if num_beams == 1:
        limits = _position_limited(model,
                                   max_output_lengths(attention_mask, max_len_a, max_len_b).to(input_ids.device))
        config = _generation_config(1, int(limits.max()), eos, pad, start)
        with _only(model):
            sequences = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=config,
                logits_processor=LogitsProcessorList([SourceLengthLimitLogitsProcessor(limits, eos)]),
            )
        lengths, _ = _first_eos_lengths(sequences[:, 1:], eos)
        return _pad_after_eos(sequences, lengths, pad)[:, : 1 + int(lengths.max())]

    hypotheses = beam_search_hypotheses(model, input_ids, attention_mask, num_beams, max_len_a, max_len_b)
    best = hypotheses.best(alpha, length_penalty_style)  # (B,)
    rows = torch.arange(best.numel(), device=best.device)
    sequences = hypotheses.sequences[rows, best]  # (B, L)
    lengths = hypotheses.lengths[rows, best]
    return sequences[:, : 1 + int(lengths.max())]
