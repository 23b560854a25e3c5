"""Loading for the models of `modeling_vaswani.py`: `from_pretrained`'s checks and the conversion of older checkpoints.

- `VaswaniLoadingMixin`: `from_pretrained` reading safetensors only and refusing weights that cannot be right (an
  unreadable file, NaN or infinity, a tensor missing from or foreign to a local folder), a config.json without a field
  of the model and a generation_config.json that does not fit it (inputs_vaswani.py), converting checkpoints written
  with fused attention input projections, and untying the shared embedding on request (its tensor copied into each
  embedding and `lm_head`);
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
from transformers import GenerationConfig, PretrainedConfig
from transformers.utils import cached_file, logging

from .inputs_vaswani import check_config_fields, check_generation_file

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


def _saved_config(path, kwargs: dict, options: dict) -> dict:
    """The fields of the config.json that was saved with the weights at `path` (or `config=` when that names another
    folder); `{}` where there is none to read."""
    saved = _saved_config_file(path, kwargs, options)[1]
    return saved if isinstance(saved, dict) else {}


def _saved_config_file(path, kwargs: dict, options: dict) -> tuple[str | None, object]:
    """`(file, parsed JSON)` of the config.json that was saved with the weights at `path` (or `config=` when that
    names another folder); `(None, {})` where there is none to read.

    Raises:
        OSError, ValueError: the file cannot be read or is not JSON (transformers' own loading reports it).
    """
    source = kwargs.get("config") if isinstance(kwargs.get("config"), (str, os.PathLike)) else path
    file = cached_file(source, "config.json", _raise_exceptions_for_missing_entries=False,
                       _raise_exceptions_for_connection_errors=False, **options)
    if file is None:
        return None, {}
    with open(file, encoding="utf-8") as handle:
        return file, json.load(handle)


def _untied_copies(cls, path, kwargs: dict, options: dict, names: set[str]) -> tuple[dict[str, str], set[str]]:
    """`({name: source}, dropped)`: the weights that a model loaded with `share_encoder_decoder_embeddings=False` or
    `tie_word_embeddings=False` (keywords, or a `config=` saying so) needs and the file stores once, as the shared
    tensor (§3.4) they were tied to when saved, each loaded as a copy of its source; and the names of the file that
    model has no place for (`shared`, once copied into both embeddings). Empty when nothing is untied.

    Only names tied in the saved config are copied: a tensor that was a weight of its own when saved and is missing from
    the file stays missing (the strict check refuses it)."""
    flags = ("share_encoder_decoder_embeddings", "tie_word_embeddings")
    given = kwargs.get("config") if isinstance(kwargs.get("config"), PretrainedConfig) else None
    if given is None and not any(flag in kwargs for flag in flags):
        return {}, set()
    saved = _saved_config(path, kwargs, options)
    saved_share, saved_tie = (saved.get(flag, True) is not False for flag in flags)
    share, tie = (kwargs.get(flag, getattr(given, flag, saved.get(flag, True))) is not False for flag in flags)
    prefix = "model." if any(name.startswith("model.") for name in names) else ""
    shared = f"{prefix}shared.weight"
    copies, dropped = {}, set()
    if saved_share and not share and shared in names:
        for stack in ("encoder", "decoder"):
            if f"{prefix}{stack}.embed_tokens.weight" not in names:
                copies[f"{prefix}{stack}.embed_tokens.weight"] = shared
        dropped.add(shared)
    if saved_tie and not tie and cls.can_generate() and "lm_head.weight" not in names:
        decoder = f"{prefix}decoder.embed_tokens.weight"
        source = decoder if decoder in names else shared if saved_share and shared in names else None
        if source is not None:
            copies["lm_head.weight"] = source
    return copies, dropped


def _read_checkpoint_to_convert(cls, path, kwargs: dict) -> dict[str, torch.Tensor] | None:
    """The state dict of a model.safetensors checkpoint that needs converting on the way in: fused input projections
    (converted by `split_fused_projections`) or weights stored once that the model to build has untied
    (`_untied_copies`: copied). `None` for a checkpoint loaded as it is, or one that cannot be read here
    (`from_pretrained` then reads it and reports any problem itself)."""
    try:
        options = {name: kwargs[name] for name in _HUB_OPTIONS if kwargs.get(name) is not None}
        file = cached_file(path, "model.safetensors", _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **options)
        if file is None:
            return None
        with safe_open(file, framework="pt") as handle:
            keys = list(handle.keys())
        fused = any(f".{fused}." in key for key in keys for fused, _ in _FUSED_PROJECTIONS)
        copies, dropped = _untied_copies(cls, path, kwargs, options, set(keys))
        if not fused and not copies:
            return None
        state_dict = load_file(file)
    except Exception:  # noqa: BLE001 - the normal loading path reports what is wrong with the file
        return None
    for name, source in copies.items():
        state_dict[name] = state_dict[source].clone()
    for name in dropped:
        del state_dict[name]
    return split_fused_projections(state_dict) if fused else state_dict


def _config_for_checks(path, kwargs: dict, options: dict) -> tuple[str | None, dict | None]:
    """`(file, fields)` of the config the model will be built from, for the checks of the files saved with it: the
    saved config.json of a vaswani model, also where `config=` is the object loaded from it (as the Auto classes pass
    it); `(None, fields of the object)` for a `config=` of the caller's own; `(None, None)` where there is none or it
    cannot be read here (transformers' own loading reports that).

    Raises:
        ValueError: config.json is JSON but not an object, naming it.
    """
    given = kwargs.get("config")
    if isinstance(given, PretrainedConfig) and os.fspath(given.name_or_path or "") != os.fspath(path):
        return None, given.to_dict()
    try:
        file, saved = _saved_config_file(path, {} if isinstance(given, PretrainedConfig) else kwargs, options)
    except (OSError, ValueError):
        return None, None
    if file is not None and not isinstance(saved, dict):
        raise ValueError(f"{file}: expected a JSON object of the model's settings, got {type(saved).__name__}; the "
                         "file is damaged. Copy the folder again.")
    if file is None or saved.get("model_type") not in (None, "vaswani"):
        return None, None  # no config.json, or another model's: VaswaniConfig refuses it naming the file
    return file, saved


def _check_saved_config_fields(path, kwargs: dict) -> None:
    """Refuse a saved config.json that is not a JSON object or lacks a field of the model (`check_config_fields`): the
    default would build another model than the weights' (transformers would speak of `ignore_mismatched_sizes`,
    naming no file) or one that computes something else. Fields given as keywords (`from_pretrained(path,
    d_model=...)`) count as present; a `config=` object of the caller's own is not the file's.

    Raises:
        OSError: a local folder without config.json (and no `config=`). ValueError: naming the config.json and the
            missing fields.
    """
    options = {name: kwargs[name] for name in _HUB_OPTIONS if kwargs.get(name) is not None}
    if isinstance(path, (str, os.PathLike)) and os.path.isdir(path) and kwargs.get("config") is None:
        where = os.path.join(path, kwargs.get("subfolder") or "", "config.json")
        if not os.path.isfile(where):  # the defaults would build the base model, whose weights these are not
            raise OSError(f"{where}: no such file; a saved model folder holds its config.json beside the weights. Copy "
                          "the folder again, or pass the model's config (config=...).")
    file, saved = _config_for_checks(path, kwargs, options)
    if file is not None:
        check_config_fields({**saved, **kwargs}, file)


def _check_generation_config_file(path, kwargs: dict) -> None:
    """Refuse a generation_config.json beside the weights that is not valid JSON (truncated: transformers would fall
    back to default decoding without a word) or that `generate()` would apply wrongly (`check_generation_file`: a
    setting of the wrong type, an unknown length penalty style, special token ids outside the model's vocabulary or
    other than its config's).

    Raises:
        ValueError: naming the file and what is wrong with it.
    """
    options = {name: kwargs[name] for name in _HUB_OPTIONS if kwargs.get(name) is not None}
    try:
        file = cached_file(path, "generation_config.json", _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **options)
    except (OSError, ValueError):  # an unreachable or malformed Hub name: from_pretrained reports it
        return
    if file is None:
        return
    try:
        with open(file, encoding="utf-8") as handle:
            values = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(
            f"{file}: not a readable generation config ({error}); the file is truncated or damaged (a copy, download "
            "or save that did not finish), and transformers would decode with default settings instead of the "
            "model's. Copy the folder again, or write the file anew: model.generation_config.save_pretrained(folder)."
        ) from None
    if not isinstance(values, dict):
        raise ValueError(f"{file}: a generation config is a JSON object of settings, got {type(values).__name__}. "
                         "Write it anew: model.generation_config.save_pretrained(folder).")
    try:
        config = _config_for_checks(path, kwargs, options)[1]
    except (OSError, ValueError):
        config = None
    check_generation_file(values, file, config)


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


def _saved_weight_shapes(folder: str) -> tuple[str, dict[str, tuple[int, ...]]] | None:
    """`(file, {name: shape})` of a folder's safetensors weights (model.safetensors, or every shard its index lists),
    fused input projections given the names and shapes `split_fused_projections` gives them; `None` without weights.

    Raises:
        OSError: a weights file cannot be read. ValueError: the index cannot be read.
    """
    single, index = os.path.join(folder, "model.safetensors"), os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(single):
        where, files = single, [single]
    elif os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as handle:
                where, files = index, sorted({os.path.join(folder, shard)
                                              for shard in json.load(handle)["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{index}: unreadable ({error}); copy the weights again.") from None
    else:
        return None
    shapes = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                for key in handle.keys():
                    shape = tuple(handle.get_slice(key).get_shape())
                    for fused, names in _FUSED_PROJECTIONS:
                        if f".{fused}." in key:
                            head, tail = key.split(f".{fused}.")
                            for name in names:
                                shapes[f"{head}.{name}.{tail}"] = (shape[0] // len(names), *shape[1:])
                            break
                    else:
                        shapes[key] = shape
        except (OSError, SafetensorError) as error:
            raise OSError(f"{file}: unreadable header ({error}); copy the weights again.") from None
    return where, shapes


def check_weights_fit(model: nn.Module, folder: str | os.PathLike) -> None:
    """Refuse a local folder whose safetensors weights do not fit `model`, built from the folder's config.json (on the
    meta device, say): a weight of the model missing from the file, a tensor the model has no place for
    (`_check_loaded_weight_names`), or a tensor of another shape than the model's (transformers would stop on it with
    its advice to pass `ignore_mismatched_sizes`, naming no file). Reads the files' headers only.

    Raises:
        ValueError: naming the weights file, config.json and up to three tensors.
    """
    found = _saved_weight_shapes(os.fspath(folder))
    if found is None:
        return
    where, shapes = found
    _check_loaded_weight_names(model, folder, {}, converted=set(shapes), where=where)
    state = model.state_dict()
    prefix = f"{model.base_model_prefix}."
    has_base = hasattr(model, model.base_model_prefix)
    if not has_base and shapes and all(name.startswith(prefix) for name in shapes):
        shapes = {name[len(prefix):]: shape for name, shape in shapes.items()}
    elif has_base and shapes and not any(name.startswith(prefix) for name in shapes):
        shapes = {prefix + name: shape for name, shape in shapes.items()}
    wrong = [f"{name} {shape} in the file, {tuple(state[name].shape)} in the model" for name, shape in
             sorted(shapes.items()) if name in state and tuple(state[name].shape) != shape]
    if wrong:
        raise ValueError(
            f"{where}: {len(wrong)} tensor(s) have another shape than {os.path.join(folder, 'config.json')} gives "
            f"them ({'; '.join(wrong[:3])}{'; ...' if len(wrong) > 3 else ''}): config.json was edited, or the weights "
            "belong to another model. Copy the folder again, config.json with its weights.")


def _refuse_mismatched_shapes(cls, path, kwargs: dict) -> None:
    """After transformers refused weights of other shapes than the config gives them (its `ignore_mismatched_sizes`
    error, which names no file): raise `check_weights_fit`'s error for a local folder, naming the files and tensors;
    return for anything else (the caller re-raises transformers' error)."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
        return
    folder = os.path.join(path, kwargs.get("subfolder") or "")
    config = kwargs.get("config")
    if not isinstance(config, PretrainedConfig):
        config = cls.config_class.from_pretrained(folder)
    with torch.device("meta"):
        model = cls(config)
    check_weights_fit(model, folder)


def _check_loaded_weight_names(model: nn.Module, name_or_path, kwargs: dict,
                               converted: set[str] | None = None, where: str | None = None) -> None:
    """Refuse a local folder whose safetensors weights lack a tensor of `model` or hold one it has no place for.

    Tied parameters (the shared embedding, §3.4) are stored once, so a group of names that share one tensor needs any
    one of its names in the file: names are grouped by the parameter they hold, by the storage of their tensor, and by
    the model's tied-weight declarations (which is what groups them on the meta device, where offloaded weights have
    no storage). Folders on the Hub, explicit `state_dict`s and key mappings are left to transformers.

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
        where, saved = where or os.path.join(folder, "model.safetensors"), set(converted)
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
    missing = sorted(names[0] for names in _tied_groups(model, state) if not saved.intersection(names))
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
            f"{where}: {' and '.join(parts)}. The weights do not belong to this config.json: they were saved from "
            "another model (another size or layout) or the file was edited; missing weights are not initialized at "
            "random. Load the folder with the config it was saved with, or copy the folder again.")


def _tied_groups(model: nn.Module, state: dict[str, torch.Tensor]) -> list[list[str]]:
    """The names of `state` grouped by the tensor they hold: one parameter object, one storage (not on the meta
    device), or a tie the model declares (`all_tied_weights_keys`, target -> source)."""
    root = {name: name for name in state}

    def find(name: str) -> str:
        while root[name] != name:
            root[name] = root[root[name]]
            name = root[name]
        return name

    def join(a: str, b: str) -> None:
        if a in root and b in root:
            root[find(a)] = find(b)

    first: dict = {}
    for name, tensor in state.items():
        if tensor.device.type != "meta":
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                   tensor.device.type)
            join(name, first.setdefault(key, name))
    for name, parameter in model.named_parameters(remove_duplicate=False):
        join(name, first.setdefault(id(parameter), name))
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        join(target, source)
    groups: dict[str, list[str]] = {}
    for name in state:
        groups.setdefault(find(name), []).append(name)
    return list(groups.values())


def _with_tied_names(cls, config: PretrainedConfig, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` with every name the model ties to another (§3.4) holding its source's tensor. Offloading to disk
    (`device_map`) writes the names of a given state dict only, and a tied layer whose name is not there cannot
    be loaded when it runs."""
    prefix = "model." if any(name.startswith("model.") for name in state_dict) else ""
    shared, decoder = f"{prefix}shared.weight", f"{prefix}decoder.embed_tokens.weight"
    ties = {}
    if config.share_encoder_decoder_embeddings:
        ties = {f"{prefix}encoder.embed_tokens.weight": shared, decoder: shared}
    if config.tie_word_embeddings and cls.can_generate() and prefix:
        ties["lm_head.weight"] = shared if config.share_encoder_decoder_embeddings else decoder
    state_dict = dict(state_dict)
    for target, source in ties.items():
        if target not in state_dict and source in state_dict:
            state_dict[target] = state_dict[source]
    return state_dict


class VaswaniLoadingMixin:
    """What `VaswaniPreTrainedModel` adds to `PreTrainedModel`'s loading and copying; placed before it in the bases."""

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
        A checkpoint written with fused input projections (`qkv_proj`, `kv_proj`) is converted on the way in. Untying
        the shared embedding (`share_encoder_decoder_embeddings=False`, `tie_word_embeddings=False`, as keywords or in
        `config=`) loads a copy of the shared tensor into each embedding and `lm_head`, which then train apart.
        `device_map` with CPU or disk offload (`offload_folder`) loads as transformers does.

        Raises:
            OSError: no safetensors weights, or the weights file cannot be read. ValueError: config.json lacks a field
                of the model (`check_config_fields`), a weight holds NaN/inf, model.safetensors lacks weights of the
                model, holds unexpected ones or ones of other shapes than config.json gives them
                (`check_weights_fit`), or generation_config.json is truncated or holds a setting that
                `check_generation_file` refuses (the file named in each case).
        """
        kwargs.setdefault("use_safetensors", True)
        if pretrained_model_name_or_path is not None:
            _check_saved_config_fields(pretrained_model_name_or_path, kwargs)
        if pretrained_model_name_or_path is not None and cls.can_generate():
            _check_generation_config_file(pretrained_model_name_or_path, kwargs)
        converted = None
        if kwargs.get("state_dict") is None and pretrained_model_name_or_path is not None:
            converted = _read_checkpoint_to_convert(cls, pretrained_model_name_or_path, kwargs)
        if converted is not None:  # weights converted here; config and generation config still read from the folder
            loaded = cls._from_converted(pretrained_model_name_or_path, converted, *args, **kwargs)
        else:
            try:
                loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
            except SafetensorError as error:
                raise OSError(
                    f"{pretrained_model_name_or_path}: the weights file (model.safetensors) cannot be read: {error}. "
                    "It is truncated or corrupted, e.g. by a copy, download or save that did not finish; copy or "
                    "download it again, or load another checkpoint."
                ) from error
            except RuntimeError as error:
                if "ignore_mismatched_sizes" in str(error):  # weights of other shapes than config.json's
                    _refuse_mismatched_shapes(cls, pretrained_model_name_or_path, kwargs)
                raise
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        if converted is None and not kwargs.get("output_loading_info"):
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
        """`from_pretrained` of a checkpoint whose weights `_read_checkpoint_to_convert` converted to `state_dict`;
        keywords naming config fields (`share_encoder_decoder_embeddings=False`) override the saved config, as in
        `PreTrainedModel.from_pretrained`."""
        hub = {name: kwargs[name] for name in _HUB_OPTIONS if kwargs.get(name) is not None}
        if not isinstance(kwargs.get("config"), cls.config_class):
            fields = set(cls.config_class().to_dict()) - {"dtype", "torch_dtype"}
            overrides = {name: kwargs.pop(name) for name in list(kwargs) if name in fields}
            kwargs["config"] = cls.config_class.from_pretrained(kwargs.pop("config", None) or path, **hub, **overrides)
        for name in hub:
            kwargs.pop(name)
        logger.info(f"{path}: converting the weights (fused attention input projections to q_proj, k_proj, v_proj, "
                    "or a shared embedding untied); save the model again to store them as this model names them.")
        if kwargs.get("device_map") is not None:
            state_dict = _with_tied_names(cls, kwargs["config"], state_dict)
        loaded = super().from_pretrained(None, *args, state_dict=state_dict, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        _check_loaded_weight_names(model, path, {**kwargs, **hub}, converted=set(state_dict))
        if hasattr(model, "generation_config"):
            try:
                model.generation_config = GenerationConfig.from_pretrained(path, **hub)
            except OSError:  # no generation_config.json: the defaults from the config stay
                pass
        return loaded
