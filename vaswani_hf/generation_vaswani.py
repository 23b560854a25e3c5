"""Generation for `VaswaniForConditionalGeneration`: beam 4 with length penalty 0.6 (§6.1) through transformers'
`generate()`, and what makes it cheaper than transformers' defaults while returning the same tokens. The model's
forward knows none of it: everything here enters through `generate()`'s hooks and its cache.

- `VaswaniGenerationMixin`: `generate()` (pads after `</s>`; runs with the CPU fast paths installed for
  the call), and the generation hooks that keep one encoder row per sentence, make the in-place cache, leave finished
  sentences out of beam search and reorder only the self-attention cache;
- `VaswaniSelfAttentionCache`: the decoder self-attention cache, written in place into a preallocated buffer;
- `LeanBeamSearch`: transformers' beam search with CTranslate2's bookkeeping (per-beam top-k, the first step once per
  sentence, finished sentences out of every state), and `LeanGreedySearch`, the same for greedy search: the same
  sequences;
- `FinishedSentenceSkipping`: the state of one beam search that leaves out the sentences it has finished, where
  transformers' loop runs (logits processors);
- `CACHE_NAME`, `one_cache`: the cache keyword, `cache=` (transformers >= 5.24) or `past_key_values=`.

It imports only torch, transformers, `fast_paths_vaswani.py` and `inputs_vaswani.py`: transformers copies it beside the
model code (relative imports) for `trust_remote_code=True`.
"""

import contextvars
import copy
import functools
import inspect
import math
import warnings

import torch
from transformers import GenerationConfig, GenerationMixin, LogitsProcessor, LogitsProcessorList, PretrainedConfig
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache
from transformers.generation import GenerateBeamEncoderDecoderOutput, logits_process
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.modeling_outputs import Seq2SeqLMOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .fast_paths_vaswani import inference_fast_paths
from .inputs_vaswani import (
    GENERATION_FIELDS,
    check_generation_values,
    check_length_penalty_style,
    check_model_inputs,
)

# transformers 5.24 renamed `past_key_values` to `cache` (model keyword, `generate()`'s model_kwargs, output field) and
# keeps the old name as a deprecated alias; the model takes either and speaks the installed version's name.
CACHE_NAME = "cache" if "cache" in Seq2SeqLMOutput.__dataclass_fields__ else "past_key_values"


def one_cache(past_key_values: Cache | None, cache: Cache | None) -> Cache | None:
    """The cache passed as `past_key_values=` (transformers < 5.24) or `cache=` (>= 5.24).

    Raises:
        ValueError: when both are given.
    """
    if past_key_values is not None and cache is not None:
        raise ValueError("Pass the cache once: as `cache=` (transformers >= 5.24) or as `past_key_values=`, not both.")
    if past_key_values is not None and CACHE_NAME == "cache":
        warnings.warn("`past_key_values` is deprecated (transformers >= 5.24): use `cache` instead.", FutureWarning,
                      stacklevel=3)
    return cache if cache is not None else past_key_values


# The length penalty of the `generate()` call in progress: "hf" (transformers' |Y|^alpha) or "gnmt" (the paper's).
_LENGTH_PENALTY_STYLE: contextvars.ContextVar[str] = contextvars.ContextVar("vaswani_length_penalty_style",
                                                                            default="hf")


def length_penalty_style(kwargs: dict, config: GenerationConfig) -> str:
    """The length penalty of a `generate()` call: `length_penalty_style=` of the call (taken out of `kwargs`), else the
    generation config's `length_penalty_style` (a field a folder's generation_config.json may hold), else "hf".

    "hf" divides a finished hypothesis' log-probability by |Y|^alpha (transformers, fairseq, CTranslate2); "gnmt" by
    ((5 + |Y|) / 6)^alpha (Wu et al., 2016, the penalty §6.1 cites). Beams are extended by raw log-probability under
    either, so with `early_stopping=True` the two choose among the same finished hypotheses.

    Raises:
        ValueError: another style, or "gnmt" in a beam search without `early_stopping=True` (transformers' stopping
            heuristics for other settings assume |Y|^alpha).
    """
    style = kwargs.pop("length_penalty_style", None)
    if style is None:
        style = getattr(config, "length_penalty_style", None) or "hf"
    check_length_penalty_style(style, kwargs.get("num_beams", getattr(config, "num_beams", None)),
                               kwargs.get("early_stopping", getattr(config, "early_stopping", None)), "generate()")
    return style


# Incremental decoding: the decoder self-attention cache ---------------------------------------------------------------


