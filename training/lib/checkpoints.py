"""Checkpoints and resuming: finding a run's `checkpoint-<step>` folders, checking that one is complete, resolving
`--resume_from_checkpoint` to a complete checkpoint with finite weights of a run with the same settings, and averaging
the run's own last checkpoints (`--average_last`, §6.1).

Every check raises `vaswani_hf.checks.CheckError` (a `ValueError`) naming the flag or folder at fault, what is wrong
and what to do.

A run writes a `checkpoint-<step>` folder file after file: Trainer (transformers 5 `Trainer._save_checkpoint`) writes
weights, then optimizer and scheduler, then RNG state, then `trainer_state.json`, in place, so a run killed while saving
leaves a folder that is there but incomplete, and transformers' `get_last_checkpoint` picks the newest folder whatever
it holds. `resolve_resume_checkpoint` picks the newest *complete* one instead and says which incomplete ones it skipped.
The accelerate loop (`train_no_trainer.py`) writes `accelerator.save_state` files (`optimizer.bin`, `scheduler.bin`,
`random_states_<rank>.pkl`) into a temporary folder that it renames when complete; the same check applies to it.

A checkpoint is complete when it holds every file of its layout and each can be read to its end: the safetensors
header describes exactly the bytes in the file, the `torch.save` files (zip archives) pass their CRC checks, and
`trainer_state.json` parses and names the folder's step. The contents are never unpickled here. A complete checkpoint
whose weights hold NaN or infinite values (the run diverged) is never resumed from.

Each checkpoint also carries `vaswani_run.json` (`RUN_SETTINGS`): the settings that must not change when the run is
resumed (preset, batch tokens, schedule, starting model, languages). `check_resume_settings` compares them with the
resuming command's before any work.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vaswani_hf.averaging import find_checkpoints
from vaswani_hf.checks import CheckError, nonfinite_weights, read_json, weights_problems

from .output_dir import write_json_atomic
from .presets import parse_overrides

if TYPE_CHECKING:
    from .state import Run

logger = logging.getLogger("vaswani_hf.training")

__all__ = ["CHECKPOINT_FILES", "PLAN_FILE", "RUN_SETTINGS", "average_current_run", "average_into",
           "check_average_last", "check_average_last_resumed", "check_resume_settings", "checkpoint_problems",
           "checkpoint_step", "current_run_checkpoints", "expected_model_fields", "resolve_resume_checkpoint",
           "resolve_resume_value", "run_settings", "training_ended_at", "write_run_settings"]

# The files of a complete checkpoint, by the loop that writes it ("trainer": train.py, "accelerate":
# train_no_trainer.py); `rng_state_<rank>.pth` files stand for `rng_state.pth` after a multi-process Trainer run.
CHECKPOINT_FILES = {
    "trainer": ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"),
    "accelerate": ("model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "trainer_state.json"),
}
_OTHER_LOOP = {"trainer": ("optimizer.bin", "train_no_trainer.py"), "accelerate": ("optimizer.pt", "train.py")}
_CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")
_RESUME_LAST = ("true", "last", "latest")
# The settings of a run that a resumed run must share, written into every checkpoint.
RUN_SETTINGS = "vaswani_run.json"
# The plan of a budgeted run at a checkpoint (`planner.BudgetPlanner.checkpoint_record`): whether training ended there
PLAN_FILE = "vaswani_plan.json"
# Config fields that give a model its shape: a resumed run must build the same.
_SHAPE_FIELDS = ("d_model", "encoder_layers", "decoder_layers", "num_heads", "d_ff", "position_embedding_type",
                 "normalize_before", "share_encoder_decoder_embeddings", "activation_function")


# -- finding checkpoints -----------------------------------------------------------------------------------------------


def _checkpoint_folders(folder: Path) -> list[Path]:
    """`checkpoint-<step>` folders directly under `folder`, oldest (lowest step) first; none if it is no folder."""
    return find_checkpoints(folder) if folder.is_dir() else []


def checkpoint_step(folder: str | os.PathLike) -> int | None:
    """The step of a `checkpoint-<step>` folder, from its name; None for another name."""
    match = _CHECKPOINT_NAME.fullmatch(Path(folder).name)
    return int(match.group(1)) if match else None


# -- checking a checkpoint ---------------------------------------------------------------------------------------------


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


def checkpoint_problems(folder: str | os.PathLike, *, layout: str = "trainer") -> list[str]:
    """What makes `folder` unusable for resuming training; an empty list for a complete checkpoint.

    `layout`: "trainer" (a Seq2SeqTrainer checkpoint of train.py) or "accelerate" (`accelerator.save_state` of
    train_no_trainer.py); see `CHECKPOINT_FILES`. A checkpoint of the other loop is named as such.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return [f"{folder} is not a folder"]
    other_file, other_loop = _OTHER_LOOP[layout]
    if (folder / other_file).is_file() and not (folder / CHECKPOINT_FILES[layout][1]).is_file():
        return [f"it is a checkpoint of {other_loop} (it holds {other_file}): resume it with {other_loop}"]
    problems = weights_problems(folder)
    _, optimizer, scheduler, rng, _ = CHECKPOINT_FILES[layout]
    problems += [problem for name in (optimizer, scheduler) if (problem := _zip_problem(folder / name))]
    if layout == "trainer":
        rng_files = sorted(folder.glob("rng_state_*.pth")) or [folder / rng]
    else:
        rng_files = sorted(folder.glob("random_states_*.pkl")) or [folder / rng]
    problems += [problem for path in rng_files if (problem := _zip_problem(path))]
    state_path = folder / "trainer_state.json"
    if not state_path.is_file():
        problems.append("trainer_state.json is missing (it is written last, so the save did not finish)")
    else:
        try:
            step = json.loads(state_path.read_text(encoding="utf-8"))["global_step"]
        except (OSError, ValueError, KeyError, TypeError):
            problems.append("trainer_state.json is truncated or unreadable")
        else:
            match = _CHECKPOINT_NAME.fullmatch(folder.name)
            if match and int(match.group(1)) != step:
                problems.append(f"trainer_state.json is for step {step}, not {match.group(1)}")
    return problems


