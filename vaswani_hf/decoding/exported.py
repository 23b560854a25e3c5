"""Generation on exported graphs: the encoder and one decoder step with its KV cache as functions of tensors, exported
with `torch.export` or to ONNX (`torch.onnx.export(..., dynamo=True)`), and greedy and beam search loops over them
that give `generate()`'s tokens.

- `VaswaniExportableEncoder`: source ids and mask -> the keys and values of every decoder layer's encoder-decoder
  attention (§3.2.3), computed once per sentence;
- `VaswaniExportableDecoderStep`: the new target token of each row, the self-attention cache so far and the encoder
  keys and values -> next-token logits and the cache with one more position (incremental decoding, §3.2.3's masked
  self-attention without recomputing earlier positions);
- `torch_export_generation`, `onnx_export_generation`: both modules exported with dynamic batch, source and cache
  lengths; `onnx_generation_functions`: the two ONNX files as functions of torch tensors (onnxruntime);
- `greedy_search`, `beam_search`: the decoding loops over any `encode` and `step` functions with those signatures (the
  exported programs' `.module()`, the ONNX functions, or the two modules themselves), giving the tokens of
  `generate(num_beams=1, do_sample=False)` and of `generate(num_beams=k, length_penalty=..., early_stopping=True)`
  (beam 4 and length penalty 0.6 as the model's `generate()` defaults, §6.1, with transformers' penalty: the score
  divided by |Y|^0.6; the paper's GNMT penalty is `vaswani_hf.decoding.paper`).

Layouts: B rows, S source positions, P cached target positions, L decoder layers, H heads, Dh = d_model / H, V the
target vocabulary. Caches are one tensor each: `(L, 2, B, H, P, Dh)` for self-attention and `(L, 2, B, H, S, Dh)` for
encoder-decoder attention, keys at index 0 and values at index 1 of the second dimension.

```python
from vaswani_hf.decoding.exported import beam_search, torch_export_generation

encoder, step = torch_export_generation(model.eval(), max_length=64)
tokens = beam_search(encoder.module(), step.module(), input_ids, attention_mask, max_length=64,
                     decoder_start_token_id=1, eos_token_id=2, pad_token_id=0)
```
"""

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer, EncoderDecoderCache

Encode = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

ENCODER_INPUTS, ENCODER_OUTPUTS = ("input_ids", "attention_mask"), ("cross_key_values",)
STEP_INPUTS = ("decoder_input_ids", "self_key_values", "cross_key_values", "attention_mask")
STEP_OUTPUTS = ("logits", "next_self_key_values")


def _check_eval(model: nn.Module) -> None:
    if model.training:
        raise ValueError("Export generation from a model in eval mode (model.eval()): in training mode dropout "
                         "would be traced into the graph.")


class _TensorCacheLayer(DynamicLayer):
    """A `DynamicLayer` holding given `(B, H, P, Dh)` keys and values; its length is their shape, also when P is 0
    (`DynamicLayer` reads an empty cache as a branch on its size, which an export would freeze)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, True
        self.dtype, self.device = keys.dtype, keys.device

    def get_seq_length(self) -> int:
        return self.keys.shape[-2]


def _cache(key_values: torch.Tensor) -> Cache:
    """`(L, 2, B, H, P, Dh)` -> a `Cache` of L layers holding those keys and values."""
    return Cache(layers=[_TensorCacheLayer(layer[0], layer[1]) for layer in key_values.unbind(0)])


def _heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """`(B, S, D)` -> `(B, H, S, Dh)`."""
    return x.view(*x.shape[:2], num_heads, -1).transpose(1, 2)


class VaswaniExportableEncoder(nn.Module):
    """The encoder (§3.1) and the key and value projections of every decoder layer's encoder-decoder attention
    (§3.2.3), as one function of two tensors: what a decoding loop computes once per sentence.

    Args:
        model: a `VaswaniForConditionalGeneration` (or `VaswaniModel`) in eval mode, shared, not copied.
    Raises:
        ValueError: the model is in training mode.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        _check_eval(model)
        base = getattr(model, "model", model)
        self.encoder, self.decoder_layers = base.encoder, base.decoder.layers
        self.num_heads = base.config.num_heads
        self.eval()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """
        Args:
            input_ids: `(B, S)` source ids, right-padded; attention_mask: `(B, S)`, 1 for tokens and 0 for padding.
        Returns:
            `cross_key_values` `(L, 2, B, H, S, Dh)`.
        """
        states = self.encoder(input_ids=input_ids, attention_mask=attention_mask, return_dict=True).last_hidden_state
        return torch.stack([torch.stack([_heads(layer.encoder_attn.k_proj(states), self.num_heads),
                                         _heads(layer.encoder_attn.v_proj(states), self.num_heads)])
                            for layer in self.decoder_layers])