class VaswaniSelfAttentionCacheLayer(DynamicLayer):
    """One decoder layer's self-attention keys and values while decoding token by token (`generate()`).

    transformers' `DynamicLayer` concatenates every new position onto its keys and values, copying all P cached
    positions at each step, and beam search's reorder allocates fresh tensors at each step. Here keys and values live
    in one preallocated buffer `(B, 2, H, capacity, Dh)`: a new position is written in place, and a beam reorder
    gathers the P filled positions into a second buffer of the same size, which then takes the first one's place.
    `keys` and `values` are `(B, H, P, Dh)` views of the filled part, so attention reads them without a copy.

    Args:
        capacity: positions to allocate at the first update (`generate()` passes its maximum length); the buffer
            doubles whenever an update would overflow it, so any length works.
    """

    def __init__(self, capacity: int = 0):
        super().__init__()
        self.capacity = max(int(capacity or 0), 0)
        self.length = 0
        self._buffer: torch.Tensor | None = None  # (B, 2, H, capacity, Dh)
        self._spare: torch.Tensor | None = None  # the same shape: where the next reorder gathers into

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append `(B, H, T, Dh)` keys and values; returns `(B, H, P + T, Dh)` views of all cached ones."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        buffer = self._buffer
        if buffer is None or end > buffer.shape[3] or buffer.shape[0] != key_states.shape[0] \
                or buffer.dtype != key_states.dtype:
            self._reallocate(key_states, end)
        self._buffer[:, 0, :, start:end] = key_states
        self._buffer[:, 1, :, start:end] = value_states
        self.length = end
        self._set_views()
        return self.keys, self.values

    def _reallocate(self, key_states: torch.Tensor, needed: int) -> None:
        batch, heads, _, head_dim = key_states.shape
        old = self._buffer
        grown = 2 * old.shape[3] if old is not None else 0
        buffer = key_states.new_empty(batch, 2, heads, max(needed, self.capacity, grown, 16), head_dim)
        if old is not None and self.length:
            buffer[:, :, :, : self.length] = old[:, :, :, : self.length]
        self._replace(buffer)

    def _set_views(self) -> None:
        filled = self._buffer[:, :, :, : self.length]
        self.keys, self.values = filled[:, 0], filled[:, 1]

    def _replace(self, buffer: torch.Tensor) -> None:
        self._buffer, self._spare = buffer, None
        self._set_views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row i takes the keys and values of row `beam_idx[i]` (beam search, after every step)."""
        if not self.length:
            return
        if self._spare is None:
            self._spare = torch.empty_like(self._buffer)
        filled = slice(0, self.length)
        torch.index_select(self._buffer[:, :, :, filled], 0, beam_idx.to(self._buffer.device),
                           out=self._spare[:, :, :, filled])
        self._buffer, self._spare = self._spare, self._buffer
        self._set_views()

    def select_rows(self, rows: torch.LongTensor) -> None:
        """Keep rows `rows` (in that order; fewer than now): beam search dropping finished sentences."""
        if not self.length:
            return
        if self._spare is None:
            self._spare = torch.empty_like(self._buffer)
        count, filled = len(rows), slice(0, self.length)
        # the leading rows of both buffers, which stay allocated: no fresh memory to fault in at every shrink
        torch.index_select(self._buffer[:, :, :, filled], 0, rows.to(self._buffer.device),
                           out=self._spare[:count, :, :, filled])
        self._buffer, self._spare = self._spare[:count], self._buffer[:count]
        self._set_views()

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self.length = 0
        self._buffer = self._spare = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` positions (transformers' convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop() takes a negative number of positions to remove, got {tokens_to_remove}.")
        if tokens_to_remove and self.length:
            self.length = max(self.length + tokens_to_remove, 0)
            self._set_views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length:  # the filled positions only: the buffer's capacity is mostly not written yet
            old = self._buffer
            buffer = old.new_empty(old.shape[0] * repeats, *old.shape[1:])
            buffer[:, :, :, : self.length] = old[:, :, :, : self.length].repeat_interleave(repeats, dim=0)
            self._replace(buffer)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length:
            self._replace(self._buffer[indices])


class VaswaniSelfAttentionCache(DynamicCache):
    """A `DynamicCache` of `VaswaniSelfAttentionCacheLayer`s, one per decoder layer, created as they are first
    updated: the self-attention half of the `EncoderDecoderCache` that the decoder and `generate()` use.

    Args:
        capacity: positions each layer allocates at its first update (0: as many as the first update brings).
    """

    def __init__(self, capacity: int = 0):
        super().__init__()
        self.layer_class_to_replicate = functools.partial(VaswaniSelfAttentionCacheLayer, capacity)


# Beam search without the sentences it has finished --------------------------------------------------------------------


class FinishedSentenceSkipping(LogitsProcessor):
    """One beam search's state for leaving out of the decoder's batch the sentences beam search has finished.

    transformers' beam search keeps every sentence of the batch in every step until the last one is done; the steps of
    a finished sentence change nothing it returns (with `early_stopping=True`, or once no hypothesis can improve on
    its finished ones, every new candidate of the sentence is scored below its finished hypotheses). So after the
    step in which a sentence finishes, its rows leave the decoder's batch, as CTranslate2 does: the self-attention
    cache keeps only the rows of the open sentences (the beam reorder gathers exactly those), the encoder-decoder
    cache, encoder output and source mask only their sentences. The first step, where the beams of a sentence hold
    the same start token, runs once per sentence (as CTranslate2 does) and its cache is repeated for the beams.

    `VaswaniGenerationMixin`'s hooks drive it (`select_inputs` before a step, `note_finished` and `reorder` after
    it), and as the first of beam search's logits processors it puts the computed rows' log-probabilities back where
    beam search reads them, `(batch * beams, V)`; finished sentences' rows get those of all-zero logits (finite,
    never used).

    Args:
        batch: sentences; beams: rows per sentence.
    """

    def __init__(self, batch: int, beams: int, device: torch.device):
        self.batch, self.beams, self.device = batch, beams, device
        self.step: str | None = None  # what the current step computes: "open" rows, the "first" step's, or all
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)  # finished, as of the last step
        self.sentences: torch.LongTensor | None = None  # open sentences in the decoder's batch (None: all)
        self.rows: torch.LongTensor | None = None  # their rows among the batch * beams of beam search
        self._encoder: tuple | None = None  # (encoder states, source mask) of the open sentences

    def select_inputs(self, model_inputs: dict) -> dict:
        """A decoding step's model inputs for the rows it computes: the open sentences' rows once some are done, one
        row per sentence at the first step, otherwise all (unchanged)."""
        ids, cache = model_inputs["decoder_input_ids"], model_inputs.get(CACHE_NAME)
        self.step = None
        if self.rows is not None:
            self.step = "open"
            if self._encoder is None:
                states = model_inputs["encoder_outputs"].last_hidden_state
                mask = model_inputs.get("attention_mask")
                self._encoder = (states.index_select(0, self.sentences),
                                 mask.index_select(0, self.sentences) if mask is not None else None)
            states, mask = self._encoder
            encoder_outputs = copy.copy(model_inputs["encoder_outputs"])
            encoder_outputs["last_hidden_state"] = states
            return {**model_inputs, "decoder_input_ids": ids.index_select(0, self.rows), "attention_mask": mask,
                    "encoder_outputs": encoder_outputs}
        if cache is not None and cache.get_seq_length() == 0 and ids.shape[0] == self.batch * self.beams:
            grouped = ids.view(self.batch, self.beams, -1)
            if bool(grouped.eq(grouped[:, :1]).all()):
                self.step = "first"
                return {**model_inputs, "decoder_input_ids": ids[:: self.beams]}
        return model_inputs

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """The step's log-probabilities `(rows computed, V)` as beam search reads them, `(batch * beams, V)`."""
        if self.step == "first":
            return scores.repeat_interleave(self.beams, dim=0)
        if self.step == "open":
            # finished rows read those of all-zero logits, -log V everywhere (never used: the sentence is done)
            full = scores.new_full((self.batch * self.beams, scores.shape[1]), -math.log(scores.shape[1]))
            return full.index_copy_(0, self.rows, scores)
        return scores

    def note_finished(self, is_sent_finished: torch.Tensor, early_stopping, no_improvement: torch.Tensor) -> None:
        """After a step: a sentence whose `num_beams` hypotheses are finished, with `early_stopping=True` or no
        improvement possible, is done."""
        full = is_sent_finished.all(dim=-1)
        if early_stopping is not True:
            full = full & no_improvement.reshape(-1)
        self.done |= full

    def reorder(self, cache: Cache, beam_idx: torch.LongTensor) -> bool:
        """Beam search's cache reorder, dropping the rows of sentences done since the last step. Returns False when
        nothing was dropped yet (the caller then reorders as usual)."""
        self_cache = self_attention_cache(cache)
        if self.step == "first":  # one row per sentence computed: every beam's row starts as its sentence's
            for layer in self_cache.layers:
                layer.batch_repeat_interleave(self.beams)
        open_now = (~self.done).nonzero().flatten()
        if self.sentences is None and len(open_now) == self.batch:
            return False
        if len(open_now) == 0:  # the loop ends after this step; keep the last layout
            open_now = self.sentences if self.sentences is not None else torch.arange(self.batch, device=self.device)
        full = self.batch * self.beams
        old_rows = self.rows if self.rows is not None else torch.arange(full, device=self.device)
        old_sentences = self.sentences if self.sentences is not None else torch.arange(self.batch, device=self.device)
        new_rows = (open_now[:, None] * self.beams + torch.arange(self.beams, device=self.device)).flatten()
        position = torch.full((full,), -1, dtype=torch.long, device=self.device)
        position[old_rows] = torch.arange(len(old_rows), device=self.device)
        sources = position[beam_idx.to(self.device)[new_rows]]  # beams stay within their (open) sentence
        if len(new_rows) == len(old_rows):
            self_cache.reorder_cache(sources)
        else:
            sentence_position = torch.full((self.batch,), -1, dtype=torch.long, device=self.device)
            sentence_position[old_sentences] = torch.arange(len(old_sentences), device=self.device)
            keep_cache_rows(cache, sources, sentence_position[open_now])
            self._encoder = None
        self.sentences, self.rows = open_now, new_rows
        return True


