"""Fit a training run into a time budget for the whole command, from the measured speed of its first steps.

The `cpu` preset promises a result within a wall-clock budget (start of the command to BLEU printed) on machines
whose speed differs by 2-3x (a CPU with native bf16 vs one with AVX2 only, 1 or 2 free cores). A fixed number of
steps misses the budget on slow machines; a wall-clock cap alone stops a run in the middle of its schedule, at a high
learning rate. `BudgetPlanner` instead:

1. measures the mean wall time of training steps `measure_from + 1 .. measure_steps` (the first steps are slower:
   allocator warm-up, first batches);
2. plans the number of updates that fit: what is left of the budget, less the time already spent, the estimated
   validation runs still to come and the estimated final test translation, divided by the step time; capped at the
   preset's `max_steps`;
3. ends the learning-rate schedule there: Eq. 3 of the paper, then a linear cooldown to 0 over the last
   `cooldown_fraction` of the planned updates (`vaswani_hf.schedule.cooldown_learning_rate`);
4. saves `cooldown_checkpoints` checkpoints evenly over the cooldown, for averaging (§6.1; training/lib/choose.py);
5. re-plans after every validation run and every `replan_every` steps with the speed measured so far (once the
   cooldown has started, only to end sooner if the run falls behind, at the pace of its last `replan_every` steps
   where their median is slower: the lr still reaches 0 at the end), and stops training at the planned update; a
   safety stop at the budget catches what planning could not.

It prints the plan (precision and why, threads, step time, planned steps and minutes) when it is made and whenever
it changes by more than 2 %.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections import deque
from pathlib import Path

from transformers import TrainerCallback

logger = logging.getLogger("vaswani_hf.planner")


def process_start_monotonic() -> float:
    """`time.monotonic()` at the moment this process started (Linux: from /proc), so that a budget counts interpreter
    start-up and imports too. Elsewhere: the time this module was imported."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
        if 0 <= age < 3600:
            return time.monotonic() - age
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    return _IMPORTED_AT


_IMPORTED_AT = time.monotonic()


# Saving, scoring and printing after the last decoding: the time after training of the cpu preset's runs was the
# choice's and the test translation's decoding to within a few seconds (docs/results.md, "Results on a 2-core CPU").
SECONDS_AFTER_DECODING = 10.0
# Validation runs whose per-sentence time sets the estimate of the decoding after training: the median of the last 3,
# so that one run slowed by other load does not move the plan.
VALIDATION_RUNS_TIMED = 3


def seconds_after_training(test_sentences: int, seconds_per_sentence: float, search_sentences: float = 0) -> float:
    """Estimated time of everything after training: the choice on validation (`search_sentences`, in units of one
    test sentence's decoding; training/lib/choose.py), translating `test_sentences` and saving
    (`SECONDS_AFTER_DECODING`)."""
    return SECONDS_AFTER_DECODING + (test_sentences + search_sentences) * seconds_per_sentence


