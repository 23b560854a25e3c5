"""CPU fast paths for the Transformer of `modeling_vaswani.py`: what they compute. `fast_paths_vaswani.py` installs
them from outside the model (for a `generate()` call and for a training run) and undoes them.

The model file is the paper; what is here makes it cheaper on a CPU and computes the same numbers (to float rounding;
tests/test_kernels.py holds each path against the plain model):

- `vaswani_sdpa`, registered with transformers' `AttentionInterface` as "vaswani_sdpa": transformers' "sdpa"
  attention that also takes (1) the k hypotheses of a sentence sharing one encoder row (`generate()` keeps the encoder
  output at one row per sentence), (2) the unpadded tokens of a batch, packed as one row, with the lengths passed as
  keyword arguments the way transformers' padding-free path passes `cu_seq_lens_q/k` (`unpad_batch`), and (3) on a
  CPU in bf16/fp16 or with attention dropout, Eq. 1 with the scores in fp32 (`cpu_attention_forward`);
- `CPUDropout`: `nn.Dropout` whose random mask costs a fifth of torch's on a CPU;
- `OneDNNLinear`: `nn.Linear` whose products run in oneDNN: in fp32 training where oneDNN is much faster than torch's
  BLAS on this CPU (`cpu_training_matmul`), in bf16 autocast training on row counts rounded up to a multiple of
  `TRAINING_ROW_MULTIPLE` (so that oneDNN reuses the kernels it compiled for earlier steps); in inference with weights
  prepacked (`pack_for_inference`: MKL's packed sgemm where torch has MKL, else oneDNN's layout);
- `cpu_projected_cross_entropy`: the output projection and the label-smoothed loss of a training step in one
  function that writes one buffer of the logits' size where `F.cross_entropy` writes four.

Like the model files, this file imports only torch and transformers: transformers copies it beside the model code
for `trust_remote_code=True`.
"""

import functools
import os
import threading
import time
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.utils import logging

logger = logging.get_logger(__name__)

# Dropout -------------------------------------------------------------------------------------------------------------


