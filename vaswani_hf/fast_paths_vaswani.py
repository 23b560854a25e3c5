"""How kernels_vaswani.py's CPU fast paths are installed from outside the model, and undone:

- every `generate()` call (`VaswaniGenerationMixin`) runs inside `inference_fast_paths`: attention "sdpa" runs as
  "vaswani_sdpa" (a sentence's beams against one encoder row), and on a CPU in fp32 the model's linear layers become
  `OneDNNLinear`s with weights packed at the start of the call (MKL's packed sgemm, else oneDNN's layout);
- the training commands (their trainer and their loop) run inside `training_fast_paths` for the whole run: the
  model's `forward` trains on the label-smoothed loss of §5.4 (`training_forward`: on a CPU on the unpadded tokens of
  the batch and with the fused output projection and loss), and on a CPU dropout becomes `CPUDropout`, the linears
  `OneDNNLinear`s (multiplying in oneDNN where `cpu_training_matmul` chose it) and attention "vaswani_sdpa".

Modules are swapped in place by class, as `torch.nn.utils.parametrize` does: parameters, names, hooks and optimizer
state stay as they are. Only the model's own plain `nn.Linear`s and `nn.Dropout`s are swapped, not those inside
another module (a PEFT adapter keeps its own forward) nor hooked ones. An installation is shared by the calls that
overlap (several threads decoding with one model, a validation's `generate()` inside training) and undone by the last
one to finish, so that a model outside them is made of plain modules.

It imports only torch, transformers and the model's other files: transformers copies it beside the model code
(relative imports) for `trust_remote_code=True`.
"""

import contextlib
import functools
import threading

import torch
from torch import nn
from transformers.modeling_outputs import Seq2SeqLMOutput
from transformers.utils import logging

from .kernels_vaswani import (
    CPUDropout,
    OneDNNLinear,
    cpu_projected_cross_entropy,
    has_mkl_packed_linear,
    has_onednn_linear,
    pack_for_inference,
    unpad_batch,
)

logger = logging.get_logger(__name__)

_LOCK = threading.Lock()
_INSTALLED: dict[tuple[int, str], list] = {}  # (id(model), what) -> [users, undo]


