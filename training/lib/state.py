"""The state a training run carries from its flags to its end: its plan (`RunPlan`), the run itself (`Run`) and where
its export is uploaded (`HubPush`). Every part of the run's machinery reads it; it imports none of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .arguments import DataArguments, ModelArguments, RecipeArguments


@dataclass
class RunPlan:
    """What a training run does, resolved once from its flags and its preset before any work.

    Attributes:
        max_steps: parameter updates to train (fewer where the time budget or the clock stops the run).
        warmup_steps: warmup updates of the schedule (§5.3, Eq. 3), at least 1.
        max_tokens: token budget of one batch on one device, padding included (§5.1).
        lr_factor: the factor of Eq. 3.
        budget_minutes: the whole command's time budget, start to test BLEU (None: none).
        max_train_minutes: a plain clock stop for training (None: none).
        resuming: the run continues a checkpoint (`--resume_from_checkpoint`).
        precision, precision_reason: what the run computes in ("fp32", "bf16 autocast", "fp16 autocast") and why.
        started: `time.time()` when the run was planned; averaging reads only checkpoints saved since.
        resume_from: the checkpoint folder a resumed run continues (set by `check_inputs`).
    """

    max_steps: int
    warmup_steps: int
    max_tokens: int
    lr_factor: float
    budget_minutes: float | None = None
    max_train_minutes: float | None = None
    resuming: bool = False
    precision: str = "fp32"
    precision_reason: str = ""
    started: float = field(default_factory=time.time)
    resume_from: str | None = None


@dataclass
class Run:
    """A training command's shared flags, its preset and its plan: what every step of the scaffold reads."""

    model_args: ModelArguments
    data_args: DataArguments
    recipe: RecipeArguments
    preset: dict[str, Any]
    plan: RunPlan
    output_dir: Path
    resume_value: str | bool | None = None  # --resume_from_checkpoint as given
    train_pairs: int | None = None  # the training pairs the run trains on (set by `prepare`; None for a stream)
    train_pairs_left_out: int | None = None  # read but left out, longer than the limits (--drop_long_pairs)


@dataclass
class HubPush:
    """Where `--push_to_hub` uploads the run's Hub-ready export at the end (`lib/publishing.py`)."""

    repo_id: str | None
    token: str | None = None
    private: bool | None = None
    endpoint: str | None = None
