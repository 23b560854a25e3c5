"""CPU kernels of the Transformer in `modeling_vaswani.py`: faster paths that compute what the plain torch code computes.

- `CPUDropout`, `CPUDropoutAdd`: dropout (and dropout followed by the residual add) with a cheaper random mask
  (§5.4's dropout, same distribution, scale and gradient);
- `cpu_attention_forward`: Eq. 1 on a CPU for bf16/fp16 (scores in fp32) and for training with attention dropout;
- `VaswaniLinear`: `nn.Linear` that multiplies in oneDNN in fp32 CPU training where oneDNN is much faster than
  torch's BLAS (`cpu_training_matmul`), and with oneDNN-packed weights during CPU inference; `packed_cpu_linears`,
  the context that packs them (with the stacked q|k|v input projections) for `generate()`, keeping the packed
  copies for the next call while the weights stay unchanged;
- `VaswaniSelfAttentionCache`: the decoder self-attention cache, written in place into a preallocated buffer;
- `RealTokens`: CPU training runs the position-wise layers on the real (non-padding) tokens of a batch only;
- `cpu_projected_cross_entropy`: a CPU training step's output projection and label-smoothed loss in one function,
  without materializing anything of the `(N, V)` logits' size but one buffer.

Like `modeling_vaswani.py`, it imports only torch and transformers: transformers copies it beside the model code
(relative imports) for `trust_remote_code=True`.
"""

import contextlib
import functools
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer, EncoderDecoderCache
from transformers.utils import logging

logger = logging.get_logger(__name__)


