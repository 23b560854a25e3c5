"""Checks on saved folders before anything is loaded from them: Trainer checkpoints for `--resume_from_checkpoint`, and
model folders for the translate/evaluate commands.

Trainer writes a `checkpoint-<step>` folder in place, file after file (transformers 5.23 `Trainer._save_checkpoint`:
weights, then optimizer and scheduler, then RNG state, then `trainer_state.json`), so a run killed while saving leaves
a folder that is there but incomplete, and transformers' own `get_last_checkpoint` picks the newest folder whatever it
holds. `resolve_resume_checkpoint` picks the newest *complete* one instead and says which incomplete ones it skipped.

A checkpoint is complete when it holds all of `REQUIRED_CHECKPOINT_FILES` (`rng_state_<rank>.pth` files stand for
`rng_state.pth` after a multi-process run) and each can be read to its end: the safetensors header describes exactly the
bytes in the file, the `.pt`/`.pth` files (zip archives, as `torch.save` writes them) pass their CRC checks, and
`trainer_state.json` parses and names the folder's step. The contents are never unpickled here.

Model folders: weights are read from safetensors only (never `pytorch_model.bin`, a pickle), and the folder must hold
a `vaswani` model, not another model type that `AutoModelForSeq2SeqLM` would also load.
"""

from __future__ import annotations

import json
import logging
import os
import re
import zipfile
from pathlib import Path

from vaswani_hf.checks import CheckError, safetensors_problem
from vaswani_hf.checks import check_model_folder as _check_model_folder
from vaswani_hf.checks import weights_problems as _weights_problems

logger = logging.getLogger("vaswani_hf.training")

REQUIRED_CHECKPOINT_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json",
                             "rng_state.pth")
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
_RESUME_LAST = ("true", "last", "latest")

__all__ = ["CheckpointError", "REQUIRED_CHECKPOINT_FILES", "checkpoint_problems", "check_model_folder",
           "resolve_resume_checkpoint", "resolve_resume_value", "safetensors_problem"]


class CheckpointError(ValueError):
    """A checkpoint or model folder that cannot be used; the message names the folder, what is wrong, and what to do."""


def _zip_problem(path: Path) -> str | None:
    """`torch.save` files are zip archives: a truncated one has no central directory, a damaged one fails a CRC."""
    if not path.is_file():
        return f"{path.name} is missing"
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError):
        return f"{path.name} is truncated or not a torch.save archive"
    return f"{path.name} is corrupted (CRC mismatch in {bad})" if bad else None


def checkpoint_problems(folder: str | os.PathLike) -> list[str]:
    """What makes `folder` unusable for resuming training; an empty list for a complete checkpoint."""
    folder = Path(folder)
    if not folder.is_dir():
        return [f"{folder} is not a folder"]
    problems = _weights_problems(folder)
    for name in ("optimizer.pt", "scheduler.pt"):
        if problem := _zip_problem(folder / name):
            problems.append(problem)
    rng_files = sorted(folder.glob("rng_state_*.pth")) or [folder / "rng_state.pth"]
    problems += [problem for path in rng_files if (problem := _zip_problem(path))]
    state_path = folder / "trainer_state.json"
    if not state_path.is_file():
        problems.append("trainer_state.json is missing (Trainer writes it last, so the save did not finish)")
    else:
        try:
            step = json.loads(state_path.read_text(encoding="utf-8"))["global_step"]
        except (OSError, ValueError, KeyError, TypeError):
            problems.append("trainer_state.json is truncated or unreadable")
        else:
            match = _CHECKPOINT_DIR.match(folder.name)
            if match and int(match.group(1)) != step:
                problems.append(f"trainer_state.json is for step {step}, not {match.group(1)}")
    return problems