def _dropout_bits(x: torch.Tensor) -> torch.Tensor:
    """Random 16-bit integers q of `x`'s shape, uniform on [-2^15, 2^15): one 64-bit draw for four elements (torch's
    CPU `bernoulli_` spends about 6 ns per element, this a fraction of it; benchmarks/bench_dropout.py)."""
    numel = x.numel()
    bits = torch.empty((numel + 3) // 4, dtype=torch.int64, device=x.device).random_(-(2**63), None)
    return bits.view(torch.int16)[:numel].view(x.shape)


def _dropout_keep_mask(bits: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    """The keep mask of `_dropout_bits`: 1 where q >= t = -2^15 + round(p * 2^16) (kept with probability 1 - p to
    within 2^-17; for p = 0.1, 0.899994), else 0, scaled by 1 / (1 - p) for fp32, in `dtype`. Made in arithmetic,
    clamp(q - t + 1, 0, 1) (exactly 0 or 1 for integers q): on a CPU torch's comparisons and `where` on bool masks take
    several times as long as a product of the same size. fp32 clamps in float; other dtypes clamp the 16-bit integers
    themselves, clamp(q, t - 1, t) - (t - 1), which writes 2 bytes an element where a float mask writes 4 and a cast."""
    threshold = -(2**15) + round(p * 2**16)
    if dtype == torch.float32:
        return bits.to(torch.float32).sub_(threshold - 1).clamp_(0.0, 1.0).mul_(1.0 / (1.0 - p))
    if not -(2**15) < threshold < 2**15:  # p within 2^-17 of 0 or 1: t - 1 or t leaves the 16-bit range
        return torch.full_like(bits, float(threshold <= -(2**15)), dtype=dtype)
    return torch.clamp(bits, threshold - 1, threshold).sub_(threshold - 1).to(dtype)


class _CPUDropoutFunction(torch.autograd.Function):
    """Inverted dropout: kept elements scaled by 1 / (1 - p), as `F.dropout`; the backward pass applies the same mask
    and scale, one pass over the tensor each way (fp32: a product with the scaled mask; other dtypes: the 0/1 mask
    and the scale in one `addcmul`, x * scale rounded once as `F.dropout` rounds it). Kept for the backward pass, 2
    bytes an element either way (`F.dropout` keeps a 4-byte float mask in fp32): in fp32 the random integers, the
    mask made from them again there; in other dtypes the 0/1 mask itself, as small as the integers and three passes
    cheaper than remaking it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        bits = _dropout_bits(x)
        mask = _dropout_keep_mask(bits, p, x.dtype)
        ctx.p, ctx.scale = p, 1.0 if x.dtype == torch.float32 else 1.0 / (1.0 - p)
        ctx.save_for_backward(bits if x.dtype == torch.float32 else mask)
        return _masked(x, mask, ctx.scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (kept,) = ctx.saved_tensors
        mask = _dropout_keep_mask(kept, ctx.p, torch.float32) if kept.dtype == torch.int16 else kept
        return _masked(grad, mask, ctx.scale), None


def _masked(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """x * mask * scale in one pass: with scale 1, a product; else 0 + scale * x * mask, which for a 0/1 mask rounds
    x * scale once (in fp32 for bf16 and fp16), as a product with the mask followed by one with the scale does."""
    if scale == 1.0:
        return torch.mul(x, mask)
    return torch.addcmul(x.new_zeros(()), x, mask, value=scale)


def cpu_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """`F.dropout(x, p, training)` (§5.4), with the cheaper mask of `_CPUDropoutFunction` on a CPU in eager mode."""
    if training and 0.0 < p < 1.0 and x.device.type == "cpu" and not torch.compiler.is_compiling():
        return _CPUDropoutFunction.apply(x, p)
    return F.dropout(x, p=p, training=training)


class CPUDropout(nn.Dropout):
    """`nn.Dropout` drawing its mask with `cpu_dropout` (same distribution, scale and gradient)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_dropout(x, self.p, self.training)


# Attention -----------------------------------------------------------------------------------------------------------


def cpu_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                          is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Eq. 1 on a CPU where torch's CPU flash-attention kernel is slow: in bf16/fp16 (several times this one's time,
    benchmarks/bench_training_paths.py), and with attention dropout (`cpu_dropout` draws the mask). Both products,
    the mask and the softmax in fp32 (autocast off: the scores and the probabilities are not rounded to 8 bits of
    mantissa), the output rounded to the inputs' precision: in bf16 oneDNN would compile a kernel for each new
    (batch, length) of a training step, where fp32 products compile nothing. Shapes as `eager_attention_forward`,
    whose causal rule it follows (no mask: a causal module hides later positions); returns the output
    `(B, Tq, H, Dh)` and no probabilities."""
    with torch.autocast(query.device.type, enabled=False):
        query, key = (t.to(torch.float32, memory_format=torch.contiguous_format) for t in (query, key))  # one pass
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, Tq, Tk)
        is_causal = getattr(module, "is_causal", False) if is_causal is None else is_causal
        if attention_mask is None and is_causal and query.shape[2] > 1:
            attention_mask = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1) * torch.finfo(scores.dtype).min
        if attention_mask is not None:
            scores = scores + attention_mask.float()
        probs = cpu_dropout(F.softmax(scores, dim=-1), dropout, module.training and dropout > 0.0)
        output = torch.matmul(probs, value.to(torch.float32, memory_format=torch.contiguous_format))
    return output.transpose(1, 2).to(value.dtype, memory_format=torch.contiguous_format), None


def vaswani_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                 **kwargs) -> tuple[torch.Tensor, None]:
    """Eq. 1 as transformers' "sdpa" computes it, for three more layouts (see the module docstring).

    Args:
        query: `(B, H, Tq, Dh)`; key, value: `(B, H, Tk, Dh)`, or `(B / k, H, Tk, Dh)` where k consecutive query rows
            share a key row (encoder-decoder attention in `generate()`); with `cu_seq_lens_source` and
            `cu_seq_lens_target` in `kwargs` (`unpad_batch`), `(1, H, N, Dh)`: the N unpadded tokens of a batch.
        attention_mask: additive `(B, 1, Tq, Tk)` (`(B / k, 1, Tq, Tk)` with shared rows) or `None`; ignored with
            unpadded tokens, whose lengths define the mask.
    Returns:
        output `(B, Tq, H, Dh)` (unpadded: `(1, N, H, Dh)`) and no probabilities.
    """
    unpadded = kwargs.get("cu_seq_lens_target") is not None
    if unpadded:
        query, key, value, attention_mask, queries = _padded_layout(module, query, key, value, kwargs)
    batch, length = query.shape[0], query.shape[2]
    groups = batch // key.shape[0]
    if groups > 1:  # (B, H, T, Dh) -> (B / k, H, k * T, Dh): the k rows' queries against their one key row
        query = query.unflatten(0, (-1, groups)).transpose(1, 2).flatten(2, 3)
        attention_mask = attention_mask[:, :, :1] if attention_mask is not None else None  # a padding mask
    if query.device.type == "cpu" and (query.dtype in (torch.bfloat16, torch.float16) or dropout > 0.0):
        output, _ = cpu_attention_forward(module, query, key, value, attention_mask, scaling, dropout)
    else:
        output, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                           scaling=scaling)
    output = output.reshape(batch, length, *output.shape[2:])  # (B / k, k * T, H, Dh) is (B, T, H, Dh)
    if unpadded:
        output = queries.pack(output)[None]  # (1, N, H, Dh)
    return output, None


vaswani_sdpa.shares_encoder_rows = True  # modeling_vaswani.check_encoder_rows reads it
AttentionInterface.register("vaswani_sdpa", vaswani_sdpa)


# Unpadded tokens -----------------------------------------------------------------------------------------------------


class UnpaddedTokens:
    """The tokens of a right-padded `(B, L)` batch, each row's first `lengths[b]` positions, packed as `(N, ...)`.

    Everything in a layer but attention is position-wise (the projections, the FFN, LayerNorm, dropout, the residual
    adds), so it can run on the N tokens alone: a length-bucketed batch of Multi30k sentences is 10-15 % padding, and
    a step's matrix products shrink by as much. Attention runs on the padded layout (`pad` before it, `pack` after).
    """

    def __init__(self, cu_seq_lens: torch.Tensor, length: int):
        lengths = cu_seq_lens.diff()
        self.batch, self.length = len(lengths), length
        keep = torch.arange(length, device=cu_seq_lens.device) < lengths[:, None]  # (B, L)
        self.keep, self.index, self.left_out = keep, keep.flatten().nonzero()[:, 0], (~keep).flatten().nonzero()[:, 0]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """`(B, L, ...)` -> `(N, ...)`: the tokens, in order."""
        return _Pack.apply(x.reshape(self.batch * self.length, *x.shape[2:]), self)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """`(N, ...)` -> `(B, L, ...)`, zeros at the padded positions."""
        return _Pad.apply(x, self).view(self.batch, self.length, *x.shape[1:])

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """`(N, ...)` -> `(B * L, ...)` with zeros elsewhere, writing each element once."""
        full = x.new_empty(self.batch * self.length, *x.shape[1:])
        return full.index_fill_(0, self.left_out, 0.0).index_copy_(0, self.index, x)


@functools.lru_cache(maxsize=4)  # one step's two sides, reused by every attention call of the step
def unpadded_tokens(cu_seq_lens: torch.Tensor, length: int) -> UnpaddedTokens:
    return UnpaddedTokens(cu_seq_lens, length)


class _Pack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tokens: UnpaddedTokens) -> torch.Tensor:
        ctx.tokens = tokens
        return x.index_select(0, tokens.index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.tokens.scatter(grad.contiguous()), None


class _Pad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tokens: UnpaddedTokens) -> torch.Tensor:
        ctx.tokens = tokens
        return tokens.scatter(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.reshape(grad.shape[0], -1).index_select(0, ctx.tokens.index).view(-1, *grad.shape[1:]), None


def _padded_layout(module: nn.Module, query, key, value, kwargs: dict) -> tuple:
    """Unpadded `(1, H, N, Dh)` queries, keys and values in the padded layout `(B, H, L, Dh)` with its additive mask:
    the encoder's self-attention reads the source lengths, the decoder's the target's, encoder-decoder attention
    queries of the target and keys of the source."""
    def side(name: str) -> UnpaddedTokens:
        return unpadded_tokens(kwargs[f"cu_seq_lens_{name}"], kwargs[f"max_length_{name}"])

    decoder = module.is_causal or module.is_cross_attention
    queries = side("target" if decoder else "source")
    keys = side("target" if module.is_causal else "source")

    def padded(x: torch.Tensor, tokens: UnpaddedTokens) -> torch.Tensor:  # (1, H, N, Dh) -> (B, H, L, Dh)
        return tokens.pad(x[0].transpose(0, 1)).transpose(1, 2)

    mask = None
    if not module.is_causal:  # padded keys hidden; the decoder's causality hides its padding from its tokens
        mask = (~keys.keep[:, None, None, :]) * torch.finfo(query.dtype).min  # (B, 1, 1, L_k)
        mask = mask.to(query.dtype).expand(-1, 1, queries.length, -1)
    return padded(query, queries), padded(key, keys), padded(value, keys), mask, queries


def unpad_batch(inputs: dict, labels: torch.Tensor) -> tuple[dict, torch.Tensor] | None:
    """A right-padded training batch as one row of its tokens, for a CPU training step on `vaswani_sdpa`.

    Args:
        inputs: the model's keyword inputs: `input_ids`, `attention_mask` `(B, S)` and `decoder_input_ids` `(B, T)`
            (no embeddings, no encoder output, no decoder padding mask).
        labels: `(B, T)`; each target row keeps its positions up to its last label (a causal decoder never lets a
            position read later ones, so they compute what they compute in the padded batch).
    Returns:
        `(inputs, labels)` of the unpadded batch: ids and positions `(1, N)`, and the keyword arguments
        `cu_seq_lens_source`, `cu_seq_lens_target` `(B + 1,)` and `max_length_source`, `max_length_target` that
        "vaswani_sdpa" reads; `None` where the padded layout must stay: inputs of another kind, a row that is not
        right-padded (its positions would change) or empty (it defines what its queries attend to), or no padding.
    """
    ids, mask, decoder_ids = inputs.get("input_ids"), inputs.get("attention_mask"), inputs.get("decoder_input_ids")
    if (ids is None or mask is None or decoder_ids is None or ids.dim() != 2 or mask.shape != ids.shape
            or labels.shape != decoder_ids.shape or set(inputs) - {"input_ids", "attention_mask", "decoder_input_ids"}):
        return None
    positions = torch.arange(1, labels.shape[1] + 1)
    source = mask.ne(0).sum(1)
    target = (labels.ne(-100) * positions).amax(1)  # up to the last label
    right_padded = mask.ne(0).eq(torch.arange(ids.shape[1]) < source[:, None]).all()
    if not bool(right_padded) or bool(source.eq(0).any() | target.eq(0).any()):
        return None
    if bool(source.eq(ids.shape[1]).all() & target.eq(labels.shape[1]).all()):
        return None
    sides = {}
    for name, lengths, tensors in (("source", source, (ids,)), ("target", target, (decoder_ids, labels))):
        length = int(lengths.max())
        cu_seq_lens = F.pad(lengths.cumsum(0), (1, 0))
        keep = unpadded_tokens(cu_seq_lens, length).keep
        sides[name] = ([t[:, :length][keep][None] for t in tensors], torch.arange(length).expand_as(keep)[keep][None],
                       cu_seq_lens, length)
    (source_ids,), source_positions, cu_source, max_source = sides["source"]
    (target_ids, target_labels), target_positions, cu_target, max_target = sides["target"]
    return dict(input_ids=source_ids, position_ids=source_positions, decoder_input_ids=target_ids,
                decoder_position_ids=target_positions, cu_seq_lens_source=cu_source, cu_seq_lens_target=cu_target,
                max_length_source=max_source, max_length_target=max_target), target_labels


# Linear layers in oneDNN and MKL -------------------------------------------------------------------------------------


@functools.cache
def has_onednn_linear() -> bool:
    """Whether this torch has oneDNN and the two operators of the oneDNN linears (torch >= 2.0 builds)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def has_mkl_packed_linear() -> bool:
    """Whether this torch has MKL and its packed-sgemm linear operators (x86 builds)."""
    try:
        return bool(torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
                    and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


def pack_for_inference(weight: torch.Tensor, library: str | None = None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """An fp32 `(N, K)` weight packed for `packed_linear`, by `library`: "mkl" (MKL's packed-sgemm layout, the one
    CTranslate2's fp32 products read on x86; one packing serves every row count) or "onednn" (oneDNN's blocked
    layout); default "mkl" where torch has MKL, else "onednn". Returns `(packed, weight, library)`; the weight gives
    MKL's product its shape (it is not read).

    Raises:
        ValueError: another `library`.
        RuntimeError: from torch, where this build cannot pack the weight (`inference_fast_paths` then decodes with
            `nn.Linear`).
    """
    library = library or ("mkl" if has_mkl_packed_linear() else "onednn")
    if library == "mkl":
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, 64), weight, library
    if library == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, 64), weight, library
    raise ValueError(f'pack_for_inference: library must be "mkl" or "onednn" (or None for the default), got '
                     f"{library!r}.")


def packed_linear(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor, str],
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b for `(..., K)` x with W packed by `pack_for_inference` -> `(..., N)`, fp32."""
    data, weight, library = packed
    if library == "onednn":
        return _onednn_linear(x, data, bias)
    if x.numel() == 0:
        out = x.new_zeros(*x.shape[:-1], weight.shape[0])
        return out if bias is None else out + bias
    return torch.ops.mkl._mkl_linear(x, data, weight, bias, x.numel() // x.shape[-1])


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b with oneDNN: `(M, K)` x `(N, K)` (either may be a transposed view, or W packed) -> `(M, N)`, fp32.
    An empty operand (a batch without labelled tokens) gives its empty or zero product: oneDNN refuses a zero size."""
    if x.numel() == 0 or weight.numel() == 0:
        out = x.new_zeros(x.shape[0], weight.shape[0])
        return out if bias is None else out + bias
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _best_seconds(function, repetitions: int = 5) -> float:
    function()
    best = float("inf")
    for _ in range(repetitions):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def cpu_training_matmul() -> str:
    """Which library multiplies the fp32 linears of CPU training steps: "onednn" or "blas" (torch's default, MKL on
    x86 builds).

    MKL runs its AVX2 code on non-Intel CPUs, so where AVX-512 units are full width oneDNN's AVX-512 code can multiply
    much faster at base-model shapes; elsewhere the two are close (benchmarks/benchmark.py reports both peaks). So
    this is decided by measuring, once per process: the three products of a linear's training step (forward x W^T,
    input gradient g W, weight gradient g^T x; 512 rows, 512 -> 1024 features) with both, best of 5 each (about
    0.1 s); oneDNN is chosen only when it takes at most 1/1.3 of BLAS's time, so noise cannot flip the choice where
    the two are close. The environment variable `VASWANI_CPU_MATMUL` = `onednn` or `blas` overrides the measurement
    (`auto`, the default, measures). Results agree to fp32 rounding either way.

    Raises:
        ValueError: `VASWANI_CPU_MATMUL` holds another value.
    """
    choice = os.environ.get("VASWANI_CPU_MATMUL", "auto").strip().lower()
    if choice not in ("auto", "onednn", "blas"):
        raise ValueError(f"VASWANI_CPU_MATMUL={choice!r}: use 'auto' (measure), 'onednn' or 'blas'.")
    if not has_onednn_linear():
        return "blas"
    if choice != "auto":
        return choice
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)  # not the global one: dropout's random numbers stay the same
        x, weight, grad = (torch.randn(*shape, generator=generator) for shape in ((512, 512), (1024, 512), (512, 1024)))
        try:
            onednn = _best_seconds(lambda: (_onednn_linear(x, weight), _onednn_linear(grad, weight.t()),
                                            _onednn_linear(grad.t(), x.t())))
        except RuntimeError as error:  # a torch build whose oneDNN cannot run these
            logger.warning_once(f"oneDNN linear failed ({error}); CPU training multiplies with torch's BLAS.")
            return "blas"
        blas = _best_seconds(lambda: (F.linear(x, weight), grad @ weight, grad.t() @ x))
    return "onednn" if 1.3 * onednn <= blas else "blas"