def _dropout_keep_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """A bool mask of `x`'s shape, each element True (kept) with probability 1 - p to within 2^-17.

    torch's CPU `bernoulli_` spends about 6 ns per element; here one 64-bit random draw decides four elements: an
    element is kept when its 16-bit quarter is at least -2^15 + round(p * 2^16) (for p = 0.1: kept with probability
    0.899994). For 1,827 x 512 elements on a 2-core Xeon: 1.2 ms, against 2.3 ms with a 32-bit threshold per element
    and 6.4 ms for `bernoulli_`."""
    numel = x.numel()
    bits = torch.empty((numel + 3) // 4, dtype=torch.int64, device=x.device).random_(-(2**63), None)
    return bits.view(torch.int16)[:numel].view(x.shape) >= -(2**15) + round(p * 2**16)


class CPUDropout(torch.autograd.Function):
    """Inverted dropout (§5.4) whose random mask costs a fifth of `F.dropout`'s on a CPU (`_dropout_keep_mask`).

    Kept elements are scaled by 1 / (1 - p), as `F.dropout` does; the backward pass applies the same mask and scale.
    The mask is kept for the backward pass as 1 byte per element (`F.dropout` keeps a 4-byte one).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        keep = _dropout_keep_mask(x, p)
        ctx.scale = 1.0 / (1.0 - p)
        ctx.save_for_backward(keep)
        return torch.where(keep, x * ctx.scale, 0.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (keep,) = ctx.saved_tensors
        return torch.where(keep, grad * ctx.scale, 0.0), None


class CPUDropoutAdd(torch.autograd.Function):
    """`residual + CPUDropout(x, p)` (§5.4's residual dropout, then §3.1's residual connection) in two passes over
    memory where the two operations take four: the kept elements of x are selected, then added to the residual with
    the scale 1 / (1 - p) as the sum's factor. `residual` and `x` have the same shape; the result has their promoted
    dtype. Backward: the residual's gradient is the incoming one, x's is it under the mask, times the scale."""

    @staticmethod
    def forward(ctx, residual: torch.Tensor, x: torch.Tensor, p: float) -> torch.Tensor:
        keep = _dropout_keep_mask(x, p)
        ctx.scale = 1.0 / (1.0 - p)
        ctx.save_for_backward(keep)
        kept = torch.where(keep, x, 0.0)
        if kept.dtype == torch.result_type(residual, kept):
            return torch.add(residual, kept, alpha=ctx.scale, out=kept)  # in place of the selection: no allocation
        return torch.add(residual, kept, alpha=ctx.scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (keep,) = ctx.saved_tensors
        grad_x = torch.where(keep, grad, 0.0).mul_(ctx.scale) if ctx.needs_input_grad[1] else None
        return grad, grad_x, None


def cpu_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                                         value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float,
                                         dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """Eq. 1 on a CPU where "sdpa" would run torch's CPU flash-attention kernel slowly: in bf16/fp16 (about 4x the
    time of this at B=64, H=8, T=32 on an AVX512-BF16 CPU), and in training steps with attention dropout (not the
    paper's; `CPUDropout` draws the mask). Q K^T, the mask and the softmax in fp32 (autocast off: the scores are
    not rounded to 8 bits of mantissa before the softmax), the product with V in the inputs' precision. Shapes as
    `eager_attention_forward`; returns the output `(B, Tq, H, Dh)` and no probabilities."""
    with torch.autocast(query.device.type, enabled=False):
        scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling  # (B, H, Tq, Tk)
        if attention_mask is not None:
            scores = scores + attention_mask.float()
        probs = F.softmax(scores, dim=-1)
    probs = probs.to(value.dtype)
    if module.training and dropout > 0.0:  # as modeling_vaswani.apply_dropout
        probs = CPUDropout.apply(probs, dropout) if 0.0 < dropout < 1.0 and not torch.compiler.is_compiling() \
            else F.dropout(probs, p=dropout, training=True)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


@functools.cache
def has_onednn_linear() -> bool:
    """Whether this torch has oneDNN and the two operators of `VaswaniLinear`'s CPU path (torch >= 2.0 builds)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                    and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b with oneDNN: `(M, K)` x `(N, K)` (either may be a transposed view) -> `(M, N)`, fp32 on a CPU."""
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

    MKL runs its AVX2 code on non-Intel CPUs, so on CPUs whose AVX-512 units are full width (AMD Zen 5) oneDNN's
    AVX-512 code multiplies about twice as fast (2 cores, base-model shapes: 450-500 against 220-230 GFLOP/s); on
    Intel CPUs and on AVX2 CPUs the two are within about 10 % of each other. So this is decided by measuring, once
    per process: the three products of a linear's training step (forward x W^T, input gradient g W, weight
    gradient g^T x; 512 rows, 512 -> 1024 features) with both, best of 5 each (about 0.1 s); oneDNN is chosen only
    when it takes at most 1/1.3 of BLAS's time, so noise cannot flip the choice where the two are close. The
    environment variable `VASWANI_CPU_MATMUL` = `onednn` or `blas` overrides the measurement (`auto`, the default,
    measures). Results agree to fp32 rounding either way.
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
    projection, in 512, out 8000: 35 against 64 ms on 1,827 rows)."""
    (rows, in_features), out_features = x.shape, grad.shape[1]
    if in_features * (rows + out_features) < out_features * rows:
        return _onednn_linear(x.t(), grad.t()).t().contiguous()
    return _onednn_linear(grad.t(), x.t())


class _OneDNNLinear(torch.autograd.Function):
    """`F.linear` whose forward and backward products run in oneDNN (`cpu_training_matmul`); fp32, CPU. Its backward
    pass is not differentiable again (no double backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        flat = x.reshape(-1, x.shape[-1])
        return _onednn_linear(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])

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


