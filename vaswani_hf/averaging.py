"""Checkpoint averaging (§6.1): "For the base models, we used a single model obtained by averaging the last 5
checkpoints, which were written at 10-minute intervals. For the big models, we averaged the last 20 checkpoints."

The average is taken parameter by parameter, as fairseq's `scripts/average_checkpoints.py` does: every floating
point tensor becomes the mean of that tensor over the checkpoints (summed in float64, stored in the checkpoints'
dtype); tensors of other dtypes are copied from the newest checkpoint. Weights are read with `safetensors` only,
never with `torch.load` (no pickle, so no code can run from a checkpoint file).

A Trainer `output_dir` holds `checkpoint-<step>` folders; `find_checkpoints` orders them by step number
(`checkpoint-10000` after `checkpoint-9000`, which a plain sort gets wrong). The averaged model is written as a
normal model folder: `model.safetensors`, the newest checkpoint's config, generation config, tokenizer and model
code files, and `averaged_from.json` naming the checkpoints. Weights that the checkpoints store once because they
are tied (the shared embeddings and the output projection, §3.4) are stored once again, so they stay tied when the
folder is loaded with `from_pretrained`.

A new output folder is written whole under a temporary name beside it and then renamed (an existing earlier average
is swapped out only once the new one is complete), so a kill never leaves new weights beside an old
`averaged_from.json`. Inside a training run's own folder (`in_place=True`) every file is written to a temporary file
and renamed, `averaged_from.json` last. Checkpoints whose weights are truncated or hold NaN or infinite values are
refused, naming the file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from .checks import CheckError, read_json, replace_file_atomically, safetensors_problem, swap_in_folder

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# Fields of config.json that may differ between checkpoints of one run.
_CONFIG_FIELDS_IGNORED = ("transformers_version", "_name_or_path")
# Files of a Trainer (or accelerate save_state) checkpoint that are not part of the model: weights (written anew),
# optimizer, scheduler and RNG states (pickles), Trainer state, the run's settings.
_NOT_COPIED = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|pkl)$|model\.safetensors\.index\.json$"
                         r"|trainer_state\.json$|training_args\.bin$|rng_state.*|random_states.*|vaswani_run\.json$")
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")

__all__ = ["average_checkpoints", "average_last_checkpoints", "check_average_output", "find_checkpoints",
           "save_averaged_model"]


def find_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The `checkpoint-<step>` folders directly under `output_dir`, oldest (lowest step) first.

    Raises:
        FileNotFoundError: `output_dir` is not a folder.
    """
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise FileNotFoundError(f"find_checkpoints: {output_dir} is not a folder.")
    found = [(int(m.group(1)), path) for path in output_dir.iterdir()
             if path.is_dir() and (m := _CHECKPOINT_DIR.match(path.name))]
    return [path for _, path in sorted(found)]


def _weight_files(folder: Path) -> list[Path]:
    single = folder / WEIGHTS_NAME
    if single.is_file():
        return [single]
    index = folder / WEIGHTS_INDEX_NAME
    if index.is_file():
        try:
            shards = sorted(set(read_json(index)["weight_map"].values()))
        except (KeyError, TypeError, AttributeError):
            raise CheckError(f"{index}: no weight_map of shard files; the index is damaged.") from None
        return [folder / shard for shard in shards]
    others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = (f" It has {', '.join(others)}, which would need torch.load (pickle); save checkpoints with "
            "save_safetensors=True (the Trainer's default).") if others else ""
    raise FileNotFoundError(f"{folder}: no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}; averaging reads safetensors "
                            f"only.{hint}")


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder} is not a model checkpoint: it has no config.json.")
    config = read_json(path)
    if not isinstance(config, dict):
        raise CheckError(f"{path}: expected a JSON object, got {type(config).__name__}; the file is damaged.")
    for key in _CONFIG_FIELDS_IGNORED:
        config.pop(key, None)
    return config


