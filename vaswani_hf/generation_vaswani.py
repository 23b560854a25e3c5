"""Generation for `VaswaniForConditionalGeneration`: the paper's decoding (§6.1: beam 4, length penalty 0.6) through
transformers' `generate()`, and what makes it cheaper than transformers' defaults while returning the same tokens.

- `VaswaniGenerationMixin`: `generate()` (pads after `</s>`, packs the CPU linears for the call), and the generation
  hooks that keep one encoder row per sentence, make the in-place cache, leave finished sentences out of beam search
  and reorder only the self-attention cache;
- `VaswaniSelfAttentionCache`: the decoder self-attention cache, written in place into a preallocated buffer;
- `group_queries`: encoder-decoder attention for k hypotheses that share one encoder row (one per sentence);
- `FinishedSentenceSkipping`: beam search's bookkeeping for decoding steps without the sentences it has finished;
- `CACHE_NAME`, `_one_cache`: the cache keyword, `cache=` (transformers >= 5.24) or `past_key_values=`;
- `check_generation_values`: generation settings of the wrong type refused with the field named.

It imports only torch, transformers and `kernels_vaswani.py`: transformers copies it beside the model code (relative
imports) for `trust_remote_code=True`.
"""

import contextlib
import copy
import functools
import math
import numbers
import warnings
from collections.abc import Mapping

import torch
from transformers import GenerationConfig, GenerationMixin, PretrainedConfig
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, EncoderDecoderCache
from transformers.modeling_outputs import Seq2SeqLMOutput

from .kernels_vaswani import packed_cpu_linears

# transformers 5.24 renamed `past_key_values` to `cache` (model keyword, `generate()`'s model_kwargs, output field) and
# keeps the old name as a deprecated alias; the model takes either and speaks the installed version's name.
CACHE_NAME = "cache" if "cache" in Seq2SeqLMOutput.__dataclass_fields__ else "past_key_values"


def _one_cache(past_key_values: Cache | None, cache: Cache | None) -> Cache | None:
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


def group_queries(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple:
    """Queries of k decoder rows that share one encoder row, as k * T queries of that row (encoder-decoder attention).

    `generate()` runs k = `num_beams` (or `num_return_sequences`) hypotheses per sentence, and
    `VaswaniGenerationMixin._expand_inputs_for_generation` keeps the encoder output at one row per sentence. Attending
    with the k hypotheses' queries together, `(B / k, H, k * T, Dh)`, against the sentence's keys and values computes
    the same attention (encoder-decoder attention has no causal mask, and its padding mask is the same for every query)
    while the keys and values are projected, cached and read once per sentence instead of k times.

    Args:
        query: `(B, H, T, Dh)`; key: `(B / k, H, S, Dh)`; attention_mask: `(B / k, 1, T, S)` or `None`.
    Returns:
        the grouped query, the padding mask for it (`(B / k, 1, 1, S)`, or `None`), and k.
    Raises:
        ValueError: B is not a multiple of the encoder rows.
    """
    batch, rows = query.shape[0], key.shape[0]
    if batch % rows:
        raise ValueError(
            f"Encoder-decoder attention got {batch} decoder rows for {rows} encoder rows; the decoder batch must "
            "equal the encoder batch, or be a multiple of it with each encoder row shared by consecutive decoder "
            "rows (as generate() does for beams)."
        )
    groups = batch // rows
    query = query.unflatten(0, (rows, groups)).transpose(1, 2).flatten(2, 3)  # (B / k, H, k * T, Dh)
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :1]  # a padding mask: one row serves every query
    return query, attention_mask, groups


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
        if self.length:
            self._replace(self._buffer.repeat_interleave(repeats, dim=0))

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