class VaswaniExportableDecoderStep(nn.Module):
    """One incremental decoding step of the decoder (§3.1) and the output projection (§3.4), with the self-attention
    cache in and out as tensors: the model's own decoder runs on a cache built from them, so the step computes what
    `generate()`'s steps compute.

    Args:
        model: a `VaswaniForConditionalGeneration` in eval mode, shared, not copied.
    Raises:
        ValueError: the model is in training mode.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        _check_eval(model)
        self.decoder, self.lm_head = model.model.decoder, model.lm_head
        self.eval()

    def forward(self, decoder_input_ids: torch.Tensor, self_key_values: torch.Tensor, cross_key_values: torch.Tensor,
                attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """
        Args:
            decoder_input_ids: `(B, T)` the new target tokens (T = 1 in a decoding loop), at positions P..P+T-1.
            self_key_values: `(L, 2, B, H, P, Dh)` the self-attention cache of the P earlier positions (P may be 0).
            cross_key_values: `(L, 2, B, H, S, Dh)` from `VaswaniExportableEncoder`.
            attention_mask: `(B, S)` the source mask.
        Returns:
            `logits` `(B, V)` of the last new position, and `next_self_key_values` `(L, 2, B, H, P + T, Dh)`.
        """
        self_cache, cross_cache = _cache(self_key_values), _cache(cross_key_values)
        cache = EncoderDecoderCache(self_cache, cross_cache)
        cache.is_updated = dict.fromkeys(range(len(cross_cache.layers)), True)  # encoder keys and values are given
        states = self.decoder(input_ids=decoder_input_ids, encoder_attention_mask=attention_mask, cache=cache,
                              use_cache=True, return_dict=True).last_hidden_state
        logits = self.lm_head(states[:, -1])
        return logits, torch.stack([torch.stack([layer.keys, layer.values]) for layer in self_cache.layers])


# Export ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _sizes_zero_or_one_stay_dynamic():
    """Export with sizes that may be 0 or 1 at run time (an empty cache at the first step, one sentence), which
    tracing would otherwise specialize away."""
    from torch.fx.experimental import _config

    if not hasattr(_config, "backed_size_oblivious"):
        raise RuntimeError(f"Exporting generation needs a torch whose export keeps sizes 0 and 1 dynamic "
                           f"(torch.fx.experimental._config.backed_size_oblivious); torch {torch.__version__} has not.")
    with _config.patch(backed_size_oblivious=True):
        yield


def _examples(model: nn.Module, max_length: int | None, max_source_length: int | None) -> tuple:
    """Example inputs and dynamic shapes of both modules; the position tables reserved for the lengths asked for."""
    config, base = model.config, model.model
    if max_length is not None:
        base.decoder.embed_positions.reserve(max_length)
    if max_source_length is not None:
        base.encoder.embed_positions.reserve(max_source_length)
    target_positions = base.decoder.embed_positions.weight.shape[0]
    source_positions = base.encoder.embed_positions.weight.shape[0]
    batch, source, past = 2, 5, 3
    layers, heads, head_dim = config.decoder_layers, config.num_heads, config.d_model // config.num_heads
    device = base.decoder.embed_tokens.weight.device
    dtype = base.decoder.embed_tokens.weight.dtype
    input_ids = torch.full((batch, source), config.eos_token_id, dtype=torch.long, device=device)
    attention_mask = torch.ones(batch, source, dtype=torch.long, device=device)
    step_inputs = (torch.full((batch, 1), config.decoder_start_token_id, dtype=torch.long, device=device),
                   torch.zeros(layers, 2, batch, heads, past, head_dim, dtype=dtype, device=device),
                   torch.zeros(layers, 2, batch, heads, source, head_dim, dtype=dtype, device=device), attention_mask)
    B = torch.export.Dim("batch", min=1, max=4096)  # noqa: N806
    S = torch.export.Dim("source", min=1, max=source_positions)  # noqa: N806
    P = torch.export.Dim("past", min=0, max=target_positions - 1)  # noqa: N806
    encoder_shapes = ({0: B, 1: S}, {0: B, 1: S})
    step_shapes = ({0: B}, {2: B, 4: P}, {2: B, 4: S}, {0: B, 1: S})
    return (input_ids, attention_mask), encoder_shapes, step_inputs, step_shapes


def torch_export_generation(model: nn.Module, max_length: int | None = None, max_source_length: int | None = None,
                            strict: bool = False) -> tuple:
    """`torch.export` of `VaswaniExportableEncoder` and `VaswaniExportableDecoderStep` with dynamic batch (1 to
    4096), source length (1 to the encoder's position table) and cache length (0 to the decoder's table minus one).

    Args:
        model: a `VaswaniForConditionalGeneration` in eval mode.
        max_length: target positions the step must reach (with the start token); a sinusoidal position table grows
            to it before export (`None`: the table as it is, `config.max_position_embeddings` positions by default).
        max_source_length: the same for the encoder's source positions.
        strict: `torch.export.export`'s `strict`.
    Returns:
        `(encoder, step)`, two `torch.export.ExportedProgram`s; call `.module()` of each.
    Raises:
        ValueError: the model is in training mode; `max_length` or `max_source_length` beyond learned positions.
        RuntimeError: torch too old to keep sizes 0 and 1 dynamic in an export.
    """
    encoder, step = VaswaniExportableEncoder(model), VaswaniExportableDecoderStep(model)
    encoder_inputs, encoder_shapes, step_inputs, step_shapes = _examples(model, max_length, max_source_length)
    with _sizes_zero_or_one_stay_dynamic():
        return (torch.export.export(encoder, encoder_inputs, dynamic_shapes=encoder_shapes, strict=strict),
                torch.export.export(step, step_inputs, dynamic_shapes=step_shapes, strict=strict))


def onnx_export_generation(model: nn.Module, folder: str | Path, max_length: int | None = None,
                           max_source_length: int | None = None) -> tuple[Path, Path]:
    """The two modules as ONNX files through `torch.onnx.export(..., dynamo=True)` (needs onnxscript), with the
    dynamic sizes of `torch_export_generation` and the input and output names `ENCODER_INPUTS`, `ENCODER_OUTPUTS`,
    `STEP_INPUTS`, `STEP_OUTPUTS`.

    Args:
        model: a `VaswaniForConditionalGeneration` in eval mode.
        folder: created if missing; gets `encoder.onnx` and `decoder_step.onnx` (and any external-data files ONNX
            writes beside them), each written in a temporary folder inside and moved in complete, so a failed or
            killed export leaves no partial file under those names.
        max_length, max_source_length: as in `torch_export_generation`.
    Returns:
        the paths of `encoder.onnx` and `decoder_step.onnx`.
    Raises:
        ValueError: the model is in training mode; `max_length` or `max_source_length` beyond learned positions.
        RuntimeError: torch too old to keep sizes 0 and 1 dynamic in an export.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    encoder, step = VaswaniExportableEncoder(model), VaswaniExportableDecoderStep(model)
    encoder_inputs, encoder_shapes, step_inputs, step_shapes = _examples(model, max_length, max_source_length)
    staging = Path(tempfile.mkdtemp(prefix=".onnx-export-", dir=folder))
    try:
        with _sizes_zero_or_one_stay_dynamic():
            torch.onnx.export(encoder, encoder_inputs, str(staging / "encoder.onnx"), dynamo=True,
                              dynamic_shapes=encoder_shapes, input_names=list(ENCODER_INPUTS),
                              output_names=list(ENCODER_OUTPUTS), verbose=False)
            torch.onnx.export(step, step_inputs, str(staging / "decoder_step.onnx"), dynamo=True,
                              dynamic_shapes=step_shapes, input_names=list(STEP_INPUTS),
                              output_names=list(STEP_OUTPUTS), verbose=False)
        for written in sorted(staging.iterdir()):
            os.replace(written, folder / written.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder / "encoder.onnx", folder / "decoder_step.onnx"


def onnx_generation_functions(encoder_path: str | Path, step_path: str | Path,
                              providers: tuple[str, ...] = ("CPUExecutionProvider",)) -> tuple[Encode, Step]:
    """`encode` and `step` functions of torch tensors over onnxruntime inference graphs of the two files of
    `onnx_export_generation`, for `greedy_search` and `beam_search`.

    Raises:
        ImportError: onnxruntime is not installed (`pip install 'vaswani-hf[onnx]'`).
    """
    import onnxruntime

    encoder_graph, step_graph = (onnxruntime.InferenceSession(str(path), providers=list(providers))
                                 for path in (encoder_path, step_path))

    def run(graph, names, tensors):
        outputs = graph.run(None, {name: t.detach().cpu().numpy() for name, t in zip(names, tensors, strict=True)})
        return tuple(torch.from_numpy(output) for output in outputs)

    def encode(input_ids, attention_mask):
        return run(encoder_graph, ENCODER_INPUTS, (input_ids, attention_mask))[0]

    def step(decoder_input_ids, self_key_values, cross_key_values, attention_mask):
        return run(step_graph, STEP_INPUTS, (decoder_input_ids, self_key_values, cross_key_values, attention_mask))

    return encode, step


# Decoding loops -------------------------------------------------------------------------------------------------------


def _start(encode: Encode, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows_per_sentence: int):
    """The encoder keys and values and the source mask, each sentence's repeated `rows_per_sentence` times, and an
    empty self-attention cache."""
    cross = encode(input_ids, attention_mask).repeat_interleave(rows_per_sentence, dim=2)
    mask = attention_mask.repeat_interleave(rows_per_sentence, dim=0)
    layers, _, rows, heads, _, head_dim = cross.shape
    return cross, mask, cross.new_zeros(layers, 2, rows, heads, 0, head_dim)


@torch.no_grad()
def greedy_search(encode: Encode, step: Step, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                  max_length: int, decoder_start_token_id: int, eos_token_id: int, pad_token_id: int) -> torch.Tensor:
    """Greedy decoding over `encode` and `step`: the tokens of `generate(num_beams=1, do_sample=False,
    max_length=max_length)`.

    Args:
        encode, step: functions of `VaswaniExportableEncoder`'s and `VaswaniExportableDecoderStep`'s signatures.
        input_ids, attention_mask: `(B, S)` sources, right-padded.
        max_length: most target tokens, the start token included.
    Returns:
        `(B, L)` ids (L <= max_length) starting with the start token, `pad_token_id` after each row's `</s>`.
    """
    cross, mask, cache = _start(encode, input_ids, attention_mask, 1)
    sequences = torch.full((input_ids.shape[0], 1), decoder_start_token_id, dtype=torch.long)
    open_rows = torch.ones(input_ids.shape[0], dtype=torch.bool)
    while sequences.shape[1] < max_length and open_rows.any():
        logits, cache = step(sequences[:, -1:], cache, cross, mask)
        tokens = logits.float().argmax(-1).masked_fill(~open_rows, pad_token_id)
        sequences = torch.cat([sequences, tokens[:, None]], dim=1)
        open_rows &= tokens.ne(eos_token_id)
    return sequences


@torch.no_grad()
def beam_search(encode: Encode, step: Step, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                max_length: int, decoder_start_token_id: int, eos_token_id: int, pad_token_id: int,
                num_beams: int = 4, length_penalty: float = 0.6) -> torch.Tensor:
    """Beam search over `encode` and `step` as transformers' `generate()` runs it with `early_stopping=True` (the
    model's generation config, §6.1): the tokens of `generate(num_beams=num_beams, length_penalty=length_penalty,
    max_length=max_length)`.

    Each step keeps the 2k best continuations of a sentence's k open hypotheses (k = `num_beams`); the k best of those
    that do not end in `</s>` stay open, and the ones among the first k that end in `</s>` (or reach `max_length`)
    compete for the k finished places with their log-probability divided by (generated length)^`length_penalty`. A
    sentence is done once its k finished places are filled, or when no open hypothesis could still beat its worst
    finished one; every sentence stops at `max_length`.

    Args:
        encode, step: functions of `VaswaniExportableEncoder`'s and `VaswaniExportableDecoderStep`'s signatures.
        input_ids, attention_mask: `(B, S)` sources, right-padded.
        max_length: most target tokens, the start token included.
    Returns:
        `(B, L)` ids: each sentence's best hypothesis, starting with the start token, `pad_token_id` after its
        `</s>`; L is the longest one's length.
    """
    batch, k = input_ids.shape[0], num_beams
    cross, mask, cache = _start(encode, input_ids, attention_mask, k)
    running = torch.full((batch, k, max_length), pad_token_id, dtype=torch.long)
    running[:, :, 0] = decoder_start_token_id
    running_scores = torch.zeros(batch, k)
    running_scores[:, 1:] = -1e9  # the k start rows are one hypothesis: only the first one's continuations count
    finished = running.clone()
    finished_scores = torch.full((batch, k), -1e9)
    finished_lengths = torch.zeros(batch, k, dtype=torch.long)
    is_finished = torch.zeros(batch, k, dtype=torch.bool)
    can_improve = torch.ones(batch, 1, dtype=torch.bool)
    first_k = torch.arange(2 * k) < k
    rows = torch.arange(batch)[:, None]
    length = 1
    while True:
        logits, cache = step(running[:, :, length - 1].reshape(batch * k, 1), cache, cross, mask)
        scores = F.log_softmax(logits.float(), dim=-1).view(batch, k, -1) + running_scores[:, :, None]
        vocab = scores.shape[-1]
        top_scores, top = torch.topk(scores.view(batch, k * vocab), k=2 * k)  # (B, 2k)
        origin, tokens = top // vocab, top % vocab
        candidates = running[rows, origin]  # (B, 2k, max_length)
        candidates[:, :, length] = tokens
        ends = tokens.eq(eos_token_id) | (length + 1 >= max_length)
        # the k best continuations that stay open
        open_scores = top_scores + ends.float() * -1e9
        keep = torch.topk(open_scores, k=k).indices
        running, running_scores = candidates[rows, keep], open_scores.gather(1, keep)
        # the finished hypotheses: the k best of those kept so far and those ending now
        ending = top_scores / (length**length_penalty)
        ending = ending + (is_finished.all(-1, keepdim=True) | ~can_improve | ~(ends & first_k)).float() * -1e9
        merged_scores = torch.cat([finished_scores, ending], dim=1)
        best = torch.topk(merged_scores, k=k).indices
        finished = torch.cat([finished, candidates], dim=1)[rows, best]
        finished_lengths = torch.cat([finished_lengths, torch.full_like(ends, length + 1, dtype=torch.long)],
                                     dim=1)[rows, best]
        is_finished = torch.cat([is_finished, ends & first_k], dim=1)[rows, best]
        finished_scores = merged_scores.gather(1, best)
        cache = cache.index_select(2, (origin.gather(1, keep) + rows * k).flatten())
        length += 1
        best_open = running_scores[:, :1] / ((length - 1) ** length_penalty)
        worst_finished = torch.where(is_finished, finished_scores.min(-1, keepdim=True).values, -1e9)
        can_improve &= (best_open > worst_finished).any(-1, keepdim=True)
        if not (can_improve.any() and not is_finished.all() and not ends.all()):
            break
    width = int(finished_lengths[:, 0].max())
    sequences = finished[:, 0, :width].clone()
    sequences.masked_fill_(torch.arange(width)[None] >= finished_lengths[:, :1], pad_token_id)
    return sequences


__all__ = [
    "VaswaniExportableDecoderStep",
    "VaswaniExportableEncoder",
    "beam_search",
    "greedy_search",
    "onnx_export_generation",
    "onnx_generation_functions",
    "torch_export_generation",
]