def _check_finite(folder: Path, asked: str, layout: str) -> None:
    """Refuse a checkpoint whose weights hold NaN or infinite values: resuming it would log NaN losses to the end and
    replace the run's model and metrics with a broken one.

    Raises:
        CheckError: naming the checkpoint, the tensors, and the newest earlier checkpoint with finite weights.
    """
    bad = nonfinite_weights(folder)
    if not bad:
        return
    earlier = ""
    for other in _checkpoint_folders(folder.parent)[::-1]:
        step, this = checkpoint_step(other), checkpoint_step(folder)
        if step is not None and this is not None and step < this and not checkpoint_problems(other, layout=layout) \
                and not nonfinite_weights(other):
            earlier = (f" The newest earlier checkpoint with finite weights is {other}: resume from it "
                       f"(--resume_from_checkpoint {other}), with a lower --lr_factor or more --warmup_steps.")
            break
    raise CheckError(
        f"--resume_from_checkpoint {asked}: the weights of {folder} hold NaN or infinite values ({len(bad)} tensor(s): "
        f"{', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}): the run diverged before this checkpoint was saved, "
        f"and resuming it would train on NaN.{earlier or ' Start a new run with a lower --lr_factor.'}")


# -- resuming ----------------------------------------------------------------------------------------------------------


def _newest_complete(output_dir: Path, asked: str, layout: str) -> str:
    candidates = _checkpoint_folders(output_dir)[::-1]
    if not candidates:
        raise CheckError(
            f"--resume_from_checkpoint {asked}: no checkpoint-<step> folder in {output_dir}, so there is nothing to "
            f"resume. Check --output_dir, or drop --resume_from_checkpoint to start a new run.")
    skipped = []
    for folder in candidates:
        problems = checkpoint_problems(folder, layout=layout)
        if not problems:
            _check_finite(folder, asked, layout)
            for name, why in skipped:
                logger.warning("Not resuming from %s, which is incomplete (%s); it is newer than %s, which is "
                               "complete.", name, why, folder.name)
            logger.info("Resuming from %s", folder)
            return str(folder)
        skipped.append((folder.name, "; ".join(problems)))
    listing = "\n".join(f"  {name}: {why}" for name, why in skipped)
    raise CheckError(
        f"--resume_from_checkpoint {asked}: none of the {len(skipped)} checkpoint folders in {output_dir} is complete "
        f"(a run killed while saving leaves such folders):\n{listing}\nStart a new run without "
        f"--resume_from_checkpoint, or restore a complete checkpoint folder.")


