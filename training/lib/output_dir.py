"""The output folder of a command: a training run claims its `--output_dir` (writable, locked against a second run by
`RunLock`, holding no other run: `claim_output_dir`) and moves an earlier run's results aside before it writes new
weights (`retire_previous_results`); the commands write their output files atomically (`write_json_atomic`,
`write_lines_atomic`).

Atomic writes: a reader never sees a half-written output file, and a failure or a kill in the middle of a write leaves
the previous file as it was (a temporary file in the same folder, then `os.replace`). The file gets the mode `open()`
gives under the user's umask (`tempfile` makes it 0600; `vaswani_hf.checks.follow_umask`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from vaswani_hf.averaging import find_checkpoints
from vaswani_hf.checks import (
    CheckError,
    check_output_dir,
    check_output_not_in_inputs,
    read_json,
    replace_file_atomically,
    weights_fingerprint,
)

if TYPE_CHECKING:
    from .state import Run

logger = logging.getLogger("vaswani_hf.training")

__all__ = ["LOCK_NAME", "RESULT_FILES", "RUN_FILES", "RunLock", "check_run_output_dir", "claim_output_dir",
           "retire_previous_results", "write_json_atomic", "write_lines_atomic"]

# The file in a folder whose flock says a run is writing that folder (`RunLock`).
LOCK_NAME = ".vaswani.lock"
# Files a finished or running training run leaves in its output_dir; a new run would overwrite or mix with them.
RUN_FILES = ("model.safetensors", "metrics.json", "trainer_state.json", "test_translations.txt")


# -- claiming the folder -----------------------------------------------------------------------------------------------


class RunLock:
    """An exclusive lock on `<folder>/.vaswani.lock` for as long as a run writes `folder`; a second run into the same
    folder is refused at once instead of both overwriting each other's checkpoints and both exiting 0.

    The lock is an `fcntl.flock` held by the open file, so the kernel releases it when the process ends, even after
    SIGKILL; a stale lock file does not block the next run. Where `fcntl` does not exist (Windows) there is no lock.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self._handle = None
        self._created = False

    def acquire(self) -> RunLock:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not on Linux/macOS
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        self._created = not self.path.exists()
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            raise CheckError(f"{self.folder}: another run is writing this folder ({holder or 'process unknown'}; lock "
                             f"{self.path}). Wait for it to finish, or choose another --output_dir.") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        self._handle = handle
        return self

    def release(self, *, remove: bool = False) -> None:
        """Release the lock; `remove`: also delete the lock file if this lock created it (a run refused before it
        wrote anything leaves the folder as it found it)."""
        if self._handle is not None:
            if remove and self._created:
                self.path.unlink(missing_ok=True)
            self._handle.close()  # closing the file releases the flock
            self._handle = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def check_run_output_dir(output_dir: str | os.PathLike, *, resuming: bool, overwrite: bool,
                         inputs: dict[str, str | None] | None = None) -> None:
    """Refuse, before any work, an `--output_dir` that cannot be written, that is/contains/lies inside an input folder
    (`inputs`: flag -> path), or that holds another run (checkpoints, a model, metrics) when the run neither resumes
    nor passes `--overwrite_output_dir`. With `overwrite`, the earlier run's `checkpoint-<step>` folders are removed,
    so that neither resuming nor averaging nor Trainer's checkpoint rotation can mix them with the new run's.

    Raises:
        CheckError: naming the folder, what it holds and the three ways on.
    """
    output_dir = Path(output_dir)
    check_output_dir(output_dir, flag="--output_dir")
    for flag, path in (inputs or {}).items():
        if path and Path(path).exists():
            check_output_not_in_inputs(output_dir, [path], output_flag="--output_dir", input_flag=flag)
    if resuming or not output_dir.is_dir():
        return
    checkpoints = find_checkpoints(output_dir)
    files = [name for name in RUN_FILES if (output_dir / name).exists()]
    if not checkpoints and not files:
        return
    if not overwrite:
        held = ", ".join([p.name for p in checkpoints[-3:]] + files)
        raise CheckError(
            f"--output_dir {output_dir} holds another run ({held}). A new run would overwrite its model and mix its "
            f"checkpoints with the new ones (resuming and --average_last would pick them up). Choose a new "
            f"--output_dir, continue that run with --resume_from_checkpoint last, or pass --overwrite_output_dir to "
            f"replace it.")
    for folder in checkpoints:
        logger.warning("--overwrite_output_dir: removing %s of the earlier run.", folder)
        shutil.rmtree(folder)