def _check_same_config(folders: Sequence[Path]) -> None:
    reference = _read_config(folders[0])
    for folder in folders[1:]:
        config = _read_config(folder)
        differing = sorted(k for k in set(reference) | set(config) if reference.get(k) != config.get(k))
        if differing:
            details = "; ".join(f"{k}: {reference.get(k)!r} vs {config.get(k)!r}" for k in differing)
            raise ValueError(f"Cannot average checkpoints of different models: {folders[0]} and {folder} differ in "
                             f"config field(s) {', '.join(differing)} ({details}).")


def _tokenizer_model(folder: Path) -> tuple | None:
    """What a checkpoint's `tokenizer.json` maps text to ids with: its model (vocabulary and merges) and its added
    tokens; `None` where the folder has no tokenizer.json."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    tokenizer = read_json(path)
    if not isinstance(tokenizer, dict):
        raise CheckError(f"{path}: expected a JSON object, got {type(tokenizer).__name__}; the file is damaged.")
    return tokenizer.get("model"), tokenizer.get("added_tokens")


def _check_same_tokenizer(folders: Sequence[Path]) -> None:
    """Checkpoints that hold tokenizers must hold the same one: ids of another vocabulary or other merges mean other
    rows of the embedding, whatever the vocabulary's size."""
    reference = None
    for folder in folders:
        model = _tokenizer_model(folder)
        if model is None:
            continue
        if reference is None:
            reference = (folder, model)
        elif model != reference[1]:
            kind = "vocabularies" if (model[0] or {}).get("vocab") != (reference[1][0] or {}).get("vocab") else \
                "merges or added tokens"
            raise ValueError(f"Cannot average {reference[0]} and {folder}: their tokenizer.json files hold different "
                             f"{kind}, so the same embedding row stands for different tokens. Average checkpoints "
                             "of one run (one tokenizer).")