def resolve_resume_value(value: str | bool | None) -> str | bool | None:
    """`--resume_from_checkpoint` as given, or None where it means "do not resume" (unset, false, no, "")."""
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in ("", "false", "no")):
        return None
    return value


def resolve_resume_checkpoint(value: str | bool | None, output_dir: str | os.PathLike, *,
                              layout: str = "trainer") -> str | None:
    """The checkpoint folder that `--resume_from_checkpoint value` should resume from, verified complete.

    Args:
        value: None/False/"" (do not resume); True or "true"/"last"/"latest" (the newest complete checkpoint in
            `output_dir`, skipping newer incomplete ones with a warning); a run folder holding `checkpoint-<step>`
            folders (its newest complete one); or one checkpoint folder (used if complete).
        output_dir: the run's `--output_dir`.
        layout: "trainer" or "accelerate", the loop that resumes (`checkpoint_problems`).
    Returns:
        the folder to resume from, or None.
    Raises:
        CheckError: no checkpoint at all, none complete, the named folder is incomplete/missing, or the checkpoint's
            weights hold NaN or infinite values; the message lists what is wrong and the alternative, if any.
    """
    if resolve_resume_value(value) is None:
        return None
    if value is True or (isinstance(value, str) and value.strip().lower() in _RESUME_LAST):
        return _newest_complete(Path(output_dir), str(value), layout)
    folder = Path(value)
    if not folder.exists():
        raise CheckError(f"--resume_from_checkpoint {value}: no such folder. Pass a checkpoint-<step> folder, "
                         f"or 'last' for the newest complete checkpoint in --output_dir.")
    if not _CHECKPOINT_NAME.fullmatch(folder.name) and _checkpoint_folders(folder):
        return _newest_complete(folder, str(value), layout)
    problems = checkpoint_problems(folder, layout=layout)
    if problems:
        alternative = ""
        for other in _checkpoint_folders(folder.parent)[::-1]:
            if other != folder and not checkpoint_problems(other, layout=layout):
                alternative = f" The newest complete checkpoint beside it is {other}; or pass 'last'."
                break
        raise CheckError(
            f"--resume_from_checkpoint {value}: this checkpoint is incomplete or damaged ({'; '.join(problems)}), "
            f"so resuming from it would not continue the run.{alternative}")
    _check_finite(folder, str(value), layout)
    return str(folder)


def training_ended_at(checkpoint: str | os.PathLike, max_steps: int) -> dict | None:
    """Where a run's training ended at `checkpoint`: `{"step", "cooldown_from", "cooldown_checkpoint_every"}` when its
    step (`trainer_state.json`) reached `max_steps` (the resuming command's), or its `PLAN_FILE` says the plan or the
    time budget ended training there; `None` where the run stopped before its end (a signal, `--max_train_minutes`)
    and resuming continues it."""
    folder = Path(checkpoint)
    state = read_json(folder / "trainer_state.json") if (folder / "trainer_state.json").is_file() else None
    plan = read_json(folder / PLAN_FILE) if (folder / PLAN_FILE).is_file() else None
    plan = plan if isinstance(plan, dict) else {}
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        return None
    step = state["global_step"]
    if not (plan.get("ended") and plan.get("step") == step) and not 0 < max_steps <= step:
        return None
    return {"step": step, "cooldown_from": plan.get("cooldown_from"),
            "cooldown_checkpoint_every": plan.get("cooldown_checkpoint_every")}


# -- the settings a resumed run shares ---------------------------------------------------------------------------------


def _as_given_path(name: str | None) -> str | None:
    """A local path made absolute (the same folder given from another working directory compares equal); a Hub id as
    given."""
    if name and Path(name).exists():
        return str(Path(name).resolve())
    return name


def run_settings(run: Run) -> dict[str, Any]:
    """The settings a resumed run must share with the run it continues, as written into every checkpoint
    (`RUN_SETTINGS`): the preset, the model and tokenizer it starts from, --config_overrides, batch
    tokens, the schedule's lr factor and warmup, the languages and lengths."""
    return {
        "preset": run.model_args.preset,
        "model_name_or_path": _as_given_path(run.model_args.model_name_or_path),
        "tokenizer_name": _as_given_path(run.model_args.tokenizer_name),
        "config_overrides": parse_overrides(run.model_args.config_overrides),
        "max_tokens": run.plan.max_tokens,
        "lr_factor": run.plan.lr_factor,
        "warmup_steps": run.plan.warmup_steps,
        "source_lang": run.data_args.source_lang,
        "target_lang": run.data_args.target_lang,
        "max_source_length": run.data_args.max_source_length,
        "max_target_length": run.data_args.max_target_length,
    }


