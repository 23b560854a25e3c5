"""Dropout that follows the planned length of a run: a run that fits many updates in its time budget trains with more.

The `cpu` preset's budget gives about 3,500-4,200 updates where a CPU computes in fp32 and 5,000-7,700 where it has
native bf16. At 5,000-5,945 updates, dropout on the attention probabilities and after the FFN's ReLU (0.1 each, which
the paper does not use, §5.4) scored higher on validation than the paper's residual dropout alone, in each of three
pairs of runs of one seed; at the fp32 path's 4,200 it scored lower in one pair (docs/results.md, "Dropout at
1,024-token batches"). So the preset names the extra dropout, the number of updates a plan must reach for it and the
step whose plan decides (`long_run_dropout`), and `LongRunDropout` sets it on the model once the `BudgetPlanner` has
made that plan (at step 50 of the run's thousands of updates, where the two paths' plans lie further apart than at the
first plan of step 12). A plan, timed on the slower first steps, runs under the steps a run ends with, hence a
threshold below the step counts measured.
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
    """A `TrainerCallback` that sets `probabilities` (`set_dropout`) when the `planner`'s plan at update `at_step`
    reaches `min_steps` updates, and leaves the model as built otherwise; the choice is made once, at the end of
    update `at_step` (or at the first plan, if that plan ends the run sooner), and holds from the next update on. A
    run resumed from a checkpoint takes the dropout its checkpoint's config.json records instead, so that a run keeps
    one choice from start to end.

    Args:
        planner: the run's `BudgetPlanner` (its `planned_steps` is None until the first plan); its callback must come
            before this one, so that the plan of update `at_step` is made when this one reads it.
        min_steps: the fewest planned updates at which the dropout applies.
        probabilities: dropout fields and values (`DROPOUT_FIELDS`), at least one; fields the command line set
            (--config_overrides) are left out by the caller.
        at_step: the update whose plan decides (default 1: the first plan).
        resume_from: the checkpoint folder a resumed run starts from, or None.
    Raises:
        ValueError: min_steps < 1, at_step < 1, no field, an unknown field or a value outside [0, 1).
    """

    def __init__(self, planner, min_steps: int, probabilities: dict[str, float], at_step: int = 1,
                 resume_from: str | None = None):
        if min_steps < 1:
            raise ValueError(f"min_steps must be >= 1, got {min_steps}.")
        if at_step < 1:
            raise ValueError(f"at_step must be >= 1, got {at_step}.")
        if not probabilities:
            raise ValueError("LongRunDropout: no dropout field to set.")
        _check_probabilities(probabilities, "LongRunDropout")
        self.planner, self.min_steps, self.probabilities = planner, min_steps, dict(probabilities)
        self.at_step = at_step
        self.resume_from = resume_from
        self.applied: bool | None = None  # None until chosen

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if self.resume_from is None:
            return control
        config_path, state_path = Path(self.resume_from) / "config.json", Path(self.resume_from) / "trainer_state.json"
        saved_step = json.loads(state_path.read_text()).get("global_step", 0) if state_path.is_file() else None
        if saved_step is not None and saved_step < self.at_step:  # saved before the choice: it is still to make
            return control
        saved = json.loads(config_path.read_text()) if config_path.is_file() else {}
        chosen = {name: saved[name] for name in self.probabilities if name in saved}
        if chosen:
            set_dropout(model, **chosen)
            self.applied = all(chosen.get(name) == p for name, p in self.probabilities.items())
        return control

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.applied is not None or self.planner.planned_steps is None:
            return control
        if state.global_step < self.at_step < self.planner.planned_steps:  # the deciding plan is still to come
            return control
        self.applied = self.planner.planned_steps >= self.min_steps
        listing = ", ".join(f"{name} {p:g}" for name, p in self.probabilities.items())
        if self.applied:
            set_dropout(model, **self.probabilities)
            print(f"Planned {self.planner.planned_steps} >= {self.min_steps} steps at step {state.global_step}: "
                  f"training on with {listing} (the preset's long_run_dropout; docs/results.md).", flush=True)
        else:
            print(f"Planned {self.planner.planned_steps} < {self.min_steps} steps at step {state.global_step}: the "
                  f"preset's long_run_dropout ({listing}) is not used.", flush=True)
        return control


def long_run_dropout(preset: dict, config_overrides: str | None = None,
                     model_name_or_path: str | None = None) -> dict | None:
    """The preset's `long_run_dropout` for this command: `{"min_steps": int, "at_step": int, "probabilities": {field:
    p}}` without the fields --config_overrides sets (the command line wins), or None where the preset has none, every
    field is given, or the run continues a saved model (`--model_name_or_path`: its config decides). `at_step` is 1
    (the first plan) where the preset names none."""
    spec = preset.get("long_run_dropout")
    if not spec or model_name_or_path:
        return None
    given = parse_overrides(config_overrides)
    probabilities = {name: p for name, p in spec.items() if name not in ("min_steps", "at_step") and name not in given}
    if not probabilities:
        return None
    return {"min_steps": spec["min_steps"], "at_step": spec.get("at_step", 1), "probabilities": probabilities}