class VaswaniLinear(nn.Linear):
    """`nn.Linear`, with faster paths on a CPU. `(..., in_features)` -> `(..., out_features)`.

    - Training: an fp32 training-mode forward with autograd on a CPU, without autocast, multiplies with oneDNN, forward
      and backward, where `cpu_training_matmul()` found oneDNN much faster than torch's BLAS on this CPU (about 2x on
      AMD Zen 5); elsewhere it is `nn.Linear`'s.
    - Inference: while `packed_weight` holds the weight in oneDNN's blocked layout (`generate()` packs it for the
      duration of the call: `VaswaniForConditionalGeneration.cpu_packed_linears`), an fp32 forward on a CPU without
      autograd and without autocast multiplies with oneDNN. For the few rows of a decoding step (64 rows, d_model
      512) that is 25-40 % faster than torch's default BLAS call even on an AMD EPYC where the two libraries are
      within 14 % of each other at training sizes.

    Results agree with `nn.Linear`'s to fp32 rounding. GPUs, bf16 and `torch.compile`d or exported graphs always take
    `nn.Linear`'s path.
    """

    packed_weight: torch.Tensor | None = None

    def trains_with_onednn(self, x: torch.Tensor) -> bool:
        """Whether `forward(x)` takes the oneDNN training path."""
        return (self.training and torch.is_grad_enabled() and x.device.type == "cpu" and x.dtype == torch.float32
                and self.weight.dtype == torch.float32 and (x.requires_grad or self.weight.requires_grad)
                and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
                and not torch.jit.is_tracing() and cpu_training_matmul() == "onednn")

    def uses_packed(self, x: torch.Tensor) -> bool:
        """Whether `forward(x)` takes the oneDNN path."""
        return (self.packed_weight is not None and x.dtype == torch.float32 and x.device.type == "cpu"
                and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
                and not torch.compiler.is_compiling())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_packed(x):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        if self.trains_with_onednn(x):
            return _OneDNNLinear.apply(x, self.weight, self.bias)
        return super().forward(x)


# The output projection and the loss of a CPU training step ------------------------------------------------------------


