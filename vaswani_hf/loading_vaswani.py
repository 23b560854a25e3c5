"""Loading for the models of `modeling_vaswani.py`: `from_pretrained`'s checks and the conversion of older checkpoints.

- `VaswaniLoadingMixin`: `from_pretrained` reading safetensors only and refusing weights that cannot be right (an
  unreadable file, NaN or infinity, a tensor missing from or foreign to a local folder), converting checkpoints written
  with fused attention input projections, and leaving the weights packed for `generate()` out of copies and training;
- `split_fused_projections`: `qkv_proj` / `kv_proj` checkpoint keys as the `q_proj`, `k_proj`, `v_proj` of §3.2.2.

It imports only torch, transformers and safetensors: transformers copies it beside the model code (relative imports)
for `trust_remote_code=True`.
"""

import json
import os

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn
from transformers import GenerationConfig
from transformers.utils import cached_file, logging

logger = logging.get_logger(__name__)

_FUSED_PROJECTIONS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("kv_proj", ("k_proj", "v_proj")))
_HUB_OPTIONS = ("cache_dir", "revision", "token", "local_files_only", "subfolder")


def split_fused_projections(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint keys of the fused input projections (`self_attn.qkv_proj`, `encoder_attn.kv_proj`, whose `(n * D, D)`
    weights stack W^Q, W^K, W^V) as the separate `q_proj`, `k_proj`, `v_proj` of `VaswaniAttention`; other keys as they
    are."""
    converted = {}
    for key, tensor in state_dict.items():
        for fused, names in _FUSED_PROJECTIONS:
            if f".{fused}." in key:
                prefix, suffix = key.split(f".{fused}.")
                for name, block in zip(names, tensor.chunk(len(names), dim=0), strict=True):
                    converted[f"{prefix}.{name}.{suffix}"] = block.contiguous()
                break
        else:
            converted[key] = tensor
    return converted


def _read_fused_projection_checkpoint(path, kwargs: dict) -> dict[str, torch.Tensor] | None:
    """The state dict of a checkpoint written with fused input projections, converted by `split_fused_projections`;
    `None` for a checkpoint with today's names or one that cannot be read here (`from_pretrained` then reads it and
    reports any problem itself)."""
    try:
        options = {name: kwargs[name] for name in _HUB_OPTIONS if kwargs.get(name) is not None}
        file = cached_file(path, "model.safetensors", _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **options)
        if file is None:
            return None
        with safe_open(file, framework="pt") as handle:
            keys = list(handle.keys())
        if not any(f".{fused}." in key for key in keys for fused, _ in _FUSED_PROJECTIONS):
            return None
        return split_fused_projections(load_file(file))
    except Exception:  # noqa: BLE001 - the normal loading path reports what is wrong with the file
        return None


def _saved_weight_names(folder: str) -> tuple[str, set[str]] | None:
    """`(file, tensor names)` of a folder's safetensors weights: model.safetensors, or the names its shard index lists;
    `None` when the folder has neither.

    Raises:
        OSError: model.safetensors cannot be read. ValueError: the index cannot be read.
    """
    single, index = os.path.join(folder, "model.safetensors"), os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(single):
        try:
            with safe_open(single, framework="pt") as handle:
                return single, set(handle.keys())
        except (OSError, SafetensorError) as error:
            raise OSError(f"{single}: unreadable header ({error}); copy the weights again.") from None
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as handle:
                return index, set(json.load(handle)["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{index}: unreadable ({error}); copy the weights again.") from None
    return None


def _check_loaded_weight_names(model: nn.Module, name_or_path, kwargs: dict,
                               converted: set[str] | None = None) -> None:
    """Refuse a local folder whose safetensors weights lack a tensor of `model` or hold one it has no place for.

    Tied parameters (the shared embedding, §3.4) are stored once, so a group of names that share one tensor needs any
    one of its names in the file. Folders on the Hub, explicit `state_dict`s and key mappings are left to transformers.

    Raises:
        ValueError: naming the file and up to five missing or unexpected weights.
    """
    if not isinstance(name_or_path, (str, os.PathLike)) or not os.path.isdir(name_or_path):
        return
    if any(kwargs.get(key) is not None for key in ("state_dict", "key_mapping", "gguf_file")):
        return
    if kwargs.get("use_safetensors") is False:
        return
    folder = os.path.join(name_or_path, kwargs.get("subfolder") or "")
    if converted is not None:  # a checkpoint with fused projections, its names already converted
        where, saved = os.path.join(folder, "model.safetensors"), set(converted)
    else:
        found = _saved_weight_names(folder)
        if found is None:
            return
        where, saved = found
    state = model.state_dict()
    prefix = f"{model.base_model_prefix}."
    has_base = hasattr(model, model.base_model_prefix)
    if not has_base and saved and all(name.startswith(prefix) for name in saved):
        saved = {name[len(prefix):] for name in saved}  # a base model loaded from a folder with the LM head
    elif has_base and saved and not any(name.startswith(prefix) for name in saved):
        saved = {prefix + name for name in saved}  # the LM model loaded from a base model's folder
    groups: dict[tuple, list[str]] = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.device.type)
        groups.setdefault(key if tensor.device.type != "meta" else (name,), []).append(name)
    missing = sorted(names[0] for names in groups.values() if not saved.intersection(names))
    unexpected = sorted(saved - set(state))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} weight(s) of the model ({', '.join(missing[:5])}"
                         f"{', ...' if len(missing) > 5 else ''})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected weight(s) ({', '.join(unexpected[:5])}"
                         f"{', ...' if len(unexpected) > 5 else ''})")
        raise ValueError(
            f"{where}: {' and '.join(parts)}. The weights do not belong to this config.json (another model size, "
            "an edited or damaged file); missing weights are not initialized at random. Copy the folder again, or "
            "load it with the config it was saved with.")


class VaswaniLoadingMixin:
    """What `VaswaniPreTrainedModel` adds to `PreTrainedModel`'s loading and copying; placed before it in the bases."""

    def train(self, mode: bool = True):
        if mode:  # training will change the weights: weights packed for generate() are dropped (kernels_vaswani)
            self.__dict__.pop("_packed_cpu_linears", None)
        return super().train(mode)

    def __getstate__(self):  # copy.deepcopy and pickle: weights packed for generate() are not part of the model
        state = dict(super().__getstate__())
        state.pop("_packed_cpu_linears", None)
        return state

    def mark_tied_weights_as_initialized(self, loading_info):
        """transformers' step before initializing the weights a checkpoint lacks: it flags every tied parameter as
        initialized. Our embeddings are tied by sharing one module (§3.4), so `encoder.embed_tokens.weight` *is*
        `shared.weight`, and flagging it would flag the source as well: a checkpoint without the embedding would leave
        it uninitialized on the meta device and not report it missing. Parameters that are their own source are
        skipped here; the rest is transformers' step."""
        tied = getattr(self, "all_tied_weights_keys", {}) or {}
        sources = {id(self.get_parameter(source)) for source in set(tied.values())}
        for target in tied:
            parameter = self.get_parameter(target)
            if id(parameter) not in sources:
                parameter._is_hf_initialized = True
        if self.is_custom_code():  # as transformers: module-tied names whose module was loaded are not missing
            loading_info.missing_keys = {
                key for key in loading_info.missing_keys
                if key in tied or not getattr(self.get_parameter_or_buffer(key), "_is_hf_initialized", False)}

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, reading weights from safetensors only and refusing weights that cannot be
        right: a truncated or corrupted safetensors file (a copy, download or save that did not finish; safetensors'
        own error names no file) and weights holding NaN or infinity (flipped bytes, or a run that diverged), which
        would otherwise translate garbage without a word.

        `use_safetensors` defaults to True: a folder with only `pytorch_model.bin` (a pickle) is refused unless the
        caller passes `use_safetensors=False` on purpose.

        Loading a local folder is strict: a weight the model needs that model.safetensors lacks (transformers would
        initialize it at random and only log it) or a tensor in the file that the model has no place for is an error,
        unless the caller passes `output_loading_info=True` and so receives the missing and unexpected names to check.
        A checkpoint written with fused input projections (`qkv_proj`, `kv_proj`) is converted on the way in.

        Raises:
            OSError: no safetensors weights, or the weights file cannot be read. ValueError: a weight holds NaN/inf,
                or model.safetensors lacks weights of the model or holds unexpected ones.
        """
        kwargs.setdefault("use_safetensors", True)
        legacy = None
        if kwargs.get("state_dict") is None and pretrained_model_name_or_path is not None:
            legacy = _read_fused_projection_checkpoint(pretrained_model_name_or_path, kwargs)
        if legacy is not None:  # weights converted here; config and generation config still read from the folder
            return cls._from_converted(pretrained_model_name_or_path, legacy, *args, **kwargs)
        try:
            loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except SafetensorError as error:
            raise OSError(
                f"{pretrained_model_name_or_path}: the weights file (model.safetensors) cannot be read: {error}. It is "
                "truncated or corrupted, e.g. by a copy, download or save that did not finish; copy or download it "
                "again, or load another checkpoint."
            ) from error
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        if not kwargs.get("output_loading_info"):
            _check_loaded_weight_names(model, pretrained_model_name_or_path, kwargs)
        for name, tensor in model.state_dict().items():
            if tensor.device.type != "meta" and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ValueError(
                    f"{pretrained_model_name_or_path}: weight {name} holds NaN or infinite values. The weights file is "
                    "corrupted, or the training run that wrote it diverged; load an earlier checkpoint."
                )
        return loaded

    @classmethod
    def _from_converted(cls, path, state_dict: dict[str, torch.Tensor], *args, **kwargs):
        """`from_pretrained` of a checkpoint whose weights `split_fused_projections` converted to `state_dict`."""
        hub = {name: kwargs[name] for name in _HUB_OPTIONS if kwargs.get(name) is not None}
        if not isinstance(kwargs.get("config"), cls.config_class):
            kwargs["config"] = cls.config_class.from_pretrained(kwargs.pop("config", None) or path, **hub)
        for name in hub:
            kwargs.pop(name)
        logger.info(f"{path}: converting fused attention input projections (qkv_proj, kv_proj) to q_proj, k_proj, "
                    "v_proj; save the model again to store the new names.")
        loaded = super().from_pretrained(None, *args, state_dict=state_dict, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        _check_loaded_weight_names(model, path, {**kwargs, **hub}, converted=set(state_dict))
        if hasattr(model, "generation_config"):
            try:
                model.generation_config = GenerationConfig.from_pretrained(path, **hub)
            except OSError:  # no generation_config.json: the defaults from the config stay
                pass
        return loaded
