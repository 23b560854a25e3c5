"""Optimizer and learning-rate schedule of "Attention Is All You Need" §5.3.

Paper, Eq. 3::

    lrate = d_model^-0.5 * min(step_num^-0.5, step_num * warmup_steps^-1.5)

with Adam(beta1=0.9, beta2=0.98, eps=1e-9) and warmup_steps = 4000. `factor` scales the whole curve
(1.0 in the paper; tensor2tensor and "The Annotated Transformer" use 2.0 / 1.0 variants).

Convention used here — the schedule gives **absolute** learning rates, whatever `lr` the optimizer was
created with: `get_inverse_sqrt_schedule` builds a `LambdaLR` whose per-group multiplier is
`lrate / base_lr` of that group, so the effective lr is exactly Eq. 3 for every param group. The base lr only
has to be a positive number; it cannot silently rescale the curve.

Step counting: the paper's `step_num` starts at 1 (the first parameter update). `LambdaLR` calls its
lambda with the number of completed `scheduler.step()` calls (0 before the first update), so update number
`n` (1-based) uses `lrate(n)`. Call `optimizer.step(); scheduler.step()` once per update (what the HF
Trainer and the usual accelerate loops do). Note this differs from `transformers.get_inverse_sqrt_schedule`
(a multiplier on the base lr, with a different warmup shape).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = [
    "paper_learning_rate",
    "InverseSqrtLambda",
    "inverse_sqrt_lambda",
    "get_inverse_sqrt_schedule",
    "paper_adam",
    "paper_optimizer_and_schedule",
    "PAPER_BETAS",
    "PAPER_EPS",
    "PAPER_WARMUP_STEPS",
    "cooldown_learning_rate",
]

PAPER_BETAS = (0.9, 0.98)
PAPER_EPS = 1e-9
PAPER_WARMUP_STEPS = 4000


def _check_positive_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}.")
    return v


def _check_positive_float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {v!r}.")
    return float(v)


def paper_learning_rate(step: int, d_model: int, warmup_steps: int = PAPER_WARMUP_STEPS, factor: float = 1.0) -> float:
    """Eq. 3 (§5.3): `factor * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)`.

    Args:
        step: 1-based update number (`step_num` in the paper), >= 1.
        d_model: model width (512 base, 1024 big).
        warmup_steps: linear-warmup length (paper: 4000). The peak is at `step == warmup_steps` with value
            `factor * d_model^-0.5 * warmup_steps^-0.5` (6.99e-4 for the base model).
        factor: multiplies the whole curve (paper: 1.0).

    Returns:
        The absolute learning rate (a float).

    Raises:
        ValueError: step < 1 or a non-positive argument.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step is the 1-based update number (paper's step_num) and must be an int >= 1, got {step!r}.")
    _check_positive_int("d_model", d_model)
    _check_positive_int("warmup_steps", warmup_steps)
    factor = _check_positive_float("factor", factor)
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)


def cooldown_learning_rate(step: int, d_model: int, warmup_steps: int, factor: float, total_steps: int,
                           cooldown_steps: int) -> float:
    """Eq. 3 followed by a linear cooldown to zero — a departure from §5.3 used by the `cpu` preset only.

    Updates `1 .. total_steps - cooldown_steps` follow `paper_learning_rate`; over the last
    `cooldown_steps` updates the rate falls linearly from Eq. 3's value at the cooldown's start towards 0: update
    `n` gets `lrate(start) * (total_steps - n + 1) / (cooldown_steps + 1)` with `start = total_steps -
    cooldown_steps`, so the last update still moves the weights and the next one would be 0. A run that is stopped
    when its time budget ends would otherwise stop at a high, undecayed rate (the paper's schedule never reaches 0).
    Updates past `total_steps` get 0.

    Args:
        step: 1-based update number, >= 1.
        d_model, warmup_steps, factor: as in `paper_learning_rate`.
        total_steps: the update after which the rate is 0, >= 1.
        cooldown_steps: length of the linear part, 0 <= cooldown_steps < total_steps (0: Eq. 3 then a cliff).

    Raises:
        ValueError: step < 1, non-positive sizes, or cooldown_steps outside [0, total_steps).
    """
    _check_positive_int("total_steps", total_steps)
    if isinstance(cooldown_steps, bool) or not isinstance(cooldown_steps, int) or not 0 <= cooldown_steps < total_steps:
        raise ValueError(f"cooldown_steps must be an int in [0, total_steps={total_steps}), got {cooldown_steps!r}.")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step is the 1-based update number and must be an int >= 1, got {step!r}.")
    if step > total_steps:
        return 0.0
    start = total_steps - cooldown_steps
    if step <= start:
        return paper_learning_rate(step, d_model, warmup_steps, factor)
    return paper_learning_rate(start, d_model, warmup_steps, factor) * (total_steps - step + 1) / (cooldown_steps + 1)