class _ProjectedCrossEntropy(torch.autograd.Function):
    """`cpu_projected_cross_entropy`'s forward and backward; fp32, CPU, not differentiable twice."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, label_smoothing: float,
                divisor) -> torch.Tensor:
        onednn = cpu_training_matmul() == "onednn"
        log_probs = _onednn_linear(hidden, weight) if onednn else torch.mm(hidden, weight.t())  # (N, V) logits
        # Rows are read whole before they are written: log-softmax in place, so the logits never take a second buffer.
        torch._log_softmax(log_probs, 1, False, out=log_probs)
        total = log_probs.gather(1, labels[:, None]).sum() * -(1.0 - label_smoothing)
        if label_smoothing:
            total = total - log_probs.sum() * (label_smoothing / log_probs.shape[1])
        ctx.save_for_backward(hidden, weight, labels, log_probs)
        ctx.label_smoothing, ctx.divisor, ctx.onednn, ctx.consumed = label_smoothing, divisor, onednn, False
        return total / divisor

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        if ctx.consumed:
            raise RuntimeError(
                "The fused CPU loss (cpu_projected_cross_entropy) turned its saved log-probabilities into the softmax "
                "in place in the first backward pass, so it cannot run backward again (retain_graph=True). Call the "
                "model with skip_logits=False for steps that backpropagate twice.")
        hidden, weight, labels, log_probs = ctx.saved_tensors
        epsilon, vocab = ctx.label_smoothing, log_probs.shape[1]
        # d loss / d logits = scale * (softmax - (1 - eps) one_hot(label) - eps / V); the products take softmax alone
        # and the two other terms are added to their (N, D) and (V, D) results.
        scale = grad / ctx.divisor
        ctx.consumed = True
        probs = log_probs.exp_()  # in place: a new (N, V) buffer costs more than the exponentials themselves
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = _onednn_linear(probs, weight.t()) if ctx.onednn else torch.mm(probs, weight)
            grad_hidden.sub_(weight.index_select(0, labels), alpha=1.0 - epsilon)
            if epsilon:
                grad_hidden.sub_(weight.sum(0), alpha=epsilon / vocab)
            grad_hidden.mul_(scale)
        if ctx.needs_input_grad[1]:
            grad_weight = _onednn_grad_weight(hidden, probs) if ctx.onednn else torch.mm(probs.t(), hidden)
            grad_weight.index_add_(0, labels, hidden, alpha=-(1.0 - epsilon))
            if epsilon:
                grad_weight.sub_(hidden.sum(0), alpha=epsilon / vocab)
            grad_weight.mul_(scale)
        return grad_hidden, grad_weight, None, None, None


def cpu_projected_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                                label_smoothing: float = 0.0, divisor: int | torch.Tensor = 1) -> torch.Tensor | None:
    """The pre-softmax projection (§3.4) and the label-smoothed cross-entropy (§5.4) of a CPU training step, fused:
    `F.cross_entropy(hidden @ weight.T, labels, reduction="sum", label_smoothing=label_smoothing) / divisor`.

    `F.cross_entropy` on a projection's output writes three `(N, V)` tensors beside the logits: the log-probabilities,
    and in the backward pass a zero-filled gradient of them (with the labels scattered in) and the logits' gradient.
    Here the logits' own buffer is the only one: turned into log-probabilities in place, and in the backward pass into
    the softmax in place (label smoothing's uniform term and the one-hot term are applied to the products' small
    `(N, D)` and `(V, D)` results instead). So its backward runs once: a second one (retain_graph=True) raises
    RuntimeError. The products run in `cpu_training_matmul()`'s library, as `VaswaniLinear`'s. Output projection and
    label-smoothed loss, forward and backward, 1,827 rows -> 8,000 on the 2-core Xeon of the README: 168.9 against
    180.5 ms at d_model 512, 94.4 against 108.2 ms at 256.

    Args:
        hidden: `(N, D)` fp32 decoder states of the labelled positions only.
        weight: `(V, D)` fp32 projection (the shared embedding matrix).
        labels: `(N,)` int64 target ids in [0, V) (no -100: pass the labelled positions only).
        label_smoothing: epsilon in [0, 1); divisor: what the summed loss is divided by (a number or a 0-dim tensor).
    Returns:
        the scalar loss, or `None` where the fused path does not apply (not a CPU, not fp32, autocast on, compiling or
        tracing): compute the loss from the logits then.
    """
    if (hidden.device.type != "cpu" or hidden.dtype != torch.float32 or weight.dtype != torch.float32
            or hidden.dim() != 2 or torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling()
            or torch.jit.is_tracing()):
        return None
    return _ProjectedCrossEntropy.apply(hidden, weight, labels, float(label_smoothing), divisor)


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


def _packing_key(linears: list, fused: dict) -> tuple:
    """What packed weights depend on: each weight and bias (identity, storage, version counter, and a sum over a
    strided sample of its values) and which projections are stacked. The sample is needed because not every in-place
    update advances the version counter: torch's fused Adam (`Adam(fused=True)`) writes the parameters without it,
    so a key of identity and version alone would keep weights packed before the optimizer step."""

    def state(tensor):
        if tensor is None:
            return None
        sample = float(tensor.detach().reshape(-1)[::97].double().sum())  # ~1 % of the values, every row touched
        return (id(tensor), tensor.data_ptr(), tensor._version, tuple(tensor.shape), sample)

    parts = [(id(module), state(module.weight), state(module.bias)) for module in linears]
    for attention, group in fused.items():
        parts.append((id(attention),) + tuple((id(p), state(p.weight), state(p.bias)) for p in group))
    return tuple(parts)


@contextlib.contextmanager
def packed_cpu_linears(model: nn.Module, attention_class: type, input_projection_class: type):
    """The body of `VaswaniForConditionalGeneration.cpu_packed_linears` (see there); `attention_class` and
    `input_projection_class` are the model's attention and input projection types."""
    linears = [module for module in model.modules() if isinstance(module, VaswaniLinear)]
    wanted = (model.use_cpu_packed_linears and has_onednn_linear() and linears
              and all(m.weight.device.type == "cpu" and m.weight.dtype == torch.float32 for m in linears)
              and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
              and all(m.packed_weight is None for m in linears))
    if not wanted:
        yield False
        return
    fused = {}  # attention -> its stacked input projections
    for module in model.modules():
        if isinstance(module, attention_class):
            group = (module.k_proj, module.v_proj) if module.is_cross_attention else \
                (module.q_proj, module.k_proj, module.v_proj)
            if all(type(projection) is input_projection_class for projection in group):
                fused[module] = group
    covered = {id(projection) for group in fused.values() for projection in group}
    linears = [module for module in linears if id(module) not in covered]
    key = _packing_key(linears, fused)
    keep = getattr(model, "keep_packed_cpu_linears", False)
    kept = model.__dict__.get("_packed_cpu_linears") if keep else model.__dict__.pop("_packed_cpu_linears", None)
    if keep and kept is not None and kept[0] == key:  # the same weights, unchanged since they were packed
        linears, packed, stacked = list(kept[1]), list(kept[2]), dict(kept[3])
    else:
        model.__dict__.pop("_packed_cpu_linears", None)
        try:
            with torch.no_grad():
                stacked = {}
                for attention, group in fused.items():
                    linear = VaswaniLinear(model.config.d_model, len(group) * model.config.d_model, device="meta")
                    linear.weight = nn.Parameter(torch.cat([p.weight.detach() for p in group]), requires_grad=False)
                    linear.bias = nn.Parameter(torch.cat([p.bias.detach() for p in group]), requires_grad=False)
                    stacked[attention] = linear
                linears += list(stacked.values())
                packed = [torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), 64) for module in linears]
        except RuntimeError as error:  # a torch build whose oneDNN cannot pack these weights: the plain path
            logger.warning_once(f"generate(): oneDNN weight packing failed ({error}); using nn.Linear.")
            yield False
            return
        if keep:
            model.__dict__["_packed_cpu_linears"] = (key, tuple(linears), tuple(packed), dict(stacked))
    for module, weight in zip(linears, packed, strict=True):
        module.packed_weight = weight
    for attention, linear in stacked.items():
        attention.__dict__["fused_inputs"] = linear  # a plain attribute: not a submodule, never in state_dict
    try:
        yield True
    finally:
        for module in linears:
            module.packed_weight = None
        for attention in stacked:
            attention.__dict__.pop("fused_inputs", None)