def self_attention_cache(cache: Cache) -> Cache:
    """The decoder self-attention half of a generation cache (the cache itself where it has no encoder half)."""
    return cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache


def keep_cache_rows(cache: Cache, rows: torch.LongTensor, sentences: torch.LongTensor) -> None:
    """Keep the self-attention cache rows `rows` (fewer than now, in that order: beams follow their parents as they
    go) and the encoder-decoder cache rows `sentences` (one per sentence): a beam search dropping finished sentences."""
    for layer in self_attention_cache(cache).layers:
        layer.select_rows(rows)
    if isinstance(cache, EncoderDecoderCache):
        for layer in cache.cross_attention_cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(0, sentences)
                layer.values = layer.values.index_select(0, sentences)


# transformers' LogitsProcessorList inspects each processor's signature at every step; a stored one is read at once
FinishedSentenceSkipping.__call__.__signature__ = inspect.signature(FinishedSentenceSkipping.__call__)


# The beam search running in this context, if it leaves finished sentences out: per call, never on the model, so that
# one model decodes for several threads at once.
_SKIPPING: contextvars.ContextVar[FinishedSentenceSkipping | None] = contextvars.ContextVar(
    "finished_sentence_skipping", default=None)


# Beam search over the open sentences only ----------------------------------------------------------------------------


_NEG = -1.0e9  # transformers' score of an excluded candidate