def _checkpoints(output_dir: Path) -> list[Path]:
    """`checkpoint-<step>` folders directly under `output_dir`, newest (highest step) first."""
    if not output_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if p.is_dir() and (m := _CHECKPOINT_DIR.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def _newest_complete(output_dir: Path, asked: str) -> str:
    candidates = _checkpoints(output_dir)
    if not candidates:
        raise CheckpointError(
            f"--resume_from_checkpoint {asked}: no checkpoint-<step> folder in {output_dir}, so there is nothing to "
            f"resume. Check --output_dir, or drop --resume_from_checkpoint to start a new run.")
    skipped = []
    for folder in candidates:
        problems = checkpoint_problems(folder)
        if not problems:
            for name, why in skipped:
                logger.warning("Not resuming from %s, which is incomplete (%s); it is newer than %s, which is "
                               "complete.", name, why, folder.name)
            logger.info("Resuming from %s", folder)
            return str(folder)
        skipped.append((folder.name, "; ".join(problems)))
    listing = "\n".join(f"  {name}: {why}" for name, why in skipped)
    raise CheckpointError(
        f"--resume_from_checkpoint {asked}: none of the {len(skipped)} checkpoint folders in {output_dir} is complete "
        f"(a run killed while saving leaves such folders):\n{listing}\nStart a new run without "
        f"--resume_from_checkpoint, or restore a complete checkpoint folder.")


def resolve_resume_value(value: str | bool | None) -> str | bool | None:
    """`--resume_from_checkpoint` as given, or None where it means "do not resume" (unset, false, no, "")."""
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in ("", "false", "no")):
        return None
    return value


def resolve_resume_checkpoint(value: str | bool | None, output_dir: str | os.PathLike) -> str | None:
    """The checkpoint folder that `--resume_from_checkpoint value` should resume from, verified complete.

    Args:
        value: None/False/"" (do not resume); True or "true"/"last"/"latest" (the newest complete checkpoint in
            `output_dir`, skipping newer incomplete ones with a warning); a run folder holding `checkpoint-<step>`
            folders (its newest complete one); or one checkpoint folder (used if complete).
        output_dir: the run's `--output_dir`.
    Returns:
        the folder to pass to `Trainer.train(resume_from_checkpoint=...)`, or None.
    Raises:
        CheckpointError: no checkpoint at all, none complete, or the named folder is incomplete/missing; the message
            lists what is wrong and the newest complete alternative, if any.
    """
    if resolve_resume_value(value) is None:
        return None
    if value is True or (isinstance(value, str) and value.strip().lower() in _RESUME_LAST):
        return _newest_complete(Path(output_dir), str(value))
    folder = Path(value)
    if not folder.exists():
        raise CheckpointError(f"--resume_from_checkpoint {value}: no such folder. Pass a checkpoint-<step> folder, "
                              f"or 'last' for the newest complete checkpoint in --output_dir.")
    if not _CHECKPOINT_DIR.match(folder.name) and _checkpoints(folder):
        return _newest_complete(folder, str(value))
    problems = checkpoint_problems(folder)
    if problems:
        alternative = ""
        for other in _checkpoints(folder.parent):
            if other != folder and not checkpoint_problems(other):
                alternative = f" The newest complete checkpoint beside it is {other}; or pass 'last'."
                break
        raise CheckpointError(
            f"--resume_from_checkpoint {value}: this checkpoint is incomplete or damaged ({'; '.join(problems)}), "
            f"so resuming from it would not continue the run.{alternative}")
    return str(folder)


def check_model_folder(folder: str | os.PathLike, *, need_tokenizer: bool = True) -> None:
    """Refuse, with a clear message, a folder that is not a complete saved `vaswani` model (`vaswani_hf.checks.
    check_model_folder`: config.json valid and of model type `vaswani`, every JSON file parses, complete safetensors
    weights, a tokenizer of the model's size and special ids).

    Raises:
        CheckpointError: naming the file at fault and what to do.
    """
    try:
        _check_model_folder(folder, need_tokenizer=need_tokenizer)
    except CheckError as error:
        raise CheckpointError(str(error)) from None