def expected_model_fields(run: Run) -> dict[str, Any] | None:
    """The shape fields (`_SHAPE_FIELDS`) of the model this command builds from its preset and --config_overrides;
    None where it starts from --model_name_or_path (that model's config decides)."""
    if run.model_args.model_name_or_path:
        return None
    from vaswani_hf import VaswaniConfig

    config = VaswaniConfig(**{**run.preset["model"], **parse_overrides(run.model_args.config_overrides)}).to_dict()
    return {key: config[key] for key in _SHAPE_FIELDS if key in config}


def write_run_settings(run: Run, checkpoint: str | os.PathLike) -> None:
    """Write `run_settings(run)` into a checkpoint folder (`RUN_SETTINGS`), atomically."""
    write_json_atomic(Path(checkpoint) / RUN_SETTINGS, run_settings(run))


def check_resume_settings(checkpoint: str | os.PathLike, settings: dict, *, model_config: dict | None = None) -> None:
    """Refuse to resume `checkpoint` with settings other than its run's: `settings` (this command's, as
    `run_settings` gives them) against the checkpoint's `vaswani_run.json`; where a checkpoint has no such
    file, the model's shape in its config.json against `model_config` (the config fields this command would build).

    Raises:
        CheckError: naming each setting, the run's value and this command's, and what to pass.
    """
    checkpoint = Path(checkpoint)
    saved_path = checkpoint / RUN_SETTINGS
    differing = []
    if saved_path.is_file():
        saved = read_json(saved_path)
        if isinstance(saved, dict):
            for key, value in settings.items():
                if key in saved and saved[key] != value:
                    differing.append((key, saved[key], value))
    elif model_config:
        config = read_json(checkpoint / "config.json")
        for key, value in model_config.items():
            if isinstance(config, dict) and key in config and config[key] != value:
                differing.append((f"config {key}", config[key], value))
    if differing:
        listing = "; ".join(f"{key if key.startswith('config ') else '--' + key}: the run has {old!r}, this command "
                            f"{new!r}" for key, old, new in differing)
        raise CheckError(
            f"--resume_from_checkpoint {checkpoint}: this command's settings differ from the run's ({listing}). A "
            f"resumed run must continue with its own model, batches and schedule: pass the run's values (see "
            f"{saved_path.name if saved_path.is_file() else 'config.json'} in the checkpoint), or start a new run in "
            f"another --output_dir.")


# -- averaging the run's checkpoints -----------------------------------------------------------------------------------


def check_average_last(average_last: int, *, save_total_limit: int | None, save_total_limit_given: bool,
                       saving: bool, max_steps: int | None, save_steps: int | float | None,
                       resuming: bool) -> int | None:
    """Check `--average_last N` against the checkpoints the run will keep, before any work (§6.1 averages the last 5
    or 20 checkpoints; fewer kept would average fewer without a word).

    Returns:
        the `save_total_limit` to use: a default below N is raised to N (an explicit one is refused instead).

    Raises:
        CheckError: N < 0; N > 0 with checkpoints off; an explicit --save_total_limit below N; a fresh run whose
            --max_steps and --save_steps write fewer than N checkpoints.
    """
    if average_last < 0:
        raise CheckError(f"--average_last must be >= 0 (0: no averaging), got {average_last}.")
    if not average_last:
        return save_total_limit
    if not saving:
        raise CheckError(f"--average_last {average_last} averages saved checkpoints, but --save_strategy is 'no'; "
                         f"use --save_strategy steps.")
    if save_total_limit is not None and save_total_limit < average_last:
        if save_total_limit_given:
            raise CheckError(f"--average_last {average_last} needs at least {average_last} checkpoints kept, but "
                             f"--save_total_limit {save_total_limit} deletes all but {save_total_limit}. Pass "
                             f"--save_total_limit {average_last} or more (or lower --average_last).")
        save_total_limit = average_last
    if not resuming and max_steps and max_steps > 0 and save_steps and save_steps >= 1:
        written = math.ceil(max_steps / int(save_steps))  # the last step is always saved as well
        if written < average_last:
            raise CheckError(f"--average_last {average_last}: --max_steps {max_steps} with --save_steps "
                             f"{int(save_steps)} writes only {written} checkpoint(s). Lower --save_steps (at most "
                             f"{max(1, max_steps // average_last)}) or --average_last.")
    return save_total_limit