class LeanBeamSearch:
    """transformers' beam search (`GenerationMixin._beam_search`) with CTranslate2's bookkeeping: the same arithmetic
    on the same numbers, so the same sequences, without the work that changes none of them.

    - Each beam's best `2 x beams` log-probabilities are taken before the beam scores are added: a sentence's best
      `2 x beams` candidates over `beams x V` are among them, and each candidate's sum is the same single addition, so
      the sums added and ranked are `beams x 2 x beams` instead of `beams x V` per sentence.
    - The logits are not copied; sequences are held as long as they are, not in `max_length` buffers.
    - The first step runs once per sentence (its beams hold the same start token).
    - A sentence leaves every state tensor and the cache (`keep_cache_rows`) after the step that makes its hypotheses
      final: all `beams` finished, with `early_stopping=True` or once no running beam can do better
      (`FinishedSentenceSkipping` says why this returns what transformers returns).

    It decodes where `applies` holds: logits processors that are a function of each row alone (`ROW_WISE`) or that
    say which sentences they are for (a `for_sentences(sentences)` method returning the processor of those sentences
    of the batch, by index), stopping criteria that are the maximum length, `</s>` (transformers' defaults) or have
    such a `for_sentences` method, only sequences returned (no per-step scores, attentions or cache;
    `sequences_scores` with the generation config's `output_sequences_scores`), beams not sampled, the in-place
    self-attention cache, one encoder row per sentence.
    `run` returns the `(batch x num_return_sequences, length)` sequences that `_beam_search` returns, ending in
    transformers' fill value (`pad_token_id or eos`), and their `(batch x num_return_sequences,)` scores.
    """

    # transformers' processors whose output row is a function of its own input row and scores only
    ROW_WISE = tuple(getattr(logits_process, name) for name in (
        "NoRepeatNGramLogitsProcessor", "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor",
        "RepetitionPenaltyLogitsProcessor", "SuppressTokensLogitsProcessor") if hasattr(logits_process, name))

    model_inputs = frozenset({"encoder_outputs", "attention_mask", CACHE_NAME, "use_cache", "logits_to_keep",
                              "output_attentions", "output_hidden_states"})

    def __init__(self, model, generation_config: GenerationConfig, eos: torch.Tensor | None, max_length: int,
                 processors=(), criteria=()):
        self.model, self.config, self.max_length, self.eos = model, generation_config, max_length, eos
        self.processors, self.criteria = list(processors), list(criteria)
        # read once per call, in the caller's context
        self.gnmt = _LENGTH_PENALTY_STYLE.get() == "gnmt" and bool(generation_config.length_penalty)
        config_eos = generation_config._eos_token_tensor
        self.fill = int(generation_config._pad_token_tensor or config_eos[0]) if config_eos is not None else -1

    @classmethod
    def applies(cls, model, input_ids: torch.LongTensor, logits_processor, stopping_criteria,
                generation_config: GenerationConfig, model_kwargs: dict):
        """A `LeanBeamSearch` for this beam search, or None where it cannot return what transformers returns (the
        caller has checked the rest: sequences only, beams not sampled, the in-place cache, shared encoder rows)."""
        if not all(isinstance(p, cls.ROW_WISE) or callable(getattr(p, "for_sentences", None))
                   for p in logits_processor) or not set(model_kwargs) <= cls.model_inputs \
                or model_kwargs.get("output_attentions") or model_kwargs.get("output_hidden_states") \
                or getattr(generation_config, "prefill_chunk_size", None) is not None:
            return None
        eos, lengths, criteria = [], [], []
        for criterion in stopping_criteria:
            if type(criterion) is MaxLengthCriteria:
                lengths.append(criterion.max_length)
            elif type(criterion) is EosTokenCriteria:
                eos.append(criterion.eos_token_id.to(input_ids.device).flatten())
            elif callable(getattr(criterion, "for_sentences", None)):
                criteria.append(criterion)
            else:
                return None
        beams = generation_config.num_beams
        prompt = input_ids.view(-1, beams, input_ids.shape[1])
        if not lengths or not bool(prompt.eq(prompt[:, :1]).all()):
            return None
        return cls(model, generation_config, torch.cat(eos) if eos else None, min(lengths), logits_processor,
                   criteria)

    def _stopped(self, sentences: torch.LongTensor, sequences: torch.LongTensor) -> torch.BoolTensor | None:
        """transformers' `stopping_criteria(sequences, None)` beyond the length and `</s>`, for the `(rows, length)`
        sequences of the open sentences `sentences` (rows in sentence order, the same count each), or None."""
        stopped = None
        for criterion in self.criteria:
            hit = criterion.for_sentences(sentences)(sequences, None)
            stopped = hit if stopped is None else stopped | hit
        return stopped

    def _processed(self, sentences: torch.LongTensor, sequences: torch.LongTensor,
                   scores: torch.FloatTensor) -> torch.FloatTensor:
        """transformers' `logits_processor(sequences, scores)` on the `(rows, length)` sequences of the open
        sentences `sentences` (rows in sentence order, the same count each)."""
        for processor in self.processors:
            if callable(getattr(processor, "for_sentences", None)):
                processor = processor.for_sentences(sentences)
            scores = processor(sequences, scores)
        return scores

    def run(self, input_ids: torch.LongTensor, model_kwargs: dict):
        """Beam search from the `(batch x beams, P)` decoder prompt `input_ids`; `model_kwargs` as `_beam_search`
        takes them (the encoder output, its mask, the empty cache). Returns `(sequences, sequences_scores)`."""
        config, model, max_length = self.config, self.model, self.max_length
        beams, alpha, early = config.num_beams, config.length_penalty, config.early_stopping
        eos, gnmt, fill, device = self.eos, self.gnmt, self.fill, input_ids.device
        keep = max(2, 1 + (len(eos) if eos is not None else 0)) * beams  # candidates kept per sentence
        top_beams = torch.arange(keep, device=device) < beams
        prompt_length = cur = input_ids.shape[1]
        running = input_ids.view(-1, beams, cur)  # (b, beams, cur): the open sentences' running hypotheses
        batch = running.shape[0]
        scores = torch.zeros(batch, beams, device=device)
        scores[:, 1:] = _NEG  # the beams of a sentence start alike: only the first one's candidates count
        finished = running.clone()  # (b, beams, width): the best finished hypotheses, best first
        finished_scores = torch.full((batch, beams), _NEG, device=device)
        finished_lengths = torch.zeros(batch, beams, dtype=torch.long, device=device)
        is_finished = torch.zeros(batch, beams, dtype=torch.bool, device=device)
        improvable = torch.ones(batch, 1, dtype=torch.bool, device=device)
        sentences = torch.arange(batch, device=device)  # the open ones, by their index in the batch
        results: dict[int, tuple] = {}
        cache = model_kwargs[CACHE_NAME]
        encoder_outputs = model_kwargs["encoder_outputs"]
        states, mask = encoder_outputs.last_hidden_state, model_kwargs.get("attention_mask")
        extra = {name: model_kwargs[name] for name in ("logits_to_keep",) if name in model_kwargs}
        ids, first = running[:, 0], True
        while True:
            encoder = copy.copy(encoder_outputs)
            encoder["last_hidden_state"] = states
            outputs = model(decoder_input_ids=ids, encoder_outputs=encoder, attention_mask=mask, use_cache=True,
                            return_dict=True, **{CACHE_NAME: cache}, **extra)
            log_probs = torch.log_softmax(outputs.logits[:, -1].float(), dim=-1)  # (rows, V)
            del outputs
            open_count = len(sentences)
            if self.processors:  # at the first step one row per sentence, whose beams all hold the prompt
                log_probs = self._processed(sentences, running[:, 0] if first else running.flatten(0, 1), log_probs)
            per_beam = min(keep, log_probs.shape[-1])
            values, tokens = log_probs.topk(per_beam)
            del log_probs
            if first:  # one row per sentence: every beam's
                values = values[:, None].expand(open_count, beams, per_beam)
                tokens = tokens[:, None].expand(open_count, beams, per_beam)
            sums = (values.view(open_count, beams, per_beam) + scores[:, :, None]).reshape(open_count, -1)
            top_scores, flat = sums.topk(keep)  # (b, keep), best first
            parents = flat.div(per_beam, rounding_mode="floor")
            new_tokens = tokens.reshape(open_count, -1).gather(1, flat)
            candidates = torch.cat((running.gather(1, parents[:, :, None].expand(-1, -1, cur)), new_tokens[:, :, None]),
                                   dim=2)  # (b, keep, cur + 1)
            hits = torch.isin(new_tokens, eos) if eos is not None else torch.zeros_like(new_tokens, dtype=torch.bool)
            if cur + 1 >= max_length:
                hits.fill_(True)
            elif self.criteria:
                stopped = self._stopped(sentences, candidates.flatten(0, 1))
                if stopped is not None:
                    hits |= stopped.view(open_count, keep)
            # the running beams of the next step: the best candidates not finished
            running_scores = top_scores + hits.to(torch.float32) * _NEG
            chosen = running_scores.topk(beams).indices
            running = candidates.gather(1, chosen[:, :, None].expand(-1, -1, cur + 1))
            scores = running_scores.gather(1, chosen)
            beam_rows = parents.gather(1, chosen)
            # the finished hypotheses: transformers' `_update_finished_beams`, operation by operation
            length = cur + 1 - prompt_length
            finishing = top_scores
            if gnmt:  # ((5 + |Y|) / 6)^alpha in place of |Y|^alpha, as `_update_finished_beams` below applies it
                finishing = finishing * (length ** float(alpha) / ((5 + length) / 6) ** float(alpha))
            finishing = finishing / (length**alpha)
            finishing += (is_finished.all(dim=-1, keepdim=True) & (early is True)).to(torch.float32) * _NEG
            finishing += (~improvable).to(torch.float32) * _NEG
            just_finished = hits & top_beams[None, :]
            finishing += (~just_finished) * _NEG
            merged_scores = torch.cat((finished_scores, finishing), dim=1)
            picked = merged_scores.topk(beams).indices
            widened = torch.cat((finished, finished.new_full((open_count, beams, cur + 1 - finished.shape[2]), fill)),
                                dim=2)
            finished = torch.cat((widened, candidates), dim=1).gather(1, picked[:, :, None].expand(-1, -1, cur + 1))
            finished_scores = merged_scores.gather(1, picked)
            finished_lengths = torch.cat((finished_lengths, finished_lengths.new_full((open_count, keep), length)),
                                         dim=1).gather(1, picked)
            is_finished = torch.cat((is_finished, just_finished), dim=1).gather(1, picked)
            done = is_finished.all(dim=-1)
            if early is not True:
                done &= ~improvable.view(-1)
            # transformers' early-stopping heuristic, for the next step
            cur += 1
            hypothetical = max_length - prompt_length if early == "never" and alpha > 0.0 else cur - prompt_length
            best_possible = scores[:, :1] / (hypothetical**alpha)
            worst_finished = torch.where(is_finished, finished_scores.min(dim=1, keepdim=True)[0], _NEG)
            improvable = improvable & (best_possible > worst_finished).any(dim=-1, keepdim=True)
            if bool(hits.all()) or not bool(improvable.any()) or bool(done.all()):
                break
            if first:
                for layer in self_attention_cache(cache).layers:
                    layer.batch_repeat_interleave(beams)
                first = False
            if bool(done.any()):
                for index in done.nonzero().flatten().tolist():
                    results[int(sentences[index])] = (finished[index], finished_lengths[index], finished_scores[index])
                kept = (~done).nonzero().flatten()
                rows = (kept[:, None] * beams + beam_rows.index_select(0, kept)).flatten()
                keep_cache_rows(cache, rows, kept)
                running, scores, finished, finished_scores, finished_lengths, is_finished, improvable, sentences = (
                    tensor.index_select(0, kept) for tensor in (running, scores, finished, finished_scores,
                                                                 finished_lengths, is_finished, improvable, sentences))
                states = states.index_select(0, kept)
                mask = mask.index_select(0, kept) if mask is not None else None
            else:
                rows = (torch.arange(open_count, device=device)[:, None] * beams + beam_rows).flatten()
                self_attention_cache(cache).reorder_cache(rows)
            ids = running[:, :, -1].reshape(-1, 1)
        for index, sentence in enumerate(sentences.tolist()):
            results[sentence] = (finished[index], finished_lengths[index], finished_scores[index])
        returned = config.num_return_sequences
        length = prompt_length + max(int(lengths[:returned].max()) for _, lengths, _ in results.values())
        sequences = torch.full((batch, returned, length), fill, dtype=torch.long, device=device)
        sequence_scores = torch.empty(batch, returned, device=device)
        for sentence, (hypotheses, _, hypothesis_scores) in results.items():
            width = min(hypotheses.shape[1], length)
            sequences[sentence, :, :width] = hypotheses[:returned, :width]
            sequence_scores[sentence] = hypothesis_scores[:returned]
        return sequences.view(batch * returned, length), sequence_scores.view(-1)


