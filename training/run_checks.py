"""What the training and inference commands check before any long work, so that nothing is lost and nothing is silent:
flags mean what they say in either spelling, an output folder never holds another run's checkpoints unless asked,
averaging reads only this run's checkpoints, the Hub token is written nowhere, and a device that is not there is named.

Each check raises `GuardError` (a `ValueError`) naming what is wrong and what to do.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

from vaswani_hf.checks import CheckError, check_model_folder, check_output_dir, check_output_not_in_inputs, read_json

logger = logging.getLogger("vaswani_hf.training")

_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
# Files a finished or running training run leaves in its output_dir; a new run would overwrite or mix with them.
RUN_FILES = ("model.safetensors", "metrics.json", "trainer_state.json", "test_translations.txt")

__all__ = ["GuardError", "check_average_last", "check_device", "check_model_inputs", "check_run_output_dir",
           "current_run_checkpoints", "average_current_run", "given_flags", "strip_hub_token"]


class GuardError(CheckError):
    """A flag or folder that would lose data or silently do something else than asked."""


def given_flags(parser, argv: Sequence[str] | None) -> set[str]:
    """The option names (dests, underscored) given on the command line, whatever the spelling: `--max-steps 3`,
    `--max_steps=3` and `--no_x` all count. `parser.allow_abbrev` must be False (abbreviations would go uncounted)."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    actions = parser._option_string_actions  # argparse's own table of every spelling -> action
    given = set()
    for token in argv:
        if not token.startswith("--"):
            continue
        action = actions.get(token.split("=", 1)[0])
        if action is not None:
            given.add(action.dest)
        else:
            given.add(token.split("=", 1)[0].lstrip("-").replace("-", "_"))
    return given


def strip_hub_token(args) -> str | None:
    """Take the Hub token out of an arguments object (Trainer pickles its arguments into training_args.bin of the run
    and of every checkpoint) and return it, to be passed only to the upload call."""
    token = getattr(args, "hub_token", None)
    if token is not None:
        args.hub_token = None
    return token