class InverseSqrtLambda:
    """Picklable `LambdaLR` lambda: `f(completed_steps) = paper_learning_rate(completed_steps + 1) / base_lr`.

    A class (not a closure) so that `LambdaLR.state_dict()` saves its parameters with checkpoints.

    With `set_cooldown` the curve becomes `cooldown_learning_rate` (Eq. 3, then a linear cooldown to 0
    at `total_steps`). The end can be moved while training runs (the `cpu` preset's planner sets it from the
    measured step time); the new values apply from the next `scheduler.step()`.
    """

    def __init__(self, d_model: int, warmup_steps: int, factor: float = 1.0, base_lr: float = 1.0):
        self.d_model = _check_positive_int("d_model", d_model)
        self.warmup_steps = _check_positive_int("warmup_steps", warmup_steps)
        self.factor = _check_positive_float("factor", factor)
        self.base_lr = _check_positive_float("base_lr", base_lr)
        self.total_steps: int | None = None
        self.cooldown_steps = 0

    def set_cooldown(self, total_steps: int, cooldown_steps: int) -> None:
        """End the schedule at `total_steps` after a linear cooldown of `cooldown_steps` updates.

        Raises:
            ValueError: as `cooldown_learning_rate`.
        """
        cooldown_learning_rate(1, self.d_model, self.warmup_steps, self.factor, total_steps, cooldown_steps)  # checks
        self.total_steps, self.cooldown_steps = total_steps, cooldown_steps

    def __call__(self, completed_steps: int) -> float:
        step = int(completed_steps) + 1
        if self.total_steps is None:
            return paper_learning_rate(step, self.d_model, self.warmup_steps, self.factor) / self.base_lr
        return cooldown_learning_rate(step, self.d_model, self.warmup_steps, self.factor, self.total_steps,
                                      self.cooldown_steps) / self.base_lr

    def __setstate__(self, state: dict) -> None:  # lambdas pickled before the cooldown existed
        self.__dict__.update({"total_steps": None, "cooldown_steps": 0, **state})

    def __repr__(self) -> str:
        end = f", total_steps={self.total_steps}, cooldown_steps={self.cooldown_steps}" if self.total_steps else ""
        return (f"InverseSqrtLambda(d_model={self.d_model}, warmup_steps={self.warmup_steps}, "
                f"factor={self.factor}, base_lr={self.base_lr}{end})")


def inverse_sqrt_lambda(d_model: int, warmup_steps: int = PAPER_WARMUP_STEPS, factor: float = 1.0,
                        base_lr: float = 1.0) -> InverseSqrtLambda:
    """The `lr_lambda` for `torch.optim.lr_scheduler.LambdaLR` (§5.3, Eq. 3).

    Takes the number of completed scheduler steps `k` (0-based, LambdaLR's convention) and returns
    `paper_learning_rate(k + 1, ...) / base_lr`: the multiplier that turns an optimizer lr of `base_lr`
    into the paper's absolute lr for update `k + 1`. With the default `base_lr=1.0` the value *is* the
    learning rate. Prefer `get_inverse_sqrt_schedule`, which reads `base_lr` from the optimizer.

    Raises:
        ValueError: a non-positive argument.
    """
    return InverseSqrtLambda(d_model, warmup_steps, factor, base_lr)


def get_inverse_sqrt_schedule(
    optimizer: torch.optim.Optimizer,
    d_model: int,
    warmup_steps: int = PAPER_WARMUP_STEPS,
    factor: float = 1.0,
    last_epoch: int = -1,
) -> LambdaLR:
    """`LambdaLR` that sets every param group's lr to the paper's absolute value (§5.3, Eq. 3).

    Works with any positive base lr: each group's multiplier is `lrate / base_lr` of that group (its
    `initial_lr` when resuming, else its `lr`), so the lr seen by the optimizer is exactly Eq. 3 —
    `factor * d_model^-0.5 * min(n^-0.5, n * warmup_steps^-1.5)` for update `n = 1, 2, ...`. Right after
    construction `optimizer.param_groups[i]["lr"]` already holds the value for update 1.

    Args:
        optimizer: e.g. from `paper_adam`.
        d_model, warmup_steps, factor: as in `paper_learning_rate`.
        last_epoch: passed to `LambdaLR` (for resuming; normally use `scheduler.load_state_dict`).

    Raises:
        ValueError: a param group with lr <= 0 (nothing to rescale), or a non-positive argument.
    """
    lambdas = []
    for i, group in enumerate(optimizer.param_groups):
        base = group.get("initial_lr", group["lr"])
        if isinstance(base, torch.Tensor):
            base = float(base)
        if not (isinstance(base, (int, float)) and math.isfinite(base) and base > 0):
            raise ValueError(
                f"optimizer.param_groups[{i}] has lr={base!r}; create the optimizer with any positive lr "
                f"(e.g. 1.0): get_inverse_sqrt_schedule replaces it with the paper's absolute value."
            )
        lambdas.append(InverseSqrtLambda(d_model, warmup_steps, factor, float(base)))
    return LambdaLR(optimizer, lambdas, last_epoch=last_epoch)


def paper_adam(
    params: Iterable[Any],
    *,
    lr: float,
    betas: tuple[float, float] = PAPER_BETAS,
    eps: float = PAPER_EPS,
    weight_decay: float = 0.0,
    **kwargs: Any,
) -> torch.optim.Adam:
    """`torch.optim.Adam` with the paper's hyper-parameters (§5.3): betas=(0.9, 0.98), eps=1e-9, no weight decay.

    `lr` is required (keyword-only) so that an optimizer used without the schedule never runs at a
    placeholder lr by accident. With `get_inverse_sqrt_schedule` any positive value works (pass 1.0);
    or use `paper_optimizer_and_schedule`.
    """
    _check_positive_float("lr", lr)
    return torch.optim.Adam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)


def paper_optimizer_and_schedule(
    params: Iterable[Any],
    d_model: int,
    warmup_steps: int = PAPER_WARMUP_STEPS,
    factor: float = 1.0,
    **adam_kwargs: Any,
) -> tuple[torch.optim.Adam, LambdaLR]:
    """`(paper_adam(params, lr=1.0), get_inverse_sqrt_schedule(...))` — the §5.3 setup in one call, e.g. for
    `Seq2SeqTrainer(optimizers=...)` or an accelerate loop."""
    adam_kwargs.setdefault("lr", 1.0)
    opt = paper_adam(params, **adam_kwargs)
    return opt, get_inverse_sqrt_schedule(opt, d_model, warmup_steps, factor)