def _load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """The weights of one checkpoint, refused (naming the file) when a file is truncated or a tensor is not finite."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        problem = safetensors_problem(path)
        if problem:
            raise CheckError(f"{folder}: cannot average this checkpoint ({problem}). A run killed while saving leaves "
                             f"such files; leave the checkpoint out (--checkpoints ...) or copy it again.")
        weights = load_file(str(path), device="cpu")
        bad = [name for name, tensor in weights.items()
               if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
        if bad:
            raise CheckError(f"{path}: {len(bad)} tensor(s) hold NaN or infinite values ({', '.join(bad[:3])}"
                             f"{', ...' if len(bad) > 3 else ''}): training diverged before this checkpoint was "
                             f"saved, and its average would be NaN too. Average earlier checkpoints "
                             f"(--checkpoints ...).")
        state.update(weights)
    return state


def average_checkpoints(paths: Sequence[str | os.PathLike]) -> dict[str, torch.Tensor]:
    """The parameter-wise mean of the model weights in `paths` (model folders, e.g. Trainer checkpoints).

    Args:
        paths: two or more folders, each with `config.json` and `model.safetensors` (or a sharded
            `model.safetensors.index.json`). One folder is allowed and returns its weights unchanged.
    Returns:
        a state dict with the checkpoints' keys: floating-point tensors averaged (float64 sum / n, cast back to their
        dtype), other tensors from the last path.
    Raises:
        ValueError: no paths; configs that differ (the message names both folders and the fields); tokenizers that
            differ (vocabulary, merges or added tokens); different parameter names or shapes.
        FileNotFoundError: a folder without config.json or safetensors weights.
        CheckError (a ValueError): a truncated weights file, or weights holding NaN or infinite values, naming it.
    """
    folders = [Path(p) for p in paths]
    if not folders:
        raise ValueError("average_checkpoints: no checkpoints given.")
    for folder in folders:
        if not folder.is_dir():
            raise FileNotFoundError(f"average_checkpoints: {folder} is not a folder.")
    _check_same_config(folders)
    _check_same_tokenizer(folders)

    sums: dict[str, torch.Tensor] = {}
    last: dict[str, torch.Tensor] = {}
    for i, folder in enumerate(folders):
        state = _load_state_dict(folder)
        if i == 0:
            reference_keys = set(state)
        elif set(state) != reference_keys:
            missing, extra = sorted(reference_keys - set(state)), sorted(set(state) - reference_keys)
            raise ValueError(f"Cannot average {folders[0]} and {folder}: different parameters (only in the first: "
                             f"{missing[:5]}, only in the second: {extra[:5]}).")
        for name, tensor in state.items():
            if i and tensor.shape != last[name].shape:
                raise ValueError(f"Cannot average {folders[0]} and {folder}: {name} has shape "
                                 f"{tuple(last[name].shape)} vs {tuple(tensor.shape)}.")
            if tensor.is_floating_point():
                sums[name] = sums[name] + tensor.double() if name in sums else tensor.double()
            last[name] = tensor
    n = len(folders)
    return {name: (sums[name] / n).to(tensor.dtype) if name in sums else tensor.clone()
            for name, tensor in last.items()}


def _atomic_copy(source: Path, destination: Path) -> None:
    replace_file_atomically(destination, lambda tmp: shutil.copyfile(source, tmp))


def _model_files(template: Path) -> list[Path]:
    """The files of checkpoint `template` that an averaged model folder carries (all but weights and training
    state)."""
    return [path for path in sorted(template.iterdir()) if path.is_file() and not _NOT_COPIED.match(path.name)]


def check_average_output(save_to: str | os.PathLike, template: str | os.PathLike,
                         sources: Sequence[str | os.PathLike] = ()) -> None:
    """Where an average may go: never one of the checkpoints averaged (`template`, `sources`); an existing `save_to`
    only when it is an earlier average (it holds averaged_from.json) and holds nothing that the new average would not
    write again (a file the user put there, an evaluation of the earlier weights).

    Raises:
        CheckError: naming the folder and the files in the way.
    """
    save_to, template = Path(save_to), Path(template)
    resolved = save_to.resolve()
    for folder in [template, *map(Path, sources)]:
        if folder.resolve() == resolved:
            raise CheckError(f"save_to={save_to} is one of the checkpoints being averaged; choose a new folder.")
    if not save_to.exists():
        return
    if not save_to.is_dir():
        raise CheckError(f"{save_to} is a file, not a folder; choose a folder name for the averaged model.")
    present = sorted(p.name for p in save_to.iterdir())
    if not present:
        return
    if "averaged_from.json" not in present:
        raise CheckError(f"{save_to} exists and is not an earlier averaged model (no averaged_from.json; it holds "
                         f"{', '.join(present[:5])}{', ...' if len(present) > 5 else ''}): averaging into it would "
                         f"replace what it holds. Choose a new folder.")
    written = {p.name for p in _model_files(template)} | {WEIGHTS_NAME, "averaged_from.json"}
    others = [name for name in present if name not in written]
    if others:
        raise CheckError(f"{save_to} is an earlier average but also holds {', '.join(others)}, which the new average "
                         f"would not keep (and which describe the earlier weights). Move them out, or choose a new "
                         f"folder.")


def _write_model_folder(folder: Path, tensors: dict[str, torch.Tensor], template: Path, provenance: dict) -> None:
    """Model files of `template`, then the weights, then averaged_from.json, each written atomically into `folder`."""
    from safetensors.torch import save_file

    for path in _model_files(template):
        _atomic_copy(path, folder / path.name)
    replace_file_atomically(folder / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    text = json.dumps(provenance, indent=2) + "\n"
    replace_file_atomically(folder / "averaged_from.json", lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def save_averaged_model(state_dict: dict[str, torch.Tensor], template: str | os.PathLike,
                        save_to: str | os.PathLike, sources: Sequence[str | os.PathLike] = (), *,
                        in_place: bool = False) -> Path:
    """Write `state_dict` as a model folder `save_to`, with the non-weight files (config, generation config,
    tokenizer, model code) of the checkpoint folder `template` and `averaged_from.json` naming `sources`.

    By default the folder is written whole under a temporary name beside `save_to` and renamed into place; an
    existing `save_to` must be an earlier average and is replaced only once the new one is complete.
    `in_place=True` writes into `save_to` file by file instead (a training run's own `output_dir`, which holds
    the run's checkpoints): an earlier `averaged_from.json` is removed first and the new one written last, so that
    it never names checkpoints other than those of the weights beside it.

    Returns:
        the folder written.
    Raises:
        CheckError (a ValueError): `save_to` is `template` or one of `sources`; an existing `save_to` that is
            not an earlier average or holds other files (default mode); `save_to` holds sharded weights that the
            new `model.safetensors` would not replace (`in_place`).
    """
    template, save_to = Path(template), Path(save_to)
    if in_place:
        for folder in [template, *map(Path, sources)]:
            if folder.resolve() == save_to.resolve():
                raise CheckError(f"save_to={save_to} is one of the checkpoints being averaged; choose a new folder.")
    tensors = {name: tensor.contiguous() for name, tensor in state_dict.items()}
    provenance = {"averaged_checkpoints": [str(Path(p)) for p in sources] or [str(template)],
                  "method": "parameter-wise mean (Vaswani et al. 2017, §6.1)"}
    if in_place:
        save_to.mkdir(parents=True, exist_ok=True)
        if (save_to / WEIGHTS_INDEX_NAME).exists():
            raise CheckError(f"{save_to} already holds sharded weights ({WEIGHTS_INDEX_NAME}), which would shadow the "
                             "averaged model.safetensors; remove them or choose another folder.")
        (save_to / "averaged_from.json").unlink(missing_ok=True)
        _write_model_folder(save_to, tensors, template, provenance)
        return save_to
    check_average_output(save_to, template, sources)
    save_to.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=save_to.parent, prefix=f".{save_to.name}.tmp-"))
    try:
        _write_model_folder(tmp, tensors, template, provenance)
        swap_in_folder(tmp, save_to)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return save_to


def average_last_checkpoints(output_dir: str | os.PathLike, n: int, save_to: str | os.PathLike) -> list[Path]:
    """Average the last `n` `checkpoint-<step>` folders of a Trainer `output_dir` (by step number) and write the
    result as a model folder `save_to` (§6.1: n = 5 for base models, 20 for big ones).

    Args:
        output_dir: the Trainer's `output_dir`.
        n: how many of the newest checkpoints to average (>= 1).
        save_to: the folder to write (created if needed); loads with `AutoModelForSeq2SeqLM.from_pretrained`.
    Returns:
        the checkpoint folders averaged, oldest first.
    Raises:
        ValueError: `n < 1`; fewer than `n` checkpoints (keep them with `save_total_limit >= n`); checkpoints of
            different configs; a damaged or non-finite checkpoint; a `save_to` that is not a new folder or an earlier
            average (see `save_averaged_model`).
        FileNotFoundError: `output_dir` missing, or a checkpoint without config.json / safetensors weights.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"average_last_checkpoints: n must be a positive integer, got {n!r}.")
    checkpoints = find_checkpoints(output_dir)
    if len(checkpoints) < n:
        names = ", ".join(p.name for p in checkpoints) or "none"
        raise ValueError(f"Asked to average the last {n} checkpoints, but {output_dir} has only {len(checkpoints)} "
                         f"({names}). Train longer, save more often (save_steps), or keep more checkpoints "
                         f"(save_total_limit >= {n}).")
    chosen = checkpoints[-n:]
    check_average_output(save_to, chosen[-1], chosen)  # before the weights are read
    state = average_checkpoints(chosen)
    save_averaged_model(state, chosen[-1], save_to, sources=chosen)
    return chosen