def _checkpoints(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _CHECKPOINT_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def check_run_output_dir(output_dir: str | os.PathLike, *, resuming: bool, overwrite: bool,
                         inputs: dict[str, str | None] | None = None) -> None:
    """Refuse, before any work, an `--output_dir` that cannot be written, that is/contains/lies inside an input folder
    (`inputs`: flag -> path), or that holds another run (checkpoints, a model, metrics) when the run neither resumes
    nor passes `--overwrite_output_dir`. With `overwrite`, the earlier run's `checkpoint-<step>` folders are removed,
    so that neither resuming nor averaging nor Trainer's checkpoint rotation can mix them with the new run's."""
    output_dir = Path(output_dir)
    check_output_dir(output_dir, flag="--output_dir")
    for flag, path in (inputs or {}).items():
        if path and Path(path).exists():
            check_output_not_in_inputs(output_dir, [path], output_flag="--output_dir", input_flag=flag)
    if resuming or not output_dir.is_dir():
        return
    checkpoints = _checkpoints(output_dir)
    files = [name for name in RUN_FILES if (output_dir / name).exists()]
    if not checkpoints and not files:
        return
    if not overwrite:
        held = ", ".join([p.name for p in checkpoints[-3:]] + files)
        raise GuardError(
            f"--output_dir {output_dir} holds another run ({held}). A new run would overwrite its model and mix its "
            f"checkpoints with the new ones (resuming and --average_last would pick them up). Choose a new "
            f"--output_dir, continue that run with --resume_from_checkpoint last, or pass --overwrite_output_dir to "
            f"replace it.")
    for folder in checkpoints:
        logger.warning("--overwrite_output_dir: removing %s of the earlier run.", folder)
        shutil.rmtree(folder)


def check_average_last(average_last: int, *, save_total_limit: int | None, save_total_limit_given: bool,
                       saving: bool, max_steps: int | None, save_steps: int | float | None,
                       resuming: bool) -> int | None:
    """Check `--average_last N` before training instead of failing after it.

    Returns:
        the `save_total_limit` to use: raised to N where the user left it at its default, else unchanged.
    Raises:
        GuardError: N < 0; N > 0 with checkpoints off; an explicit --save_total_limit below N; a fresh run whose
            --max_steps and --save_steps write fewer than N checkpoints.
    """
    if isinstance(average_last, bool) or average_last < 0:
        raise GuardError(f"--average_last must be >= 0 (0: no averaging), got {average_last}.")
    if not average_last:
        return save_total_limit
    if not saving:
        raise GuardError(f"--average_last {average_last} averages saved checkpoints, but --save_strategy is 'no'; "
                         f"use --save_strategy steps.")
    if save_total_limit is not None and save_total_limit < average_last:
        if save_total_limit_given:
            raise GuardError(f"--average_last {average_last} needs at least {average_last} checkpoints kept, but "
                             f"--save_total_limit {save_total_limit} deletes all but {save_total_limit}. Pass "
                             f"--save_total_limit {average_last} or more (or lower --average_last).")
        save_total_limit = average_last
    if not resuming and max_steps and max_steps > 0 and save_steps and save_steps >= 1:
        written = math.ceil(max_steps / int(save_steps))  # the last step is always saved as well
        if written < average_last:
            raise GuardError(f"--average_last {average_last}: --max_steps {max_steps} with --save_steps "
                             f"{int(save_steps)} writes only {written} checkpoint(s). Lower --save_steps (at most "
                             f"{max(1, max_steps // average_last)}) or --average_last.")
    return save_total_limit


def current_run_checkpoints(output_dir: str | os.PathLike, *, started: float, resuming: bool) -> list[Path]:
    """The `checkpoint-<step>` folders of this run, oldest first: with `resuming`, all of them (they belong to the
    run being continued); otherwise only those saved since `started` (a `time.time()`), never an earlier run's."""
    found = _checkpoints(Path(output_dir))
    if resuming:
        return found

    def saved_at(folder: Path) -> float:
        times = [p.stat().st_mtime for p in folder.iterdir() if p.is_file()]
        return max(times) if times else 0.0

    return [folder for folder in found if saved_at(folder) >= started - 1.0]


def average_current_run(output_dir: str | os.PathLike, n: int, *, started: float, resuming: bool) -> list[Path]:
    """Average the last `n` checkpoints of this run (`current_run_checkpoints`) into `output_dir` (§6.1).

    Raises:
        GuardError: this run saved fewer than `n` checkpoints (e.g. stopped early by the clock).
    """
    from vaswani_hf.averaging import average_checkpoints, save_averaged_model

    mine = current_run_checkpoints(output_dir, started=started, resuming=resuming)
    if len(mine) < n:
        names = ", ".join(p.name for p in mine) or "none"
        raise GuardError(f"--average_last {n}: this run saved only {len(mine)} checkpoint(s) in {output_dir} ({names}); "
                         f"earlier runs' checkpoints are never averaged in. The unaveraged model is saved there; "
                         f"average what there is with vaswani-average --checkpoints ..., or train longer.")
    chosen = mine[-n:]
    save_averaged_model(average_checkpoints(chosen), chosen[-1], output_dir, sources=chosen)
    return chosen


def check_device(name: str | None) -> str:
    """The torch device for `--device name` (default: cuda where available, else cpu).

    Raises:
        GuardError: an unknown device name, or a CUDA/MPS device this torch or machine does not have.
    """
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as error:
        raise GuardError(f"--device {name}: not a device name ({error}); use cpu, cuda, cuda:1 or mps.") from None
    if device.type == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise GuardError(f"--device {name}: this torch ({torch.__version__}) is built without CUDA. Use --device "
                             f"cpu, or install a CUDA build of torch (https://pytorch.org/get-started/locally/).")
        if not torch.cuda.is_available():
            raise GuardError(f"--device {name}: no CUDA GPU is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES), "
                             f"or use --device cpu.")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise GuardError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible.")
    elif device.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise GuardError(f"--device {name}: MPS is not available on this machine; use --device cpu.")
    return name


def check_model_inputs(model_name_or_path: str | None, tokenizer_name: str | None,
                       config_overrides: str | None) -> None:
    """Before data preparation: --config_overrides cannot apply to a saved model (refused, not ignored); a local
    --model_name_or_path is a complete vaswani folder (`check_model_folder`); every JSON file of a local
    --tokenizer_name parses (errors name the file)."""
    if config_overrides and model_name_or_path:
        raise GuardError(f"--config_overrides {config_overrides!r} cannot apply to --model_name_or_path "
                         f"{model_name_or_path}: a saved model keeps the config it was trained with. Drop "
                         f"--config_overrides to continue that model, or drop --model_name_or_path to train a new one.")
    if model_name_or_path and (Path(model_name_or_path).exists() or not _looks_like_hub_id(model_name_or_path)):
        check_model_folder(model_name_or_path, need_tokenizer=not tokenizer_name)
    if tokenizer_name and (Path(tokenizer_name).exists() or not _looks_like_hub_id(tokenizer_name)):
        folder = Path(tokenizer_name)
        if not folder.is_dir():
            raise GuardError(f"--tokenizer_name {tokenizer_name}: no such folder.")
        if not (folder / "tokenizer.json").is_file():
            raise GuardError(f"--tokenizer_name {tokenizer_name}: no tokenizer.json in it; pass a folder saved with "
                             f"tokenizer.save_pretrained().")
        for path in sorted(folder.glob("*.json")):
            read_json(path)


def _looks_like_hub_id(name: str) -> bool:
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", name)) and not name.startswith((".", "/"))