class BudgetPlanner(TrainerCallback):
    """A `TrainerCallback` that plans the number of updates to fit `budget_minutes` and ends the schedule there.

    Args:
        budget_minutes: wall-clock budget of the whole command, in minutes, counted from `start` (default: the
            process start, `process_start_monotonic()`).
        max_steps: the most updates to plan (the preset's full schedule); fewer where the budget is shorter.
        cooldown_fraction: share of the planned updates spent in the linear cooldown to lr 0, in [0, 1).
        test_sentences: sentences the final test translation decodes (0: none), for its time estimate.
        eval_sentences: sentences one validation run decodes.
        precision, precision_reason: what the run computes in and why, printed with the plan.
        measure_steps: the plan is made after this many updates; steps `measure_from + 1 ..` are timed.
        replan_every: re-plan every this many updates until the cooldown starts.
        seconds_per_test_sentence: the guess for the final translation before a validation run has measured it.
        search_sentences: the choice on validation at the end (lib/choose.py), in test sentences' decoding time.
        cooldown_checkpoints: checkpoints saved evenly over the cooldown, the last at the planned end (for averaging,
            §6.1); 0: none besides the last.

    Raises:
        ValueError: a non-positive budget, max_steps < 1, cooldown_fraction outside [0, 1), or measure_steps <=
            measure_from.
    """

    def __init__(self, budget_minutes: float, max_steps: int, *, cooldown_fraction: float = 0.2,
                 test_sentences: int = 0, eval_sentences: int = 0, precision: str = "fp32",
                 precision_reason: str = "", measure_steps: int = 12, measure_from: int = 2,
                 replan_every: int = 50, seconds_per_test_sentence: float = 0.15, start: float | None = None,
                 search_sentences: float = 0, cooldown_checkpoints: int = 0):
        if not budget_minutes or budget_minutes <= 0:
            raise ValueError(f"The time budget must be a positive number of minutes, got {budget_minutes!r}.")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1 to plan a run, got {max_steps}.")
        if not 0 <= cooldown_fraction < 1:
            raise ValueError(f"cooldown_fraction must be in [0, 1), got {cooldown_fraction}.")
        if measure_steps <= measure_from:
            raise ValueError(f"measure_steps ({measure_steps}) must exceed measure_from ({measure_from}).")
        self.budget = budget_minutes * 60.0
        self.max_steps = max_steps
        self.cooldown_fraction = cooldown_fraction
        self.test_sentences, self.eval_sentences = test_sentences, eval_sentences
        self.search_sentences, self.cooldown_checkpoints = search_sentences, cooldown_checkpoints
        self.precision, self.precision_reason = precision, precision_reason
        self.measure_steps, self.measure_from, self.replan_every = measure_steps, measure_from, replan_every
        self.seconds_per_sentence = seconds_per_test_sentence
        self._validation_sentence_seconds: list[float] = []
        self.start = process_start_monotonic() if start is None else start
        self.planned_steps: int | None = None
        self.cooldown_steps = 0
        self.ended_at: int | None = None  # the step at which the plan or the budget ended training
        self.step_seconds: float | None = None
        self._timed_from: tuple[int, float] | None = None  # (step, time) where step timing starts
        self._eval_seconds = 0.0  # time spent in validation since timing started (not training time)
        self._eval_started: float | None = None
        # the last `replan_every` step times (validation left out): in the cooldown their median, if slower than the
        # mean so far, is the pace of the steps to come, so that a run slowing down ends on its plan, inside the budget
        self._recent_step_seconds: deque[float] = deque(maxlen=replan_every)
        self._last_step_end: tuple[float, float] | None = None  # (time, validation seconds) at the last step's end
        self.plans: list[dict] = []

    # -- the plan ---------------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def final_seconds(self) -> float:
        """Estimated time of everything after training (`seconds_after_training`)."""
        return seconds_after_training(self.test_sentences, self.seconds_per_sentence, self.search_sentences)

    def plan(self, step: int, eval_steps: int | None, lambdas) -> int:
        """Plan the run's last update from `step` on; set the schedule's end in `lambdas`; return the plan."""
        left = self.budget - self.elapsed() - self.final_seconds()
        in_cooldown = self.planned_steps is not None and step > self.planned_steps - self.cooldown_steps
        per_step = self.step_seconds
        if in_cooldown and len(self._recent_step_seconds) == self._recent_step_seconds.maxlen:
            per_step = max(per_step, statistics.median(self._recent_step_seconds))
        evals_left = 0
        eval_seconds = self.eval_sentences * self.seconds_per_sentence
        if eval_steps:
            # validation runs still to come if the run went on to max_steps (an upper bound: fewer if it stops early)
            steps_fit = max(0, int(left / per_step))
            evals_left = (min(self.max_steps, step + steps_fit) // eval_steps) - (step // eval_steps)
            left -= evals_left * eval_seconds
        planned = min(self.max_steps, step + max(0, int(left / per_step)))
        planned = max(planned, step + 1)
        cooldown = min(int(round(planned * self.cooldown_fraction)), planned - 1)
        changed = self.planned_steps is None or abs(planned - self.planned_steps) > 0.02 * self.planned_steps
        if in_cooldown:
            # In the cooldown the end never moves later; if the run has fallen behind, it moves sooner from the same
            # cooldown start (the learning rate drops a little, then still reaches 0 at the new end).
            if planned >= self.planned_steps:
                return self.planned_steps
            cooldown = planned - (self.planned_steps - self.cooldown_steps)
        self.planned_steps, self.cooldown_steps = planned, cooldown
        for fn in lambdas:
            if hasattr(fn, "set_cooldown"):
                fn.set_cooldown(planned, cooldown)
        training_end = self.elapsed() + (planned - step) * per_step + evals_left * eval_seconds
        record = {"at_step": step, "step_seconds": round(per_step, 3), "planned_steps": planned,
                  "cooldown_steps": cooldown, "training_minutes": round(training_end / 60, 1),
                  "whole_minutes": round((training_end + self.final_seconds()) / 60, 1),
                  "budget_minutes": round(self.budget / 60, 1)}
        self.plans.append(record)
        if changed:
            capped = " (the preset's full schedule)" if planned == self.max_steps else ""
            message = (f"Plan at step {step}: {per_step:.2f} s/step -> {planned} steps{capped}, lr cooldown over the "
                       f"last {cooldown}; training ends at ~{record['training_minutes']} min, whole command "
                       f"~{record['whole_minutes']} of {record['budget_minutes']} min (test translation "
                       f"~{self.final_seconds() / 60:.1f} min).")
            print(message, flush=True)  # stdout, beside the progress bar: the user's record of the plan
        return planned

    @property
    def cooldown_from(self) -> int | None:
        """The last step before the planned cooldown (None before the plan)."""
        return None if self.planned_steps is None else self.planned_steps - self.cooldown_steps

    @property
    def cooldown_checkpoint_every(self) -> int | None:
        """Steps between the checkpoints saved for averaging over the cooldown (None before the plan or without
        them)."""
        if not self.cooldown_checkpoints or self.planned_steps is None or self.cooldown_steps < 1:
            return None
        return max(1, self.cooldown_steps // self.cooldown_checkpoints)

    def cooldown_checkpoint_due(self, step: int) -> bool:
        """A checkpoint for averaging is due at `step`: one of `cooldown_checkpoints` steps evenly spaced over the
        cooldown, ending at the planned last step."""
        every = self.cooldown_checkpoint_every
        return every is not None and step > self.cooldown_from and (self.planned_steps - step) % every == 0

    # -- Trainer hooks ----------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        import torch

        message = (f"Time budget {self.budget / 60:g} min for the whole command ({self.elapsed() / 60:.1f} min "
                   f"spent before training). Precision {self.precision}"
                   f"{f' ({self.precision_reason})' if self.precision_reason else ''}; {torch.get_num_threads()} "
                   f"threads. The number of steps is planned after timing the first {self.measure_steps} steps.")
        print(message, flush=True)

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        step = state.global_step
        now = time.monotonic()
        lambdas = getattr(lr_scheduler, "lr_lambdas", [])
        if self._last_step_end is not None:
            last, eval_seconds = self._last_step_end
            self._recent_step_seconds.append(now - last - (self._eval_seconds - eval_seconds))
        if self._timed_from is None:
            if step >= self.measure_from:
                self._timed_from, self._eval_seconds = (step, now), 0.0
        elif step >= self.measure_steps and (self.planned_steps is None or step % self.replan_every == 0):
            first, t0 = self._timed_from
            self.step_seconds = max(1e-3, (now - t0 - self._eval_seconds) / max(1, step - first))
            self.plan(step, args.eval_steps if args.eval_strategy != "no" else None, lambdas)
        if self._timed_from is not None:
            self._last_step_end = (now, self._eval_seconds)
        if self.cooldown_checkpoint_due(step):
            control.should_save = True
        if self.planned_steps is not None and step >= self.planned_steps:
            control.should_training_stop = True
            control.should_save = True
            self.ended_at = step
        elif self.elapsed() + self.final_seconds() > self.budget:
            message = f"Time budget reached at step {step} (planned {self.planned_steps}): saving and stopping."
            logger.warning(message)
            control.should_training_stop = True
            control.should_save = True
            self.ended_at = step
        return control

    def checkpoint_record(self, step: int) -> dict:
        """What a checkpoint keeps of the plan (`checkpoints.PLAN_FILE`), for a run resumed from it: whether training
        ended at `step` (by the plan or the budget) and the cooldown the choice on validation reads its candidates
        from."""
        return {"step": step, "ended": self.ended_at is not None and step >= self.ended_at,
                "planned_steps": self.planned_steps, "cooldown_from": self.cooldown_from,
                "cooldown_checkpoint_every": self.cooldown_checkpoint_every}

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        runtime = (metrics or {}).get("eval_runtime")
        if runtime and self.eval_sentences:
            # validation decodes with the same beam as the test: its speed is the best estimate for the final run
            self._validation_sentence_seconds.append(runtime / self.eval_sentences)
            self.seconds_per_sentence = statistics.median(self._validation_sentence_seconds[-VALIDATION_RUNS_TIMED:])
        if self._timed_from is not None and runtime:
            self._eval_seconds += runtime
        if self.step_seconds is not None:
            self.plan(state.global_step, args.eval_steps if args.eval_strategy != "no" else None,
                      getattr(kwargs.get("lr_scheduler"), "lr_lambdas", []))
        return control