# Training without computing on padding --------------------------------------------------------------------------------


class RealTokens:
    """The real positions of a padded `(B, L)` batch, so that a CPU training step skips the padding.

    Everything in a layer but attention is position-wise (the projections, the FFN, LayerNorm, dropout, the residual
    adds), so it can run on the real tokens alone, packed as `(N, D)`, N the number of real positions: a
    length-bucketed batch of Multi30k sentences is 10-15 % padding, and a step's matrix products shrink by as much.
    Attention still runs on the padded `(B, L)` layout (`pad` before it, `pack` after it) with the usual masks.

    What runs on which positions: the encoder keeps the positions its `attention_mask` marks 1; no real position
    ever reads a padded one (they are masked as keys). The decoder keeps, in each row, the positions up to the last
    one with a label (`labels != -100`): a causal decoder never lets a position read later ones, so the kept
    positions compute exactly what they compute in the padded batch. Padded positions' outputs (encoder states,
    decoder states and logits) are then zeros instead of values nothing uses.

    Used by `modeling_vaswani.py` only in training mode on a CPU in eager mode, without attention probabilities or
    hidden states asked for, and only when the batch has padding and every row keeps at least one position (a
    fully padded source row falls back to the padded layout, which defines what it attends to); `RealTokens.enabled
    = False` turns it off. Finding the real positions reads the mask (a host sync on a GPU, a data-dependent shape
    under `torch.compile` or export), which is why GPUs, compiled and exported graphs keep the padded layout.
    """

    enabled = True

    def __init__(self, keep: torch.Tensor):
        self.batch, self.length = keep.shape
        flat = keep.reshape(-1)
        self.index = flat.nonzero().squeeze(1)  # (N,) positions in the flattened (B * L) layout
        self.left_out = (~flat).nonzero().squeeze(1)

    @classmethod
    def of(cls, keep: torch.Tensor | None, module: nn.Module, keep_all: bool = False) -> "RealTokens | None":
        """`RealTokens` for the `(B, L)` mask `keep` (nonzero: real) when `module` trains on a CPU in eager mode and
        packing leaves something out (or, with `keep_all`, also when it leaves nothing out); else `None` (the padded
        layout)."""
        if (not cls.enabled or keep is None or keep.dim() != 2 or not module.training
                or keep.device.type != "cpu" or torch.compiler.is_compiling() or torch.jit.is_tracing()):
            return None
        keep = keep.bool()
        if (bool(keep.all()) and not keep_all) or not bool(keep.any(1).all()):
            return None
        return cls(keep)

    @classmethod
    def of_labels(cls, labels: torch.Tensor | None, module: nn.Module) -> "RealTokens | None":
        """`of` for a decoder trained on `labels` `(B, T)`: each row keeps its positions up to its last label."""
        if labels is None or labels.dim() != 2 or labels.device.type != "cpu":
            return None
        return cls.of(labels.ne(-100).flip(1).cumsum(1).flip(1) > 0, module)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """`(B, L, ...)` -> `(N, ...)`: the real positions, in order."""
        return _Pack.apply(x.reshape(self.batch * self.length, *x.shape[2:]), self).view(-1, *x.shape[2:])

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """`(N, ...)` -> `(B, L, ...)`, zeros at the left-out positions."""
        return _Pad.apply(x, self).view(self.batch, self.length, *x.shape[1:])

    def _scatter(self, x: torch.Tensor) -> torch.Tensor:
        """`(N, ...)` -> `(B * L, ...)` with zeros elsewhere, writing each element once."""
        full = x.new_empty(self.batch * self.length, *x.shape[1:])
        return full.index_fill_(0, self.left_out, 0.0).index_copy_(0, self.index, x)


