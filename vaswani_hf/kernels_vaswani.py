"""CPU kernels of the Transformer in `modeling_vaswani.py`: faster paths that compute what plain torch code computes.

- `CPUDropout`, `CPUDropoutAdd`: dropout (and dropout followed by the residual add) with a cheaper random mask
  (§5.4's dropout, same distribution, scale and gradient);
- `cpu_attention_forward`: Eq. 1 on a CPU for bf16/fp16 (scores in fp32) and for training with attention dropout;
- `linear`: the model's linear layers (plain `nn.Linear`s, so that torch's quantization finds them) multiply in
  oneDNN in fp32 CPU training where oneDNN is much faster than torch's BLAS (`cpu_training_matmul`, which measures
  once which library is faster), and with oneDNN-packed weights during CPU inference; `packed_cpu_linears`, the
  context that packs them (with the stacked q|k|v input projections) for `generate()`, keeping the packed copies for
  the next call while the weights stay unchanged;
- `RealTokens`: CPU training runs the position-wise layers on the real (non-padding) tokens of a batch only;
- `cpu_projected_cross_entropy`: a CPU training step's output projection and label-smoothed loss in one function,
  without materializing anything of the `(N, V)` logits' size but one buffer.

The KV cache and beam search's bookkeeping live in `generation_vaswani.py`. Like the model files, it imports only torch
and transformers: transformers copies it beside the model code (relative imports) for `trust_remote_code=True`.
"""

import contextlib
import functools
import os
import time

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import logging

logger = logging.get_logger(__name__)


def _dropout_keep_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """A bool mask of `x`'s shape, each element True (kept) with probability 1 - p to within 2^-17.

    torch's CPU `bernoulli_` spends about 6 ns per element; here one 64-bit random draw decides four elements: an
    element is kept when its 16-bit quarter is at least -2^15 + round(p * 2^16) (for p = 0.1: kept with probability
    0.899994), a fraction of `bernoulli_`'s time and half that of a 32-bit threshold per element
    (benchmarks/bench_dropout.py)."""
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


def cpu_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """Eq. 1 on a CPU where "sdpa" would run torch's CPU flash-attention kernel slowly: in bf16/fp16 (several times
    this one's time, benchmarks/bench_training_paths.py), and in training steps with attention dropout (not the
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
    """Whether this torch has oneDNN and the two operators of `linear`'s CPU paths (torch >= 2.0 builds)."""
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

    MKL runs its AVX2 code on non-Intel CPUs, so where AVX-512 units are full width oneDNN's AVX-512 code can multiply
    much faster at base-model shapes; elsewhere the two are close (benchmarks/benchmark.py reports both peaks).
    So this is decided by measuring, once
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
    projection, 512 -> 8,000, in about half the time)."""
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


def trains_with_onednn(module: nn.Linear, x: torch.Tensor) -> bool:
    """Whether `linear(module, x)` takes the oneDNN training path: an fp32 training-mode forward with autograd on a
    CPU, without autocast, compiling or tracing, where `cpu_training_matmul()` chose oneDNN."""
    return (module.training and torch.is_grad_enabled() and x.device.type == "cpu" and x.dtype == torch.float32
            and module.weight.dtype == torch.float32 and (x.requires_grad or module.weight.requires_grad)
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
            and not torch.jit.is_tracing() and cpu_training_matmul() == "onednn")


def uses_packed(module: nn.Linear, x: torch.Tensor) -> bool:
    """Whether `linear(module, x)` multiplies with the oneDNN-packed weight: one is packed (`packed_cpu_linears`), and
    `x` is an fp32 CPU input without autograd, autocast or compiling."""
    return (getattr(module, "packed_weight", None) is not None and x.dtype == torch.float32
            and x.device.type == "cpu" and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling())


def _fast_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor | None:
    """x W^T + b by one of the CPU fast paths, or `None` where none applies."""
    if uses_packed(module, x):
        return torch.ops.mkldnn._linear_pointwise(x, module.packed_weight, module.bias, "none", [], "")
    if trains_with_onednn(module, x):
        return _OneDNNLinear.apply(x, module.weight, module.bias)
    return None


def _global_hooks() -> bool:
    """Whether forward hooks are registered for every module (`nn.modules.module.register_module_forward_hook`)."""
    hooks = nn.modules.module
    return bool(getattr(hooks, "_global_forward_hooks", None) or getattr(hooks, "_global_forward_pre_hooks", None))


def is_plain_linear(module: nn.Module) -> bool:
    """Whether `module` is an `nn.Linear` itself, computing x W^T + b and nothing else: not a subclass (a quantized,
    parametrized or PEFT-wrapped layer has its own type), no forward replaced on the instance (accelerate's offload)
    and no forward hooks."""
    return (type(module) is nn.Linear and "forward" not in module.__dict__ and not module._forward_hooks
            and not module._forward_pre_hooks and not _global_hooks())


def new_linear(in_features: int, out_features: int, bias: bool = True) -> nn.Linear:
    """The model's linear layers: a plain `nn.Linear` (torch's dynamic quantization, which matches exact types, then
    finds every one), run through `linear()`; `packed_weight` is `None` until `packed_cpu_linears` packs it."""
    module = nn.Linear(in_features, out_features, bias=bias)
    module.packed_weight = None
    return module


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` for a linear layer of the model, `(..., in_features)` -> `(..., out_features)`, with faster paths
    on a CPU for a plain `nn.Linear` (`is_plain_linear`):

    - Training: an fp32 training-mode forward with autograd on a CPU, without autocast, multiplies with oneDNN, forward
      and backward, where `cpu_training_matmul()` found oneDNN much faster than torch's BLAS on this CPU.
    - Inference: while `module.packed_weight` holds the weight in oneDNN's blocked layout (`generate()` packs it for
      the duration of the call: `VaswaniGenerationMixin.cpu_packed_linears`), an fp32 forward on a CPU without
      autograd and without autocast multiplies with oneDNN: for the few rows of a decoding step, prepacked weights
      are faster than torch's default BLAS call even where the two libraries are close at training sizes.

    Results agree with `nn.Linear`'s to fp32 rounding. Any other module (quantized, wrapped by an adapter, hooked),
    GPUs, bf16 and `torch.compile`d or exported graphs run `module(x)`.
    """
    if is_plain_linear(module):
        output = _fast_linear(module, x)
        if output is not None:
            return output
    return module(x)


