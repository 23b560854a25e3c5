"""Dropout that follows the planned length of a run: a run that fits many updates in its time budget trains with more.

The `cpu` preset's budget gives about 3,500-4,200 updates where a CPU computes in fp32 and 5,000-6,000 where it has
native bf16. At 5,000-5,945 updates, dropout on the attention probabilities and after the FFN's ReLU (0.1 each, which
the paper does not use, §5.4) scored higher on validation than the paper's residual dropout alone, in each of three
pairs of runs of one seed; at the fp32 path's step counts it was not measured (docs/results.md, "Dropout at 1,024-token
batches"). So the preset names the extra dropout and the number of updates the first plan must reach for it
(`long_run_dropout`), and `LongRunDropout` sets it on the model once the `BudgetPlanner` has made that plan (after 12
of the run's thousands of updates). The first plan, timed on the slower first steps, runs under the steps a run ends
with, hence a threshold below the step counts measured.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn
from transformers import TrainerCallback

from .presets import parse_overrides

DROPOUT_FIELDS = ("dropout", "attention_dropout", "activation_dropout")


def _check_probabilities(probabilities: dict[str, float], who: str) -> None:
    """Raise ValueError for a field that is not in `DROPOUT_FIELDS` or a value outside [0, 1)."""
    for name, p in probabilities.items():
        if name not in DROPOUT_FIELDS:
            raise ValueError(f"{who}: {name!r} is not a dropout field; use one of {', '.join(DROPOUT_FIELDS)}.")
        if not 0.0 <= float(p) < 1.0:
            raise ValueError(f"{who}: {name}={p!r} is not a probability in [0, 1).")


def set_dropout(model: nn.Module, **probabilities: float) -> None:
    """Set dropout probabilities of a built `VaswaniModel`/`VaswaniForConditionalGeneration` in place, in its config
    and in every module that read them at construction, so that the model computes as one built with them.

    Args:
        model: the model (plain or with the fast paths installed).
        probabilities: any of `dropout` (§5.4: sublayer outputs and embedding sums), `attention_dropout` (attention
            probabilities), `activation_dropout` (after the FFN's ReLU), each in [0, 1).
    Raises:
        ValueError: an unknown field or a probability outside [0, 1).
    """
    from vaswani_hf.modeling_vaswani import VaswaniAttention

    _check_probabilities(probabilities, "set_dropout")
    for name, p in probabilities.items():
        setattr(model.config, name, float(p))
    for module in model.modules():
        if isinstance(module, VaswaniAttention):  # its `dropout` is the attention probabilities' (a float)
            if "attention_dropout" in probabilities:
                module.dropout = float(probabilities["attention_dropout"])
            continue
        for name in ("dropout", "activation_dropout"):
            if name in probabilities and isinstance(getattr(module, name, None), nn.Dropout):
                getattr(module, name).p = float(probabilities[name])


class LongRunDropout(TrainerCallback):
    """A `TrainerCallback` that sets `probabilities` (`set_dropout`) when the `planner`'s first plan reaches
    `min_steps` updates, and leaves the model as built otherwise; a run resumed from a checkpoint takes the dropout
    its checkpoint's config.json records instead, so that a run keeps one choice from start to end.

    Args:
        planner: the run's `BudgetPlanner` (its `planned_steps` is None until the first plan).
        min_steps: the fewest planned updates at which the dropout applies.
        probabilities: dropout fields and values (`DROPOUT_FIELDS`), at least one; fields the command line set
            (--config_overrides) are left out by the caller.
        resume_from: the checkpoint folder a resumed run starts from, or None.
    Raises:
        ValueError: min_steps < 1, no field, an unknown field or a value outside [0, 1).
    """

    def __init__(self, planner, min_steps: int, probabilities: dict[str, float], resume_from: str | None = None):
        if min_steps < 1:
            raise ValueError(f"min_steps must be >= 1, got {min_steps}.")
        if not probabilities:
            raise ValueError("LongRunDropout: no dropout field to set.")
        _check_probabilities(probabilities, "LongRunDropout")
        self.planner, self.min_steps, self.probabilities = planner, min_steps, dict(probabilities)
        self.resume_from = resume_from
        self.applied: bool | None = None  # None until chosen

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.resume_from is None:
            return control
        config_path = Path(self.resume_from) / "config.json"
        saved = json.loads(config_path.read_text()) if config_path.is_file() else {}
        chosen = {name: saved[name] for name in self.probabilities if name in saved}
        if chosen:
            set_dropout(model, **chosen)
            self.applied = all(chosen.get(name) == p for name, p in self.probabilities.items())
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.applied is not None or self.planner.planned_steps is None:
            return control
        self.applied = self.planner.planned_steps >= self.min_steps
        listing = ", ".join(f"{name} {p:g}" for name, p in self.probabilities.items())
        if self.applied:
            set_dropout(model, **self.probabilities)
            print(f"Planned {self.planner.planned_steps} >= {self.min_steps} steps: training on with {listing} "
                  f"(the preset's long_run_dropout; docs/results.md).", flush=True)
        else:
            print(f"Planned {self.planner.planned_steps} < {self.min_steps} steps: the preset's long_run_dropout "
                  f"({listing}) is not used.", flush=True)
        return control


def long_run_dropout(preset: dict, config_overrides: str | None = None,
                     model_name_or_path: str | None = None) -> dict | None:
    """The preset's `long_run_dropout` for this command: `{"min_steps": int, "probabilities": {field: p}}` without
    the fields --config_overrides sets (the command line wins), or None where the preset has none, every field is
    given, or the run continues a saved model (`--model_name_or_path`: its config decides)."""
    spec = preset.get("long_run_dropout")
    if not spec or model_name_or_path:
        return None
    given = parse_overrides(config_overrides)
    probabilities = {name: p for name, p in spec.items() if name != "min_steps" and name not in given}
    return {"min_steps": spec["min_steps"], "probabilities": probabilities} if probabilities else None