@contextlib.contextmanager
def _installed(model: nn.Module, what: str, install):
    """`install()` (which returns its undo) on entry unless it is in force already; undone when its last user exits,
    so that calls on one model from several threads, and nested calls, install once."""
    key = (id(model), what)
    with _LOCK:
        entry = _INSTALLED.get(key)
        if entry is None:
            entry = _INSTALLED[key] = [0, install()]
        entry[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                del _INSTALLED[key]
                entry[1]()


def _undo_all(*steps) -> None:
    """Run each undo step; one that an interrupt (Ctrl-C) stops part of the way is run again (every step is
    idempotent: classes set, attributes removed), and the interrupt is raised once all have run, so that the model is
    left as it was whatever arrives when."""
    error = None
    for step in steps:
        for _ in range(3):  # a step that fails three times is not being interrupted: its error is raised
            try:
                step()
                break
            except BaseException as caught:  # noqa: BLE001 - re-raised below, once the model is whole again
                error = error or caught
    if error is not None:
        raise error


def _plain(module: nn.Module) -> bool:
    """No forward hooks (its own or global ones) and no forward replaced on the instance (accelerate's offload)."""
    hooks = nn.modules.module
    return not (module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__
                or getattr(hooks, "_global_forward_hooks", None) or getattr(hooks, "_global_forward_pre_hooks", None))


def own_modules(model: nn.Module, kind: type) -> list[nn.Module]:
    """The plain (`_plain`) modules of exactly type `kind` that the model's own classes hold; not those inside another
    module (a PEFT adapter's layers, which that module runs itself)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    home = type(base).__module__
    return [child for parent in base.modules() if type(parent).__module__ == home for child in parent.children()
            if type(child) is kind and _plain(child)]


def _swap(modules: list[nn.Module], cls: type) -> list[nn.Module]:
    for module in modules:
        module.__class__ = cls
    return modules


def _attention(model: nn.Module):
    """"vaswani_sdpa" in place of "sdpa"; returns the undo."""
    config = model.config
    if config._attn_implementation != "sdpa":
        return lambda: None
    config._attn_implementation = "vaswani_sdpa"

    def undo():
        _undo_all(lambda: setattr(config, "_attn_implementation", "sdpa"))
    return undo


def _packed(layers: list[nn.Linear]) -> tuple[tuple, torch.Tensor | None]:
    """The weights of `layers` stacked (one layer: its own) and packed (`pack_for_inference`), and their bias (one
    layer: its own; several: stacked, or None where one has none); packed anew for every call, from the weights as
    they are (no check that a kept copy is still right could be exact for less than the packing costs: a write
    through `.data`, or torch's fused Adam, leaves the version counter as it was)."""
    if len(layers) == 1:
        return pack_for_inference(layers[0].weight.detach()), layers[0].bias
    biases = [layer.bias for layer in layers]
    bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
    return pack_for_inference(torch.cat([layer.weight.detach() for layer in layers])), bias


def _stacks(model: nn.Module, linears: list[nn.Linear]) -> dict[nn.Linear, list[nn.Linear]]:
    """The input projections one product can compute together: W^Q, W^K, W^V of each self-attention, W^K and W^V of
    each encoder-decoder attention (§3.2.2), keyed by the first, where all are among `linears`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    ours = set(linears)
    stacks = {}
    for module in base.modules():
        if hasattr(module, "is_cross_attention") and hasattr(module, "q_proj"):
            group = [module.k_proj, module.v_proj] if module.is_cross_attention else \
                [module.q_proj, module.k_proj, module.v_proj]
            if all(layer in ours for layer in group):
                stacks[group[0]] = group
    return stacks


@contextlib.contextmanager
def inference_fast_paths(model: nn.Module, packed_linears: bool = True):
    """`generate()`'s fast paths for one call: attention "sdpa" runs as "vaswani_sdpa", and, with `packed_linears`,
    for an fp32 model on a CPU without autocast, the model's linears multiply with packed weights
    (`OneDNNLinear`), the input projections that read one input stacked into one product. The weights are packed at
    the start of the call from the weights as they are (a packed copy of each, as much memory again, and the stacked
    input projections' weights once more, freed at its end).
    Undone on exit."""
    def install():
        plain, swapped = own_modules(model, nn.Linear), own_modules(model, OneDNNLinear)  # the latter: in training
        linears = plain + swapped
        wanted = (packed_linears and (has_mkl_packed_linear() or has_onednn_linear()) and linears
                  and not torch.is_autocast_enabled("cpu")
                  and all(m.weight.device.type == "cpu" and m.weight.dtype == torch.float32 for m in linears))
        stacks = _stacks(model, linears) if wanted else {}
        following = {layer for group in stacks.values() for layer in group[1:]}  # computed by their stack
        alone = [module for module in linears if module not in stacks and module not in following]
        try:
            packed = {module: _packed([module]) for module in alone} if wanted else {}
            packed.update({first: _packed(group) for first, group in stacks.items()})
        except RuntimeError as error:  # a torch build that cannot pack these weights: the plain path
            logger.warning_once(f"generate(): weight packing failed ({error}); using nn.Linear.")
            packed, stacks = {}, {}

        def undo():
            def unpack():
                for module in packed:
                    module.__dict__.pop("packed_weight", None)
                    module.__dict__.pop("stacked", None)
            _undo_all(unpack, lambda: _swap(plain if packed else [], nn.Linear))

        try:  # nothing is changed before this point; an interrupt from here on is undone before it propagates
            if packed:
                _swap(plain, OneDNNLinear)
                for module, (weight, bias) in packed.items():
                    if module in stacks:
                        module.stacked = (weight, bias, stacks[module][1:])
                    else:
                        module.packed_weight = weight
        except BaseException:
            undo()
            raise
        return undo

    with _installed(model, "attention", lambda: _attention(model)), _installed(model, "inference", install):
        yield


def training_forward(model: nn.Module, label_smoothing: float):
    """The model's `forward` for a training run: in training mode with `labels`, the loss is the label-smoothed
    cross-entropy of §5.4 (`label_smoothing`, epsilon_ls; the model's `loss_function`, which is
    `modeling_vaswani.cross_entropy_loss`), and `logits` are not returned (Trainer reads the loss only). On a CPU in
    eager mode the step runs on the batch's unpadded tokens (`unpad_batch`, where "vaswani_sdpa" is the attention), and
    in fp32 or bf16 autocast the output projection and the loss are fused (`cpu_projected_cross_entropy`) where
    `lm_head` is a plain `nn.Linear` without bias. Anything else runs the model's own `forward`."""
    from .inputs_vaswani import check_labels

    plain, cross_entropy_loss = model.forward, model.loss_function  # the model's §5.4 loss (modeling_vaswani.py)

    @functools.wraps(plain)
    def forward(*args, labels=None, num_items_in_batch=None, **kwargs):
        if labels is None or not model.training:
            return plain(*args, labels=labels, num_items_in_batch=num_items_in_batch, **kwargs)
        if args or kwargs.get("return_dict") is False or any(kwargs.get(name) for name in (
                "output_attentions", "output_hidden_states", "use_cache")):
            outputs = plain(*args, labels=labels, num_items_in_batch=num_items_in_batch, **kwargs)
            loss = cross_entropy_loss(outputs[1], labels, num_items_in_batch, label_smoothing)
            return (loss, *outputs[1:]) if isinstance(outputs, tuple) else Seq2SeqLMOutput(**{**outputs, "loss": loss})
        kwargs.pop("return_dict", None)
        if kwargs.get("decoder_input_ids") is None and kwargs.get("decoder_inputs_embeds") is None:
            kwargs["decoder_input_ids"] = model.prepare_decoder_input_ids_from_labels(labels)
        unpadded = None
        if (labels.device.type == "cpu" and not torch.compiler.is_compiling() and not torch.jit.is_tracing()
                and model.config._attn_implementation == "vaswani_sdpa"):
            unpadded = unpad_batch(kwargs, labels)
        if unpadded is not None:
            kwargs, labels = unpadded
        hidden = model.model(**kwargs, use_cache=False, return_dict=True).last_hidden_state  # (B, T, D) or (1, N, D)
        head, loss = model.lm_head, None
        if hidden.device.type == "cpu" and type(head) in (nn.Linear, OneDNNLinear) and head.bias is None \
                and _plain(head):
            check_labels(labels, head.out_features)
            labelled = labels.reshape(-1).ne(-100).nonzero()[:, 0]
            divisor = len(labelled) if num_items_in_batch is None else num_items_in_batch
            divisor = divisor.clamp(min=1) if torch.is_tensor(divisor) else max(divisor, 1)  # no labels: 0, not NaN
            loss = cpu_projected_cross_entropy(hidden.reshape(-1, hidden.shape[-1]).index_select(0, labelled),
                                               head.weight, labels.reshape(-1)[labelled], label_smoothing, divisor)
        if loss is None:
            loss = cross_entropy_loss(head(hidden), labels, num_items_in_batch, label_smoothing)
        return Seq2SeqLMOutput(loss=loss)

    return forward


@contextlib.contextmanager
def training_fast_paths(model: nn.Module, label_smoothing: float = 0.1):
    """A training run's forward and, for a model on a CPU, its fast paths (see the module docstring), installed for
    the duration of the run and undone on exit. The training commands' trainer and loop run inside it.

    Args:
        model: a `VaswaniForConditionalGeneration` (or a PEFT model around one), on the device it trains on.
        label_smoothing: epsilon_ls of §5.4 (0.1 in the paper), in [0, 1).
    Raises:
        ValueError: `label_smoothing` outside [0, 1).
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1) (the paper trains with 0.1), got {label_smoothing}.")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model

    def install():
        swapped = []

        def undo():
            _undo_all(lambda: base.__dict__.pop("forward", None),
                      *(lambda modules=modules, cls=cls: _swap(modules, cls) for modules, cls in swapped))

        try:  # an interrupt part of the way is undone before it propagates
            base.forward = training_forward(base, label_smoothing)
            if next(base.parameters()).device.type == "cpu":
                for kind, cls in ((nn.Dropout, CPUDropout), (nn.Linear, OneDNNLinear)):
                    modules = own_modules(base, kind)
                    swapped.append((modules, kind))
                    _swap(modules, cls)
        except BaseException:
            undo()
            raise
        return undo

    # On a CPU attention runs as "vaswani_sdpa": one setting of the model's config, shared with generate()'s
    # installation and undone by the last of them to exit, whichever thread that is
    on_cpu = next(base.parameters()).device.type == "cpu"
    with _installed(base, "attention", lambda: _attention(base)) if on_cpu else contextlib.nullcontext(), \
            _installed(base, "training", install):
        yield