class LeanGreedySearch(LeanBeamSearch):
    """transformers' greedy search (`GenerationMixin._sample` without sampling) with the same bookkeeping as
    `LeanBeamSearch`: a sentence that has produced `</s>` leaves every state tensor and the cache after that step (its
    row then holds the fill value, as transformers' rows do), the logits are read where the model wrote them, and the
    sequences grow in one preallocated buffer. `applies` as for beam search; `run` returns the `(batch, length)`
    sequences `_sample` returns, and None for the scores."""

    def run(self, input_ids: torch.LongTensor, model_kwargs: dict):
        """Greedy search from the `(batch, P)` decoder prompt `input_ids`; `model_kwargs` as `_sample` takes them."""
        model, max_length, eos, device = self.model, self.max_length, self.eos, input_ids.device
        batch, cur = input_ids.shape
        sequences = torch.full((batch, max(max_length, cur + 1)), self.fill, dtype=torch.long, device=device)
        sequences[:, :cur] = input_ids
        cache = model_kwargs[CACHE_NAME]
        encoder_outputs = model_kwargs["encoder_outputs"]
        states, mask = encoder_outputs.last_hidden_state, model_kwargs.get("attention_mask")
        extra = {name: model_kwargs[name] for name in ("logits_to_keep",) if name in model_kwargs}
        sentences, ids = torch.arange(batch, device=device), input_ids  # the open ones, by their index in the batch
        while True:
            encoder = copy.copy(encoder_outputs)
            encoder["last_hidden_state"] = states
            outputs = model(decoder_input_ids=ids, encoder_outputs=encoder, attention_mask=mask, use_cache=True,
                            return_dict=True, **{CACHE_NAME: cache}, **extra)
            scores = outputs.logits[:, -1].float()  # (open, V)
            del outputs
            if self.processors:  # processors may write in place; transformers hands them a copy
                scores = self._processed(sentences, sequences.index_select(0, sentences)[:, :cur], scores.clone())
            tokens = scores.argmax(dim=-1)
            sequences[sentences, cur] = tokens
            cur += 1
            finished = torch.isin(tokens, eos) if eos is not None else None
            if self.criteria:
                stopped = self._stopped(sentences, sequences.index_select(0, sentences)[:, :cur])
                finished = stopped if finished is None else finished | stopped
            if cur >= max_length or (finished is not None and bool(finished.all())):
                return sequences[:, :cur], None
            if finished is not None and bool(finished.any()):
                kept = (~finished).nonzero().flatten()
                keep_cache_rows(cache, kept, kept)
                sentences, tokens, states = sentences[kept], tokens[kept], states.index_select(0, kept)
                mask = mask.index_select(0, kept) if mask is not None else None
            ids = tokens[:, None]