class FinishedSentenceSkipping:
    """Beam search state that lets decoding steps leave out the sentences beam search has finished.

    transformers' beam search keeps every sentence of the batch in every step until the last one is done; the steps of
    a finished sentence change nothing it returns (with `early_stopping=True`, or once no hypothesis can improve on
    its finished ones, every new candidate of the sentence is scored -1e9 below its finished hypotheses). So after the
    step in which a sentence finishes, its rows leave the decoder's batch, as CTranslate2 does: the self-attention
    cache keeps only the rows of the open sentences (the beam reorder gathers exactly those), the encoder-decoder
    cache, encoder output and source mask only their sentences, and the finished rows' logits are zeros (finite; never
    used). The first step, where the beams of a sentence hold the same start token, runs once per sentence (as
    CTranslate2 does) and its cache and logits are repeated for the beams. Used only where nothing of a finished
    sentence's later steps is returned: no scores, logits, attentions or hidden states asked for, no sampling, our
    self-attention cache.

    A decoding step calls `begin_step` on its inputs and `end_step` on its logits.

    Args:
        batch: sentences; beams: rows per sentence.
    """

    def __init__(self, batch: int, beams: int, device: torch.device):
        self.batch, self.beams, self.device = batch, beams, device
        self.step: str | None = None  # what the current step computes: "open" rows, the "first" step's, or all
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)  # finished, as of the last step
        self.sentences: torch.LongTensor | None = None  # open sentences in the decoder's batch (None: all)
        self.rows: torch.LongTensor | None = None  # their rows among the batch * beams of beam search
        self.closed_rows: torch.LongTensor | None = None  # the other rows
        self._encoder: tuple | None = None  # (encoder states, source mask) of the open sentences

    def note_finished(self, is_sent_finished: torch.Tensor, early_stopping, no_improvement: torch.Tensor) -> None:
        """After a step: a sentence whose `num_beams` hypotheses are finished, with `early_stopping=True` or no
        improvement possible, is done."""
        full = is_sent_finished.all(dim=-1)
        if early_stopping is not True:
            full = full & no_improvement.reshape(-1)
        self.done |= full

    def reorder(self, cache, beam_idx: torch.LongTensor) -> bool:
        """Beam search's cache reorder, dropping the rows of sentences done since the last step. Returns False when
        nothing was dropped yet (the caller then reorders as usual)."""
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
        self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        if len(new_rows) == len(old_rows):
            self_cache.reorder_cache(sources)
        else:
            for layer in self_cache.layers:
                layer.select_rows(sources)
            if isinstance(cache, EncoderDecoderCache):
                sentence_position = torch.full((self.batch,), -1, dtype=torch.long, device=self.device)
                sentence_position[old_sentences] = torch.arange(len(old_sentences), device=self.device)
                kept = sentence_position[open_now]
                for layer in cache.cross_attention_cache.layers:
                    if getattr(layer, "keys", None) is not None and layer.keys.numel():
                        layer.keys = layer.keys.index_select(0, kept)
                        layer.values = layer.values.index_select(0, kept)
            self._encoder = None
        self.sentences, self.rows = open_now, new_rows
        closed = torch.ones(full, dtype=torch.bool, device=self.device)
        closed[new_rows] = False
        self.closed_rows = closed.nonzero().flatten()
        return True

    def begin_step(self, decoder_input_ids: torch.LongTensor, attention_mask: torch.Tensor | None, encoder_outputs,
                   cache) -> tuple:
        """A decoding step's `(decoder_input_ids, attention_mask, encoder_outputs)` for the rows it computes: the open
        sentences' rows once some are done, one row per sentence at the first step, otherwise all (unchanged)."""
        self.step = None
        if self.rows is not None:
            self.step = "open"
            return self.compact_inputs(decoder_input_ids, attention_mask, encoder_outputs)
        if self.first_step_rows(decoder_input_ids, cache):
            self.step = "first"
            return decoder_input_ids[:: self.beams], attention_mask, encoder_outputs
        return decoder_input_ids, attention_mask, encoder_outputs

    def end_step(self, cache, logits: torch.Tensor) -> torch.Tensor:
        """The step's logits `(rows computed, T, V)` as beam search reads them, `(batch * beams, T, V)`."""
        if self.step == "first":
            return self.expand_first_step(cache, logits)
        if self.step == "open":
            return self.expand_logits(logits)
        return logits

    def first_step_rows(self, decoder_input_ids: torch.LongTensor, cache) -> bool:
        """Whether this is beam search's first step with the same decoder input in all beams of each sentence (as
        `generate()` expands it): then one row per sentence computes what all of its beams would."""
        if self.rows is not None or cache is None or cache.get_seq_length() != 0:
            return False
        if decoder_input_ids.shape[0] != self.batch * self.beams:
            return False
        grouped = decoder_input_ids.view(self.batch, self.beams, -1)
        return bool(grouped.eq(grouped[:, :1]).all())

    def expand_first_step(self, cache, logits: torch.Tensor) -> torch.Tensor:
        """After a first step on one row per sentence: every beam's row gets its sentence's cache and logits."""
        self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        for layer in self_cache.layers:
            layer.batch_repeat_interleave(self.beams)
        return logits.repeat_interleave(self.beams, dim=0)

    def compact_inputs(self, decoder_input_ids, attention_mask, encoder_outputs):
        """The open sentences' part of a decoding step's inputs (full batch -> open rows)."""
        if self._encoder is None:
            states = encoder_outputs[0] if encoder_outputs is not None else None
            self._encoder = (
                states.index_select(0, self.sentences) if states is not None else None,
                attention_mask.index_select(0, self.sentences) if attention_mask is not None else None)
        states, mask = self._encoder
        if encoder_outputs is not None:
            encoder_outputs = type(encoder_outputs)(last_hidden_state=states) if hasattr(
                encoder_outputs, "last_hidden_state") else (states,)
        return decoder_input_ids.index_select(0, self.rows), mask, encoder_outputs

    def expand_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`(open rows, T, V)` -> `(batch * beams, T, V)`, zeros in the rows of finished sentences."""
        full = logits.new_empty(self.batch * self.beams, *logits.shape[1:])
        return full.index_copy_(0, self.rows, logits).index_fill_(0, self.closed_rows, 0.0)


# The generation mixin -------------------------------------------------------------------------------------------------


class VaswaniGenerationMixin(GenerationMixin):
    """transformers' `GenerationMixin` with the paper's decoding (§6.1) as its default and cheaper decoding steps.

    It overrides five of GenerationMixin's private hooks; each says in one line why the public API (GenerationConfig,
    logits processors, a cache passed as `cache=`, `prepare_inputs_for_generation`) cannot do what it does.
    """

    use_cpu_packed_linears: bool = True  # see cpu_packed_linears()
    keep_packed_cpu_linears: bool = True  # see cpu_packed_linears()
    skip_finished_sentences: bool | None = None  # see _beam_search(): None = on a CPU only

    @staticmethod
    def paper_generation_config(config: PretrainedConfig) -> GenerationConfig:
        """Beam 4, length penalty 0.6 (§6.1), starting from `decoder_start_token_id` and ending at `</s>`."""
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

    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate`, then positions after each sequence's first `</s>` set to `pad_token_id`.

        transformers' beam search fills finished hypotheses with `pad_token_id or eos_token_id`, which picks
        `</s>` when the pad id is 0, as here (huggingface/transformers PR #47286): a beam-search row ended
        `[1, 2, 2, 2, ...]` where greedy search ends `[1, 2, 0, 0, ...]`. This makes every decoding method pad
        with `<pad>`. Returns what `generate` returns (a `(B * num_return_sequences, L)` tensor or a
        `GenerateOutput` whose `sequences` are fixed the same way).

        Raises:
            ValueError: `num_beams` or `num_return_sequences` is not an integer >= 1 (transformers would fail with a
                ZeroDivisionError or a negative tensor dimension), or another setting has the wrong type
                (`check_generation_values`), as a keyword or in the generation config.
        """
        inputs = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        if torch.is_tensor(inputs) and (inputs.ndim != 2 or 0 in inputs.shape):
            raise ValueError(f"generate(): input_ids must be a (batch, length) tensor with at least one sentence of at "
                             f"least one token (the tokenizer ends each with </s>), got shape {tuple(inputs.shape)}.")
        config = kwargs.get("generation_config") or self.generation_config
        check_generation_values(kwargs, "generate()")
        check_generation_values({name: getattr(config, name, None) for name in GENERATION_FIELDS if name not in kwargs},
                                "generate(): the generation config (generation_config)")
        with self.cpu_packed_linears(), self._length_limit_for(kwargs):
            outputs = super().generate(*args, **kwargs)
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

    @contextlib.contextmanager
    def _length_limit_for(self, kwargs: dict):
        """Inside it, a `generate(**kwargs)` call that sets `max_new_tokens` and no `max_length` sees no
        `max_length`: the default one of the generation config (256) only bounds calls that give no length, and
        transformers would otherwise warn on every call that both are set (`max_new_tokens` wins either way)."""
        given = kwargs.get("generation_config")
        config = given or self.generation_config
        if (kwargs.get("max_new_tokens", config.max_new_tokens) is None or kwargs.get("max_length") is not None
                or self.generation_config.max_length is None):
            yield
            return
        original = self.generation_config
        self.generation_config = copy.deepcopy(original)
        self.generation_config.max_length = None
        if given is not None:
            kwargs["generation_config"] = copy.deepcopy(given)
            kwargs["generation_config"].max_length = None
        try:
            yield
        finally:
            self.generation_config = original

    @contextlib.contextmanager
    def cpu_packed_linears(self):
        """Context manager: the model's linear layers multiply with oneDNN and prepacked weights inside it (see
        `kernels_vaswani.linear`), if the model is an fp32 model on a CPU, torch has oneDNN, autocast is off and
        `use_cpu_packed_linears` is True (the class attribute; set it to False to turn the path off). `generate()`
        runs inside it. Packing copies every linear weight once (as much memory again as the linear weights). The
        packed copies are kept for the next use while every weight is unchanged (the same tensor, storage, version
        counter and values: an optimizer step, `load_state_dict` or any in-place change makes them be packed again),
        so repeated `generate()` calls pack once; `keep_packed_cpu_linears = False` (the class attribute) drops them
        on exit instead. Nested uses keep the outer packing. Yields whether the weights are packed.

        The input projections that read one input are also stacked into one packed matrix per attention
        (`VaswaniAttention.fused_inputs`: q|k|v, or k|v in encoder-decoder attention), when they are plain
        projections (not wrapped, e.g. by a PEFT adapter, which then keeps its own forward)."""
        with packed_cpu_linears(self) as packed:
            yield packed

    def _expand_inputs_for_generation(self, expand_size: int = 1, is_encoder_decoder: bool = False,
                                      input_ids: torch.LongTensor | None = None, **model_kwargs):
        """`generate()`'s hook that repeats every input `expand_size` times (once per beam or returned sample).

        The decoder input is repeated, but the encoder output and its padding mask keep one row per sentence:
        encoder-decoder attention groups the hypotheses of a sentence (`group_queries`), so its keys and
        values are projected, cached and read once per sentence rather than once per beam.
        """
        # Private hook: generate() expands every model input here, and no public option keeps one of them unexpanded.
        encoder_outputs = model_kwargs.get("encoder_outputs")
        encoder_states = encoder_outputs.get("last_hidden_state") if encoder_outputs is not None else None
        encoder_mask = model_kwargs.get("attention_mask")
        input_ids, model_kwargs = super()._expand_inputs_for_generation(
            expand_size=expand_size, is_encoder_decoder=is_encoder_decoder, input_ids=input_ids, **model_kwargs)
        if expand_size > 1 and is_encoder_decoder and torch.is_tensor(encoder_states):
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
        scores, attentions or cache either) and beams are not sampled, the decoding steps leave the sentences that beam
        search has finished out of the batch (`FinishedSentenceSkipping`): the same sequences, computed for the open
        sentences only. `skip_finished_sentences` (the class attribute) chooses: None (the default) on a CPU only,
        True everywhere, False nowhere: on a CPU a step costs in proportion to the rows it computes, on a GPU it costs
        kernel launches whatever the rows, and the skipping adds a host sync per step
        (benchmarks/bench_generation_paths.py measures both)."""
        # Private hook: the only one that sees the call's resolved GenerationConfig before beam search's first step.
        cache = model_kwargs.get(CACHE_NAME)
        encoder_outputs = model_kwargs.get("encoder_outputs")
        states = encoder_outputs.get("last_hidden_state") if encoder_outputs is not None else None
        beams = generation_config.num_beams or 1
        skip = self.skip_finished_sentences
        if skip is None:
            skip = input_ids.device.type == "cpu"
        eligible = (skip and not synced_gpus and not generation_config.do_sample
                    and not any(getattr(generation_config, name, False) for name in
                                ("return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
                                 "output_hidden_states"))
                    and isinstance(cache, EncoderDecoderCache)
                    and isinstance(cache.self_attention_cache, VaswaniSelfAttentionCache)
                    and torch.is_tensor(states) and states.shape[0] > 1 and beams > 1
                    and input_ids.shape[0] == states.shape[0] * beams)
        self.__dict__["_finished_sentences"] = (
            FinishedSentenceSkipping(states.shape[0], beams, input_ids.device) if eligible else None)
        try:
            return super()._beam_search(input_ids, logits_processor, stopping_criteria, generation_config,
                                        synced_gpus, **model_kwargs)
        finally:
            self.__dict__.pop("_finished_sentences", None)

    def _update_finished_beams(self, *args, **kwargs):
        """transformers' update of the finished hypotheses, noting which sentences are done."""
        # Private hook: beam search's finished sentences (`is_sent_finished`) are visible nowhere else.
        results = super()._update_finished_beams(*args, **kwargs)
        skipping = self.__dict__.get("_finished_sentences")
        if skipping is not None:
            skipping.note_finished(results[3], kwargs.get("early_stopping"),
                                   ~kwargs["is_early_stop_heuristic_unsatisfied"])
        return results

    def _reorder_cache(self, past_key_values: Cache, beam_idx: torch.LongTensor) -> Cache:
        """Beam search's hook to follow the surviving beams (`generate()` calls it after every step).

        Only the self-attention cache moves. Beams never leave their sentence, and the encoder-decoder attention cache
        holds one row per sentence (see `_expand_inputs_for_generation`), the same for all its beams: the default
        would gather it too, failing on its rows, or, with one row per beam, copying
        `decoder_layers x 2 x (B * beams, H, S, Dh)` floats per step for nothing.
        """
        # Private hook: a cache's own `reorder_cache` (the public path) would gather the cross-attention half as well.
        skipping = self.__dict__.get("_finished_sentences")
        if skipping is not None and skipping.reorder(past_key_values, beam_idx):
            return past_key_values
        if isinstance(past_key_values, EncoderDecoderCache):
            past_key_values.self_attention_cache.reorder_cache(beam_idx)
        else:
            past_key_values.reorder_cache(beam_idx)
        return past_key_values

    def _finished_sentences_step(self, decoder_input_ids: torch.LongTensor | None,
                                 decoder_attention_mask: torch.Tensor | None,
                                 labels: torch.Tensor | None) -> FinishedSentenceSkipping | None:
        """The running beam search's `FinishedSentenceSkipping` when this forward is one of its decoding steps (then
        `begin_step` and `end_step` apply), else `None` (see `_beam_search`)."""
        skipping = self.__dict__.get("_finished_sentences")
        if (skipping is None or labels is not None or decoder_input_ids is None or decoder_attention_mask is not None
                or decoder_input_ids.shape[0] != skipping.batch * skipping.beams):
            return None
        return skipping