def check_average_last_resumed(average_last: int, *, resume_from: str | os.PathLike, output_dir: str | os.PathLike,
                               max_steps: int | None, save_steps: int | float | None,
                               save_total_limit: int | None) -> None:
    """`--average_last N` of a resumed run, before any work: the checkpoints it will hold at the end (those in
    `output_dir` now and those saved from the resumed step to `max_steps`, at most `save_total_limit`) must be at least
    N, or averaging would fail after the training.

    Raises:
        CheckError: fewer than N, with the counts and the flags that change them.
    """
    step = checkpoint_step(resume_from)
    if not average_last or step is None or not max_steps or max_steps < 0 or not save_steps or save_steps < 1:
        return
    every = int(save_steps)
    present = {checkpoint_step(p) for p in _checkpoint_folders(Path(output_dir))} | {step}
    new = set(range(every * (step // every + 1), max_steps + 1, every))
    if max_steps > step:
        new.add(max_steps)  # the last step is always saved
    kept = len(present | new)
    if save_total_limit:
        kept = min(kept, save_total_limit)
    if kept < average_last:
        raise CheckError(
            f"--average_last {average_last}: resuming {Path(resume_from).name} to --max_steps {max_steps} with "
            f"--save_steps {every} leaves {kept} checkpoint(s) in {output_dir} to average. Lower --average_last to "
            f"{kept} or less, raise --max_steps, or lower --save_steps.")


def current_run_checkpoints(output_dir: str | os.PathLike, *, started: float, resuming: bool) -> list[Path]:
    """The `checkpoint-<step>` folders of this run, oldest first: with `resuming`, all of them (they belong to the
    run being continued); otherwise only those saved since `started` (a `time.time()`), never an earlier run's."""
    found = _checkpoint_folders(Path(output_dir))
    if resuming:
        return found

    def saved_at(folder: Path) -> float:
        times = [p.stat().st_mtime for p in folder.iterdir() if p.is_file()]
        return max(times) if times else 0.0

    return [folder for folder in found if saved_at(folder) >= started - 1.0]


def average_current_run(output_dir: str | os.PathLike, n: int, *, started: float, resuming: bool) -> list[Path]:
    """Average the last `n` checkpoints of this run (`current_run_checkpoints`) into `output_dir` (§6.1).

    Raises:
        CheckError: this run saved fewer than `n` checkpoints (e.g. stopped early by the clock).
    """
    from vaswani_hf.averaging import average_checkpoints, save_averaged_model

    mine = current_run_checkpoints(output_dir, started=started, resuming=resuming)
    if len(mine) < n:
        names = ", ".join(p.name for p in mine) or "none"
        raise CheckError(f"--average_last {n}: this run saved only {len(mine)} checkpoint(s) in {output_dir} "
                         f"({names}); earlier runs' checkpoints are never averaged in. The unaveraged model is saved "
                         f"there; average what there is with vaswani-average --checkpoints ..., or train longer.")
    chosen = mine[-n:]
    save_averaged_model(average_checkpoints(chosen), chosen[-1], output_dir, sources=chosen, in_place=True)
    return chosen


def average_into(run: Run, model) -> None:
    """With `--average_last N`, on the main process once the final model is saved in --output_dir: average this run's
    last N checkpoints into --output_dir (§6.1; never an earlier run's) and load the average into `model`, which the
    test set then scores.

    Raises:
        CheckError: this run saved fewer than N checkpoints.
    """
    n = run.recipe.average_last
    if not n:
        return
    from vaswani_hf import VaswaniForConditionalGeneration

    average_current_run(run.output_dir, n, started=run.plan.started, resuming=run.plan.resuming)
    model.load_state_dict(VaswaniForConditionalGeneration.from_pretrained(run.output_dir).state_dict(), strict=True)
    logger.info("Averaged the last %d checkpoints into %s", n, run.output_dir)