def leaves_finished_out(model, input_ids: torch.LongTensor, generation_config: GenerationConfig, synced_gpus: bool,
                        model_kwargs: dict, scores_only: bool = False) -> bool:
    """Whether a `_beam_search` or `_sample` call of `model` may leave finished sentences out of its steps: on a CPU
    (`skip_finished_sentences`: None) or as that attribute says, not sampled, only the sequences returned (with
    `scores_only`, their `sequences_scores` too), no decoder mask, the in-place cache and one encoder row per
    sentence."""
    skip = model.skip_finished_sentences
    if skip is None:
        skip = input_ids.device.type == "cpu"
    cache = model_kwargs.get(CACHE_NAME)
    encoder_outputs = model_kwargs.get("encoder_outputs")
    states = encoder_outputs.get("last_hidden_state") if encoder_outputs is not None else None
    return bool(skip and not synced_gpus and not generation_config.do_sample
                and (not generation_config.return_dict_in_generate or scores_only)
                and not any(getattr(generation_config, name, False) for name in
                            ("output_scores", "output_logits", "output_attentions", "output_hidden_states"))
                and model_kwargs.get("decoder_attention_mask") is None
                and isinstance(cache, EncoderDecoderCache)
                and isinstance(cache.self_attention_cache, VaswaniSelfAttentionCache)
                and torch.is_tensor(states)
                and input_ids.shape[0] == states.shape[0] * (generation_config.num_beams or 1))


def sequences_scores_only(generation_config: GenerationConfig) -> bool:
    """Whether a beam search returns its sequences and their `sequences_scores` only: the generation config's
    `output_sequences_scores` with `return_dict_in_generate` and no per-step `scores`."""
    return bool((generation_config.num_beams or 1) > 1
                and getattr(generation_config, "output_sequences_scores", False)
                and generation_config.return_dict_in_generate and not generation_config.output_scores)


# The generation mixin -------------------------------------------------------------------------------------------------


