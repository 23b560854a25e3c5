"""Checkpoint averaging (§6.1): "For the base models, we used a single model obtained by averaging the last 5
checkpoints, which were written at 10-minute intervals. For the big models, we averaged the last 20 checkpoints."

The average is taken parameter by parameter, as fairseq's ``scripts/average_checkpoints.py`` does: every floating
point tensor becomes the mean of that tensor over the checkpoints (summed in float64, stored in the checkpoints'
dtype); tensors of other dtypes are copied from the newest checkpoint. Weights are read with ``safetensors`` only,
never with ``torch.load`` (no pickle, so no code can run from a checkpoint file).

A Trainer ``output_dir`` holds ``checkpoint-<step>`` folders; :func:`find_checkpoints` orders them by step number
(``checkpoint-10000`` after ``checkpoint-9000``, which a plain sort gets wrong). The averaged model is written as a
normal model folder: ``model.safetensors``, the newest checkpoint's config, generation config, tokenizer and model
code files, and ``averaged_from.json`` naming the checkpoints. Weights that the checkpoints store once because they
are tied (the shared embeddings and the output projection, §3.4) are stored once again, so they stay tied when the
folder is loaded with ``from_pretrained``.

Every file is written to a temporary file in the output folder first and then renamed over its final name.
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

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# Fields of config.json that may differ between checkpoints of one run.
_CONFIG_FIELDS_IGNORED = ("transformers_version", "_name_or_path")
# Files of a Trainer (or accelerate save_state) checkpoint that are not part of the model: weights (written anew),
# optimizer, scheduler and RNG states (pickles), Trainer state.
_NOT_COPIED = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|pkl)$|model\.safetensors\.index\.json$"
                         r"|trainer_state\.json$|training_args\.bin$|rng_state.*|random_states.*")
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")

__all__ = ["average_checkpoints", "average_last_checkpoints", "find_checkpoints", "save_averaged_model"]


def find_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The ``checkpoint-<step>`` folders directly under ``output_dir``, oldest (lowest step) first.

    Raises:
        FileNotFoundError: ``output_dir`` is not a folder.
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
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
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
    config = json.loads(path.read_text(encoding="utf-8"))
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


def _load_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(folder):
        state.update(load_file(str(path), device="cpu"))
    return state


def average_checkpoints(paths: Sequence[str | os.PathLike]) -> dict[str, torch.Tensor]:
    """The parameter-wise mean of the model weights in ``paths`` (model folders, e.g. Trainer checkpoints).

    Args:
        paths: two or more folders, each with ``config.json`` and ``model.safetensors`` (or a sharded
            ``model.safetensors.index.json``). One folder is allowed and returns its weights unchanged.
    Returns:
        a state dict with the checkpoints' keys: floating-point tensors averaged (float64 sum / n, cast back to their
        dtype), other tensors from the last path.
    Raises:
        ValueError: no paths; configs that differ (the message names both folders and the fields); different
            parameter names or shapes.
        FileNotFoundError: a folder without config.json or safetensors weights.
    """
    folders = [Path(p) for p in paths]
    if not folders:
        raise ValueError("average_checkpoints: no checkpoints given.")
    for folder in folders:
        if not folder.is_dir():
            raise FileNotFoundError(f"average_checkpoints: {folder} is not a folder.")
    _check_same_config(folders)

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
    fd, tmp = tempfile.mkstemp(dir=destination.parent, prefix=f".{destination.name}.", suffix=".tmp")
    os.close(fd)
    try:
        shutil.copyfile(source, tmp)
        os.replace(tmp, destination)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _atomic_write(destination: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=destination.parent, prefix=f".{destination.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, destination)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_averaged_model(state_dict: dict[str, torch.Tensor], template: str | os.PathLike,
                        save_to: str | os.PathLike, sources: Sequence[str | os.PathLike] = ()) -> Path:
    """Write ``state_dict`` as a model folder ``save_to``, with the non-weight files (config, generation config,
    tokenizer, model code) of the checkpoint folder ``template``.

    Returns:
        the folder written.
    Raises:
        ValueError: ``save_to`` is ``template`` or one of ``sources``, or holds sharded weights that the new
            ``model.safetensors`` would not replace.
    """
    from safetensors.torch import save_file

    template, save_to = Path(template), Path(save_to)
    resolved = save_to.resolve()
    for folder in [template, *map(Path, sources)]:
        if folder.resolve() == resolved:
            raise ValueError(f"save_to={save_to} is one of the checkpoints being averaged; choose a new folder.")
    save_to.mkdir(parents=True, exist_ok=True)
    if (save_to / WEIGHTS_INDEX_NAME).exists():
        raise ValueError(f"{save_to} already holds sharded weights ({WEIGHTS_INDEX_NAME}), which would shadow the "
                         "averaged model.safetensors; remove them or choose another folder.")
    for path in sorted(template.iterdir()):
        if path.is_file() and not _NOT_COPIED.match(path.name):
            _atomic_copy(path, save_to / path.name)
    tensors = {name: tensor.contiguous() for name, tensor in state_dict.items()}
    _atomic_write(save_to / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    provenance = {"averaged_checkpoints": [str(Path(p)) for p in sources] or [str(template)],
                  "method": "parameter-wise mean (Vaswani et al. 2017, §6.1)"}
    text = json.dumps(provenance, indent=2) + "\n"
    _atomic_write(save_to / "averaged_from.json", lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return save_to


def average_last_checkpoints(output_dir: str | os.PathLike, n: int, save_to: str | os.PathLike) -> list[Path]:
    """Average the last ``n`` ``checkpoint-<step>`` folders of a Trainer ``output_dir`` (by step number) and write the
    result as a model folder ``save_to`` (§6.1: n = 5 for base models, 20 for big ones).

    Args:
        output_dir: the Trainer's ``output_dir``.
        n: how many of the newest checkpoints to average (>= 1).
        save_to: the folder to write (created if needed); loads with ``AutoModelForSeq2SeqLM.from_pretrained``.
    Returns:
        the checkpoint folders averaged, oldest first.
    Raises:
        ValueError: ``n < 1``; fewer than ``n`` checkpoints (keep them with ``save_total_limit >= n``); checkpoints of
            different configs.
        FileNotFoundError: ``output_dir`` missing, or a checkpoint without config.json / safetensors weights.
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
    state = average_checkpoints(chosen)
    save_averaged_model(state, chosen[-1], save_to, sources=chosen)
    return chosen