def _onednn_grad_weight(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """g^T x with oneDNN: `x` `(M, in)`, `grad` `(M, out)` -> `(out, in)`.

    oneDNN takes its first operand contiguous (a transposed view is copied) and its second one as it is: g^T x copies
    g^T (rows x out), (x^T g)^T copies x^T and the (in, out) result; the smaller copies win (the latter for the output
    projection, 512 -> 8,000, in about half the time)."""
    (rows, in_features), out_features = x.shape, grad.shape[1]
    if in_features * (rows + out_features) < out_features * rows:
        return _onednn_linear(x.t(), grad.t()).t().contiguous()
    return _onednn_linear(grad.t(), x.t())


# oneDNN compiles a kernel for each shape it multiplies (with AMX about 2 ms a bf16 product of a training step's size,
# 16 ms the output projection's), and a step's row counts (its unpadded tokens) change every step: its bf16 products
# round their rows up to a multiple of this, so that a few row counts recur and their kernels are reused.
TRAINING_ROW_MULTIPLE = 64


@functools.cache
def onednn_bf16() -> bool:
    """Whether torch multiplies bf16 in oneDNN on this CPU (native bf16: AVX512-BF16 or AMX); elsewhere in its own
    kernels, which compile nothing per shape."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _rows_padded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`(M, K)` -> `(M', K)` in `dtype`, M' = M rounded up to `TRAINING_ROW_MULTIPLE`, zeros in the rows added."""
    rows = x.shape[0]
    padded = x.new_empty((-(-rows // TRAINING_ROW_MULTIPLE) * TRAINING_ROW_MULTIPLE, x.shape[1]), dtype=dtype)
    padded[:rows].copy_(x)
    padded[rows:].zero_()
    return padded


# The last input padded by `_Bf16LinearFunction` (a weak reference, its version, the padded copy), per thread:
# attention's W^Q, W^K, W^V (and the cross-attention's W^K, W^V) read one input, padded and cast once for all of them.
_LAST_PADDED = threading.local()


def _padded_input(x: torch.Tensor) -> torch.Tensor:
    """`_rows_padded(x as (M, K), bf16)`, reused while `x` (the same tensor, not changed in place) comes again."""
    last = getattr(_LAST_PADDED, "entry", None)
    if last is not None and last[0]() is x and last[1] == x._version:
        return last[2]
    padded = _rows_padded(x.reshape(x.shape[:-1].numel(), x.shape[-1]), torch.bfloat16)
    _LAST_PADDED.entry = (weakref.ref(x), x._version, padded)
    return padded


class _Bf16LinearFunction(torch.autograd.Function):
    """`F.linear` as CPU bf16 autocast computes it and differentiates it (bf16 operands and products, fp32 weight and
    bias gradients, the input's gradient in the input's dtype), on rows padded to `TRAINING_ROW_MULTIPLE` (zero rows,
    left out of every result; one padded copy for consecutive calls on the same input); not differentiable twice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[:-1].numel()
        with torch.autocast("cpu", enabled=False):
            padded, weight16 = _padded_input(x), weight.to(torch.bfloat16)
            out = F.linear(padded, weight16, None if bias is None else bias.to(torch.bfloat16))
        ctx.save_for_backward(padded, weight16)
        ctx.input_shape, ctx.input_dtype, ctx.has_bias = x.shape, x.dtype, bias is not None
        return out[:rows].view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        padded, weight16 = ctx.saved_tensors
        rows = ctx.input_shape[:-1].numel()
        grad_x = grad_weight = grad_bias = None
        with torch.autocast("cpu", enabled=False):
            grad = grad.reshape(rows, grad.shape[-1])
            padded_grad = _rows_padded(grad, torch.bfloat16)  # (M', N): zero rows, so g^T x sums the M rows alone
            if ctx.needs_input_grad[0]:
                grad_x = torch.mm(padded_grad, weight16)[:rows].view(ctx.input_shape).to(ctx.input_dtype)  # g W
            if ctx.needs_input_grad[1]:
                grad_weight = torch.mm(padded_grad.t(), padded).float()  # g^T x
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_bias = padded_grad.sum(0).float()
        return grad_x, grad_weight, grad_bias


class _OneDNNLinearFunction(torch.autograd.Function):
    """`F.linear` whose forward and backward products run in oneDNN; fp32, CPU; not differentiable twice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn_linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad = grad.reshape(-1, grad.shape[-1]).contiguous()  # (M, N)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn_linear(grad, weight.t()).view(x.shape)  # g W
        if ctx.needs_input_grad[1]:
            grad_weight = _onednn_grad_weight(x.reshape(-1, x.shape[-1]), grad)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return grad_x, grad_weight, grad_bias


def _eager_bf16_autocast_cpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """fp32 (or bf16) activations and an fp32 weight under CPU bf16 autocast, in eager mode."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and weight.dtype == torch.float32
            and torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing())


def _eager_fp32_cpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
            and not torch.jit.is_tracing())


# Outputs a stacked product computed ahead for the layers that follow it, each taken by that layer's next call on the
# same input; per thread, so that several threads may decode with one model.
_AHEAD = threading.local()


class OneDNNLinear(nn.Linear):
    """`nn.Linear` whose products run in oneDNN (or MKL) on a CPU, computing x W^T + b to fp32 rounding:

    - in an fp32 forward without autograd (a decoding step), with the weight packed by `pack_for_inference` (MKL's
      packed sgemm, else oneDNN's blocked layout; `packed_weight`, set by `fast_paths_vaswani.inference_fast_paths`):
      for the few rows of a decoding step, faster than torch's BLAS call. With `stacked` (a packed weight stacking
      this layer's and the next layers', their bias, those layers) one product computes all of them for the same
      input, as attention's W^Q, W^K and W^V (or W^K and W^V) read one input: the others' outputs wait for their own
      calls on that input;
    - in an fp32 training-mode forward with autograd, where `cpu_training_matmul()` chose oneDNN;
    - in a training-mode forward with autograd under CPU bf16 autocast (fp32 weights) where oneDNN multiplies bf16
      (`onednn_bf16`), as autocast computes it but on rows padded to `TRAINING_ROW_MULTIPLE` (`_Bf16LinearFunction`).

    Anything else (GPUs, bf16 weights or other autocast, compiled or traced graphs) runs `nn.Linear`'s forward.
    """

    packed_weight: torch.Tensor | None = None
    stacked: tuple | None = None

    def uses_packed(self, x: torch.Tensor) -> bool:
        return ((self.packed_weight is not None or self.stacked is not None) and not torch.is_grad_enabled()
                and _eager_fp32_cpu(x, self.weight))

    def trains_with_onednn(self, x: torch.Tensor) -> bool:
        return (self.training and torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
                and _eager_fp32_cpu(x, self.weight) and cpu_training_matmul() == "onednn")

    def trains_in_bf16(self, x: torch.Tensor) -> bool:
        return (self.training and torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
                and _eager_bf16_autocast_cpu(x, self.weight) and onednn_bf16())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ahead = getattr(_AHEAD, "outputs", None)
        waiting = ahead.pop(self, None) if ahead else None
        if waiting is not None and waiting[0] is x:
            return waiting[1]
        if self.uses_packed(x):
            if self.stacked is None:
                return packed_linear(x, self.packed_weight, self.bias)
            weight, bias, following = self.stacked
            outputs = packed_linear(x, weight, bias).split(self.out_features, dim=-1)
            if not hasattr(_AHEAD, "outputs"):
                _AHEAD.outputs = {}
            _AHEAD.outputs.update({layer: (x, output) for layer, output in zip(following, outputs[1:], strict=True)})
            return outputs[0]
        if self.trains_with_onednn(x):
            return _OneDNNLinearFunction.apply(x, self.weight, self.bias)
        if self.trains_in_bf16(x):
            return _Bf16LinearFunction.apply(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)



# The output projection and the loss of a CPU training step ------------------------------------------------------------


class _ProjectedCrossEntropy(torch.autograd.Function):
    """`cpu_projected_cross_entropy`'s forward and backward; fp32 or bf16 autocast, CPU, not differentiable twice."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, label_smoothing: float,
                divisor, bf16: bool) -> torch.Tensor:
        onednn = not bf16 and cpu_training_matmul() == "onednn"
        rows = hidden.shape[0]
        if bf16:  # autocast's products: bf16 operands and logits, the softmax and the loss in fp32
            with torch.autocast("cpu", enabled=False):  # rows padded: oneDNN's kernels for earlier row counts serve
                hidden = _rows_padded(hidden, torch.bfloat16) if onednn_bf16() else hidden.to(torch.bfloat16)
                weight = weight.to(torch.bfloat16)
                log_probs = torch.mm(hidden, weight.t()).float()  # (N', V) logits
        else:
            log_probs = _onednn_linear(hidden, weight) if onednn else torch.mm(hidden, weight.t())  # (N, V) logits
        # Rows are read whole before they are written: log-softmax in place, so the logits never take a second buffer.
        torch._log_softmax(log_probs, 1, False, out=log_probs)
        total = log_probs.gather(1, labels[:, None]).sum() * -(1.0 - label_smoothing)
        if label_smoothing:
            total = total - log_probs[:rows].sum() * (label_smoothing / log_probs.shape[1])
        ctx.save_for_backward(hidden, weight, labels, log_probs)
        ctx.label_smoothing, ctx.divisor, ctx.onednn, ctx.consumed = label_smoothing, divisor, onednn, False
        ctx.bf16, ctx.rows = bf16, rows
        return total / divisor

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        if ctx.consumed:
            raise RuntimeError(
                "The fused CPU loss (cpu_projected_cross_entropy) turned its saved log-probabilities into the softmax "
                "in place in the first backward pass, so it cannot run backward again (retain_graph=True). Compute "
                "the loss from the model's logits for steps that backpropagate twice.")
        hidden, weight, labels, log_probs = ctx.saved_tensors  # bf16: `hidden` and `log_probs` with padded rows
        epsilon, vocab, rows = ctx.label_smoothing, log_probs.shape[1], ctx.rows
        # d loss / d logits = scale * (softmax - (1 - eps) one_hot(label) - eps / V); the products take softmax alone
        # and the two other terms are added to their (N, D) and (V, D) results.
        scale = grad / ctx.divisor
        ctx.consumed = True
        probs = log_probs.exp_()  # in place: a new (N, V) buffer costs more than the exponentials themselves
        if ctx.bf16:  # the products in bf16 as autocast's backward takes them; the small corrections in fp32
            probs = probs.to(torch.bfloat16)  # its padded rows meet zero rows of `hidden` in g^T x
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = _onednn_linear(probs, weight.t()) if ctx.onednn else torch.mm(probs, weight)[:rows].float()
            grad_hidden.sub_(weight.index_select(0, labels).float(), alpha=1.0 - epsilon)
            if epsilon:
                grad_hidden.sub_(weight.sum(0, dtype=torch.float32), alpha=epsilon / vocab)
            grad_hidden.mul_(scale)
        if ctx.needs_input_grad[1]:
            grad_weight = _onednn_grad_weight(hidden, probs) if ctx.onednn else torch.mm(probs.t(), hidden).float()
            grad_weight.index_add_(0, labels, hidden[:rows].float(), alpha=-(1.0 - epsilon))
            if epsilon:
                grad_weight.sub_(hidden.sum(0, dtype=torch.float32), alpha=epsilon / vocab)  # padded rows are 0
            grad_weight.mul_(scale)
        return grad_hidden, grad_weight, None, None, None, None


def cpu_projected_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                label_smoothing: float = 0.0, divisor: int | torch.Tensor = 1) -> torch.Tensor | None:
    """The pre-softmax projection (§3.4) and the label-smoothed cross-entropy (§5.4) of a CPU training step, fused:
    `F.cross_entropy(hidden @ weight.T, labels, reduction="sum", label_smoothing=label_smoothing) / divisor`, which
    is `modeling_vaswani.cross_entropy_loss` on the labelled positions.

    `F.cross_entropy` on a projection's output writes three `(N, V)` tensors beside the logits: the log-probabilities,
    and in the backward pass a zero-filled gradient of them (with the labels scattered in) and the logits' gradient.
    Here the logits' own buffer is the only one: turned into log-probabilities in place, and in the backward pass into
    the softmax in place (label smoothing's uniform term and the one-hot term are applied to the products' small
    `(N, D)` and `(V, D)` results instead). So its backward runs once: a second one (retain_graph=True) raises
    RuntimeError. In fp32 the products run in `cpu_training_matmul()`'s library; under CPU bf16 autocast they take
    bf16 operands as autocast's `lm_head` and its backward would (the logits rounded to bf16, then the softmax and
    the loss in fp32 as `cross_entropy_loss` computes them, the softmax rounded to bf16 for the two backward products).

    Args:
        hidden: `(N, D)` fp32 (bf16 under autocast too) decoder states of the labelled positions only.
        weight: `(V, D)` fp32 projection (the shared embedding matrix).
        labels: `(N,)` int64 target ids in [0, V) (no -100: pass the labelled positions only).
        label_smoothing: epsilon in [0, 1); divisor: what the summed loss is divided by (a number or a 0-dim tensor).
    Returns:
        the scalar loss, or `None` where the fused path does not apply (not a CPU, autocast other than bf16 on the
        CPU, compiling or tracing): compute the loss from the logits then.
    """
    if hidden.dim() != 2:
        return None
    if _eager_fp32_cpu(hidden, weight):
        return _ProjectedCrossEntropy.apply(hidden, weight, labels, float(label_smoothing), divisor, False)
    if _eager_bf16_autocast_cpu(hidden, weight):
        return _ProjectedCrossEntropy.apply(hidden, weight, labels, float(label_smoothing), divisor, True)
    return None