class _Pack(torch.autograd.Function):
    """`RealTokens.pack` on `(B * L, ...)`; its gradient is `pad`'s forward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tokens: RealTokens) -> torch.Tensor:
        ctx.tokens = tokens
        return x.index_select(0, tokens.index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.tokens._scatter(grad.contiguous()), None


class _Pad(torch.autograd.Function):
    """`RealTokens.pad` to `(B * L, ...)`; its gradient is `pack`'s forward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tokens: RealTokens) -> torch.Tensor:
        ctx.tokens = tokens
        return tokens._scatter(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.reshape(grad.shape[0], -1).index_select(0, ctx.tokens.index).view(-1, *grad.shape[1:]), None


# Beam search without the sentences it has finished ---------------------------------------------------------------------


class FinishedSentenceSkipping:
    """Beam search state that lets decoding steps leave out the sentences beam search has finished.

    transformers' beam search keeps every sentence of the batch in every step until the last one is done; the steps of
    a finished sentence change nothing it returns (with `early_stopping=True`, or once no hypothesis can improve on
    its finished ones, every new candidate of the sentence is scored -1e9 below its finished hypotheses). So after the
    step in which a sentence finishes, its rows leave the decoder's batch, as CTranslate2 does: the self-attention
    cache keeps only the rows of the open sentences (the beam reorder gathers exactly those), the encoder-decoder
    cache, encoder output and source mask only their sentences, and the finished rows' logits are zeros (finite; never
    used). The first step, where the beams of a sentence hold the same start token, runs once per sentence (as
    CTranslate2 does) and its cache and logits are repeated for the beams. Used only where nothing of a finished sentence's later steps is returned: no scores, logits, attentions or
    hidden states asked for, no sampling, our self-attention cache.

    Args:
        batch: sentences; beams: rows per sentence.
    """

    def __init__(self, batch: int, beams: int, device: torch.device):
        self.batch, self.beams, self.device = batch, beams, device
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