class VaswaniLinear(nn.Linear):
    """`nn.Linear` with `linear()`'s CPU fast paths as its own forward, for a linear layer outside the model (the
    stacked input projections `packed_cpu_linears` packs). The model's own layers are plain `nn.Linear`s
    (`new_linear`), so that torch's quantization and other tools that match exact types find them."""

    packed_weight: torch.Tensor | None = None

    def trains_with_onednn(self, x: torch.Tensor) -> bool:
        """Whether `forward(x)` takes the oneDNN training path (`trains_with_onednn`)."""
        return trains_with_onednn(self, x)

    def uses_packed(self, x: torch.Tensor) -> bool:
        """Whether `forward(x)` takes the oneDNN path with the packed weight (`uses_packed`)."""
        return uses_packed(self, x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = _fast_linear(self, x)
        return output if output is not None else super().forward(x)


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
    RuntimeError. The products run in `cpu_training_matmul()`'s library, as `linear`'s
    (benchmarks/bench_training_paths.py compares it with the unfused projection and loss).

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


# Packed weights for inference ---------------------------------------------------------------------------------------


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


# The names of the linear layers the model runs through `linear()` (modeling_vaswani.py).
_MODEL_LINEARS = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2", "lm_head")


@contextlib.contextmanager
def packed_cpu_linears(model: nn.Module):
    """The body of `VaswaniGenerationMixin.cpu_packed_linears` (see there). The attentions whose input projections
    are stacked are the modules whose class declares `fused_inputs` (`VaswaniAttention`). Packed are the model's
    plain linear layers that it runs through `linear()` (`_MODEL_LINEARS`), not those inside another module (the
    base layer or the matrices of a PEFT adapter, which that module runs itself)."""
    linears = [module for name, module in model.named_modules()
               if name.rpartition(".")[2] in _MODEL_LINEARS and is_plain_linear(module)]
    wanted = (model.use_cpu_packed_linears and has_onednn_linear() and linears
              and all(m.weight.device.type == "cpu" and m.weight.dtype == torch.float32 for m in linears)
              and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
              and all(getattr(m, "packed_weight", None) is None for m in linears))
    if not wanted:
        yield False
        return
    fused = {}  # attention -> its stacked input projections
    for module in model.modules():
        if hasattr(type(module), "fused_inputs"):
            group = (module.k_proj, module.v_proj) if module.is_cross_attention else \
                (module.q_proj, module.k_proj, module.v_proj)
            if all(is_plain_linear(projection) for projection in group):
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