@contextmanager
def claim_output_dir(run: Run, *, main_process: bool) -> Iterator[None]:
    """Hold `--output_dir` for the run: on the main process it must be writable, is locked (`RunLock`: a second run
    into it is refused at once) and must hold no other run (`check_run_output_dir`). A refused run leaves the folder
    as it found it, and so does a run whose data is refused (a `CheckError` inside the block) before it wrote anything:
    the lock file goes, and the folder too where the run made it and it is empty. The other processes only wait for the
    main one at their first collective step.

    Raises:
        CheckError: a folder that cannot be written, is in use, or holds another run.
    """
    lock = None
    made = not run.output_dir.exists()
    if main_process:
        check_output_dir(run.output_dir, flag="--output_dir")
        lock = RunLock(run.output_dir).acquire()
        try:
            check_run_output_dir(run.output_dir, resuming=run.plan.resuming, overwrite=run.recipe.overwrite_output_dir,
                                 inputs={"--model_name_or_path": run.model_args.model_name_or_path,
                                         "--tokenizer_name": run.model_args.tokenizer_name})
        except CheckError:
            lock.release(remove=True)
            raise
    try:
        yield
    except CheckError:
        if lock is not None:
            lock.release(remove=True)
            if made and run.output_dir.is_dir() and not any(run.output_dir.iterdir()):
                run.output_dir.rmdir()
        raise
    finally:
        if lock is not None:
            lock.release()


# -- an earlier run's results ------------------------------------------------------------------------------------------


# Files of a finished run that describe its model: a run that writes new weights moves them aside first.
RESULT_FILES = ("metrics.json", "test_translations.txt", "test_metrics.json")


def retire_previous_results(run: Run) -> list[Path]:
    """Before a run writes its final model into --output_dir: rename an earlier run's `metrics.json`,
    `test_translations.txt` and `test_metrics.json` there to `<name>.step-<N><suffix>` (N: the step their metrics
    name), so that they are kept but never stand beside weights they do not describe, even if this run is stopped
    before it writes its own.

    Returns:
        the renamed files' new paths.
    """
    folder = run.output_dir
    present = [folder / name for name in RESULT_FILES if (folder / name).is_file()]
    if not present:
        return []
    step = None
    for path in present:
        if path.suffix == ".json":
            try:
                step = read_json(path).get("train_steps")
            except (CheckError, AttributeError):
                continue
            if step is not None:
                break
    tag = f"step-{step}" if isinstance(step, int) else time.strftime("%Y%m%d-%H%M%S",
                                                                      time.localtime(present[0].stat().st_mtime))
    moved = []
    for path in present:
        target = path.with_name(f"{path.stem}.{tag}{path.suffix}")
        n = 1
        while target.exists():
            n += 1
            target = path.with_name(f"{path.stem}.{tag}-{n}{path.suffix}")
        os.replace(path, target)
        moved.append(target)
        logger.info("Moved the earlier %s aside to %s: it describes other weights than this run's.", path.name,
                    target.name)
    return moved


# -- atomic writes -----------------------------------------------------------------------------------------------------


def finished_metrics(run: Run, step: int) -> dict[str, Any] | None:
    """The metrics.json of a run in --output_dir that finished: trained to `step`, then chose, scored and wrote the
    metrics of the weights that lie there (their fingerprint, `weights_sha256`); `None` where it stopped before."""
    path = run.output_dir / "metrics.json"
    try:
        metrics = read_json(path) if path.is_file() else None
    except CheckError:  # a damaged file is an unfinished run: it is retired and written again
        return None
    if not isinstance(metrics, dict) or metrics.get("train_steps") != step or "command_minutes" not in metrics:
        return None
    try:
        return metrics if metrics.get("weights_sha256") == weights_fingerprint(run.output_dir) else None
    except (OSError, CheckError):
        return None


def _write_atomic(path: str | os.PathLike, write: Callable[[TextIO], None]) -> None:
    """`write(handle)` into a hidden temporary file beside `path` (".<name>.*.tmp"), then rename it to `path`."""
    def write_text(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            write(handle)

    replace_file_atomically(path, write_text)


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write `data` as indented UTF-8 JSON to `path`, atomically."""

    def write(handle: TextIO) -> None:
        json.dump(data, handle, indent=2, ensure_ascii=False)
        handle.write("\n")

    _write_atomic(path, write)


def write_lines_atomic(path: str | os.PathLike, lines: Iterable[str]) -> None:
    """Write one line per item of `lines` to `path`, atomically (a failing iterator leaves the old file)."""
    _write_atomic(path, lambda handle: handle.writelines(line + "\n" for line in lines))