class VaswaniGenerationMixin(GenerationMixin):
    """transformers' `GenerationMixin` with beam 4 and length penalty 0.6 (§6.1) as its default and cheaper decoding
    steps.

    It overrides seven of GenerationMixin's private hooks; each says in one line why the public API (GenerationConfig,
    logits processors, a cache passed as `cache=`, `prepare_inputs_for_generation`) cannot do what it does.
    """

    use_cpu_packed_linears: bool = True  # see fast_paths_vaswani.inference_fast_paths
    skip_finished_sentences: bool | None = None  # see _beam_search(): None = on a CPU only
    lean_beam_search: bool = True  # see _beam_search(): False = transformers' loop, through the hooks

    @staticmethod
    def default_generation_config(config: PretrainedConfig) -> GenerationConfig:
        """Beam 4, length penalty 0.6 (§6.1; applied as transformers does, the score over |Y|^0.6, where the paper's
        GNMT penalty divides by ((5 + |Y|) / 6)^0.6: the package's `decoding.paper_generate`), starting from
        `decoder_start_token_id` and ending at `</s>`."""
        return GenerationConfig(
            num_beams=4,
            length_penalty=0.6,
            early_stopping=True,
            max_length=256,
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
            decoder_start_token_id=config.decoder_start_token_id,
        )

    def inference_fast_paths(self):
        """A context manager holding `generate()`'s CPU fast paths (`fast_paths_vaswani.inference_fast_paths`) across
        several `generate()` calls, so that the weights are packed once for all of them (`translate_sentences` holds
        it for its batches). The weights must not change inside it: the packed copies are not remade."""
        return inference_fast_paths(self, self.use_cpu_packed_linears)

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate`, run with the CPU fast paths installed (`inference_fast_paths`), then
        positions after each sequence's first `</s>` set to `pad_token_id`.

        transformers' beam search fills finished hypotheses with `pad_token_id or eos_token_id`, which picks
        `</s>` when the pad id is 0, as here (huggingface/transformers PR #47286): a beam-search row ended
        `[1, 2, 2, 2, ...]` where greedy search ends `[1, 2, 0, 0, ...]`. This makes every decoding method pad
        with `<pad>`. Returns what `generate` returns (a `(B * num_return_sequences, L)` tensor or a
        `GenerateOutput` whose `sequences` are fixed the same way).

        Raises:
            ValueError: `num_beams` or `num_return_sequences` is not an integer >= 1 (transformers would fail with a
                ZeroDivisionError or a negative tensor dimension), or another setting has the wrong type
                (`check_generation_values`), as a keyword or in the generation config; `input_ids` and the masks
                that do not fit together (`check_model_inputs`: not `(batch, length)` integers, an empty batch or
                sentence, a mask of another shape, of floats, of values other than 0 and 1, or with an all-0 row).
        """
        inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        check_model_inputs(inputs, *(kwargs.get(name) for name in (
            "attention_mask", "decoder_input_ids", "decoder_attention_mask", "inputs_embeds")))
        config = kwargs.get("generation_config") or self.generation_config
        check_generation_values(kwargs, "generate()")
        check_generation_values({name: getattr(config, name, None) for name in GENERATION_FIELDS if name not in kwargs},
                                "generate(): the generation config (generation_config)")
        style = length_penalty_style(kwargs, config)
        given = kwargs.get("length_penalty")
        alpha = getattr(config, "length_penalty", None)
        beams = kwargs.get("num_beams", getattr(config, "num_beams", 1))
        if given is not None:  # an integer alpha makes transformers' |Y|**alpha a Python int, which overflows a tensor
            kwargs["length_penalty"] = float(given)
        elif "length_penalty" not in kwargs and beams == 1 and alpha not in (None, 1.0):
            # greedy search has no length penalty: the folder's alpha (chosen for its beam search) is not passed on,
            # so that transformers does not warn that a flag of the call is ignored
            kwargs["length_penalty"] = 1.0
        elif "length_penalty" not in kwargs and isinstance(alpha, int) and not isinstance(alpha, bool):
            kwargs["length_penalty"] = float(alpha)
        token = _LENGTH_PENALTY_STYLE.set(style)
        try:
            with inference_fast_paths(self, self.use_cpu_packed_linears):
                outputs = super().generate(*args, **kwargs)
        finally:
            _LENGTH_PENALTY_STYLE.reset(token)
        sequences = outputs if torch.is_tensor(outputs) else getattr(outputs, "sequences", None)
        generation_config = kwargs.get("generation_config") or self.generation_config
        eos = kwargs.get("eos_token_id", generation_config.eos_token_id)
        pad = kwargs.get("pad_token_id", generation_config.pad_token_id)
        if sequences is None or sequences.ndim != 2 or eos is None or pad is None:
            return outputs
        eos = torch.as_tensor(eos, device=sequences.device).flatten()
        # Column 0 is the decoder start token; `after` is True strictly after the first generated </s>.
        is_eos = torch.isin(sequences[:, 1:], eos)
        after = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0
        sequences[:, 1:].masked_fill_(after, int(pad))
        return outputs

    def _prepare_generated_length(self, generation_config, has_default_max_length, *args, **kwargs):
        """transformers' length settings of a call. `max_new_tokens` wins over `max_length` either way; the default
        `max_length` of our generation config (256) only bounds calls that give no length, so a call that sets
        `max_new_tokens` beside that default is not warned that both are set (beside another `max_length` it is)."""
        # Private hook: the only place that warns, on every call, of max_new_tokens beside a default max_length.
        if (generation_config.max_new_tokens is not None
                and generation_config.max_length == self.generation_config.max_length):
            has_default_max_length = True
        return super()._prepare_generated_length(generation_config, has_default_max_length, *args, **kwargs)

    def _expand_inputs_for_generation(self, expand_size: int = 1, is_encoder_decoder: bool = False,
                                      input_ids: torch.LongTensor | None = None, **model_kwargs):
        """`generate()`'s hook that repeats every input `expand_size` times (once per beam or returned sample).

        The decoder input is repeated; the encoder output and its padding mask keep one row per sentence where the
        attention function takes a sentence's k hypotheses against one encoder row (`shares_encoder_rows`,
        kernels_vaswani.py's "vaswani_sdpa", which `generate()` installs in place of "sdpa"), so that encoder-decoder
        attention's keys and values are projected, cached and read once per sentence rather than once per beam.
        """
        # Private hook: generate() expands every model input here, and no public option keeps one of them unexpanded.
        encoder_outputs = model_kwargs.get("encoder_outputs")
        encoder_states = encoder_outputs.get("last_hidden_state") if encoder_outputs is not None else None
        encoder_mask = model_kwargs.get("attention_mask")
        input_ids, model_kwargs = super()._expand_inputs_for_generation(
            expand_size=expand_size, is_encoder_decoder=is_encoder_decoder, input_ids=input_ids, **model_kwargs)
        attention = None if model_kwargs.get("output_attentions") else \
            ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
        shared = getattr(attention, "shares_encoder_rows", False)
        if expand_size > 1 and is_encoder_decoder and torch.is_tensor(encoder_states) and shared:
            model_kwargs["encoder_outputs"]["last_hidden_state"] = encoder_states
            if encoder_mask is not None:
                model_kwargs["attention_mask"] = encoder_mask
        return input_ids, model_kwargs

    def _prepare_cache_for_generation(self, generation_config: GenerationConfig, model_kwargs: dict, *args,
                                      **kwargs):
        """`generate()`'s hook that creates the cache: transformers' default (`cache_implementation` unset or
        "dynamic") gets a `VaswaniSelfAttentionCache` sized for the call's maximum length as its self-attention half,
        so that no step copies the cached positions except a beam reorder. A cache the caller passed, or another
        `cache_implementation`, is left as transformers made it."""
        # Private hook: a cache passed as `cache=` becomes the caller's (generate() keeps and returns it): no default.
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get(CACHE_NAME)
        if (isinstance(cache, EncoderDecoderCache) and not getattr(cache, "_is_user_defined", False)
                and type(cache.self_attention_cache) is DynamicCache and cache.get_seq_length() == 0
                and generation_config.cache_implementation in (None, "dynamic")):
            capacity = kwargs.get("max_cache_length", args[-1] if args else 0)
            model_kwargs[CACHE_NAME] = EncoderDecoderCache(
                VaswaniSelfAttentionCache(capacity if isinstance(capacity, int) else 0), cache.cross_attention_cache)

    def _beam_search(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                     **model_kwargs):
        """transformers' beam search. Where only the sequences are returned (no `return_dict_in_generate`, so no
        scores, attentions or cache either; or, with the generation config's `output_sequences_scores=True` beside
        `return_dict_in_generate=True`, the sequences and their `sequences_scores`, without the per-step `scores` or
        `beam_indices`) and beams are not sampled, the finished sentences leave the batch: with logits processors
        `LeanBeamSearch` can run (`LeanBeamSearch.ROW_WISE`, or with a `for_sentences` method) and only the
        maximum-length and `</s>` stopping criteria, `LeanBeamSearch` runs the search (`leaves_finished_out`);
        otherwise transformers' loop runs with `FinishedSentenceSkipping` (for this call only). Either returns the
        same sequences as transformers' loop on the whole batch. `skip_finished_sentences` (the class attribute)
        chooses: None (the default) on a CPU only, True everywhere, False nowhere (transformers' loop as it is): on a
        CPU a step costs in proportion to the rows it computes, on a GPU it costs kernel launches whatever the rows,
        and leaving sentences out adds a host sync per step (benchmarks/bench_generation_paths.py measures both).
        `lean_beam_search = False` keeps transformers' loop, with the skipping."""
        # Private hook: the only one that sees the call's resolved GenerationConfig before beam search's first step.
        scores_only = sequences_scores_only(generation_config)
        eligible = leaves_finished_out(self, input_ids, generation_config, synced_gpus, model_kwargs, scores_only)
        lean = None
        if eligible and self.lean_beam_search:
            lean = LeanBeamSearch.applies(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                          model_kwargs)
        if lean is not None:
            sequences, sequences_scores = lean.run(input_ids, model_kwargs)
            return GenerateBeamEncoderDecoderOutput(sequences=sequences, sequences_scores=sequences_scores) \
                if scores_only else sequences
        if scores_only:  # transformers' loop gives `sequences_scores` with the per-step scores only
            generation_config = copy.copy(generation_config)
            generation_config.output_scores = True
            outputs = super()._beam_search(input_ids, logits_processor, stopping_criteria, generation_config,
                                           synced_gpus, **model_kwargs)
            outputs.scores = None
            return outputs
        states = model_kwargs["encoder_outputs"].last_hidden_state if eligible else None
        beams = generation_config.num_beams or 1
        if states is None or states.shape[0] == 1 or beams == 1:
            return super()._beam_search(input_ids, logits_processor, stopping_criteria, generation_config,
                                        synced_gpus, **model_kwargs)
        skipping = FinishedSentenceSkipping(states.shape[0], beams, input_ids.device)
        token = _SKIPPING.set(skipping)
        try:
            return super()._beam_search(input_ids, LogitsProcessorList([skipping, *logits_processor]),
                                        stopping_criteria, generation_config, synced_gpus, **model_kwargs)
        finally:
            _SKIPPING.reset(token)

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):
        """transformers' greedy search and sampling. Greedy search that returns only the sequences, with no streamer,
        runs as `LeanGreedySearch` where `leaves_finished_out` holds and `LeanGreedySearch.applies` (unless
        `lean_beam_search` is False): the same sequences, finished sentences left out of the steps after they end."""
        # Private hook: the only one that sees greedy search's resolved config, processors and stopping criteria.
        lean = None
        if streamer is None and self.lean_beam_search \
                and leaves_finished_out(self, input_ids, generation_config, synced_gpus, model_kwargs):
            lean = LeanGreedySearch.applies(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                            model_kwargs)
        if lean is not None:
            return lean.run(input_ids, model_kwargs)[0]
        return super()._sample(input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus,
                               streamer, **model_kwargs)

    def prepare_inputs_for_generation(self, *args, **kwargs) -> dict:
        """transformers' model inputs of a decoding step; inside a beam search that leaves finished sentences out,
        those of the rows it computes (`FinishedSentenceSkipping.select_inputs`)."""
        model_inputs = super().prepare_inputs_for_generation(*args, **kwargs)
        skipping = _SKIPPING.get()
        return skipping.select_inputs(model_inputs) if skipping is not None else model_inputs

    def _update_finished_beams(self, *args, **kwargs):
        """transformers' update of the finished hypotheses, noting which sentences are done; under the GNMT length
        penalty (`length_penalty_style="gnmt"`) a finishing hypothesis of |Y| tokens scores its log-probability over
        ((5 + |Y|) / 6)^alpha instead of transformers' |Y|^alpha (§6.1)."""
        # Private hook: beam search's finished sentences (`is_sent_finished`) are visible nowhere else, and it is the
        # one place that divides a finishing hypothesis by its length penalty.
        if _LENGTH_PENALTY_STYLE.get() == "gnmt" and kwargs.get("length_penalty"):
            alpha = float(kwargs["length_penalty"])
            length = kwargs["cur_len"] + 1 - kwargs["decoder_prompt_len"]  # |Y|, </s> included, as transformers counts
            kwargs["topk_log_probs"] = kwargs["topk_log_probs"] * (length**alpha / ((5 + length) / 6) ** alpha)
        results = super()._update_finished_beams(*args, **kwargs)
        skipping = _SKIPPING.get()
        if skipping is not None:
            skipping.note_finished(results[3], kwargs.get("early_stopping"),
                                   ~kwargs["is_early_stop_heuristic_unsatisfied"])
        return results

    def _reorder_cache(self, past_key_values: Cache, beam_idx: torch.LongTensor) -> Cache:
        """Beam search's hook to follow the surviving beams (`generate()` calls it after every step).

        Only the self-attention cache moves. Beams never leave their sentence, and the encoder-decoder attention cache
        holds the same keys and values for all beams of a sentence (one row per sentence with a shared-row attention,
        see `_expand_inputs_for_generation`): the default would gather it too, failing on its rows, or, with one row
        per beam, copying `decoder_layers x 2 x (B * beams, H, S, Dh)` floats per step for nothing.
        """
        # Private hook: a cache's own `reorder_cache` (the public path) would gather the cross-attention half as well.
        skipping = _SKIPPING.get()
        if skipping is not None and skipping.reorder(past_key_values, beam_idx):
            return past_key_values
        if isinstance(past_key_values, EncoderDecoderCache):
            past_key_values.self_attention_cache.reorder_cache(beam_idx)
        else:
            past_key_values.reorder_cache(beam_idx)
        return past_key_values
