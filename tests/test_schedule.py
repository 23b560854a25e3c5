"""Tests for vaswani_hf.schedule: §5.3 Eq. 3 learning rate and the paper's Adam."""

import math

import pytest
import torch

from vaswani_hf.schedule import (
    get_inverse_sqrt_schedule,
    inverse_sqrt_lambda,
    paper_adam,
    paper_learning_rate,
    paper_optimizer_and_schedule,
)


def test_values_by_hand_base_model():
    # d_model = 512, warmup = 4000: 512^-0.5 = 0.0441941738..., 4000^-0.5 = 0.0158113883..., 4000^-1.5 = 3.9528470e-6
    assert paper_learning_rate(1, 512, 4000) == pytest.approx(0.04419417382 * 3.95284708e-6, rel=1e-8)  # 1.7469e-7
    assert paper_learning_rate(4000, 512, 4000) == pytest.approx(6.987712429686844e-4, rel=1e-12)  # peak
    assert paper_learning_rate(2000, 512, 4000) == pytest.approx(6.987712429686844e-4 / 2, rel=1e-12)  # linear warmup
    assert paper_learning_rate(16000, 512, 4000) == pytest.approx(6.987712429686844e-4 / 2, rel=1e-12)  # 1/sqrt decay
    assert paper_learning_rate(100000, 512, 4000) == pytest.approx(0.04419417382 / 316.227766017, rel=1e-9)
    # big model, factor 2
    assert paper_learning_rate(4000, 1024, 4000, factor=2.0) == pytest.approx(2 * 1024 ** -0.5 * 4000 ** -0.5)


def test_peak_is_at_warmup():
    lrs = [paper_learning_rate(s, 512, 100) for s in range(1, 1001)]
    assert max(range(1000), key=lrs.__getitem__) + 1 == 100
    assert max(lrs) == pytest.approx(512 ** -0.5 * 100 ** -0.5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="1-based"):
        paper_learning_rate(0, 512, 4000)
    with pytest.raises(ValueError, match="warmup_steps"):
        paper_learning_rate(1, 512, 0)
    with pytest.raises(ValueError, match="d_model"):
        inverse_sqrt_lambda(512.0, 4000)
    with pytest.raises(ValueError, match="factor"):
        inverse_sqrt_lambda(512, 4000, factor=-1)


def _lrs_during_updates(opt, sched, n):
    """lr actually used by optimizer.step() for updates 1..n (Trainer order: step, then scheduler.step)."""
    out = []
    for _ in range(n):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("base_lr", [1.0, 5e-4, 3.0])
def test_scheduler_gives_absolute_lr_for_any_base_lr(base_lr):
    p = torch.nn.Parameter(torch.zeros(2))
    q = torch.nn.Parameter(torch.zeros(2))
    opt = paper_adam([{"params": [p]}, {"params": [q], "lr": 7.0 * base_lr}], lr=base_lr)
    sched = get_inverse_sqrt_schedule(opt, d_model=512, warmup_steps=10)
    seen = _lrs_during_updates(opt, sched, 30)
    for n, lrs in enumerate(seen, start=1):
        for lr in lrs:  # both groups get the paper value, whatever their base lr
            assert lr == pytest.approx(paper_learning_rate(n, 512, 10), rel=1e-12)
    flat = [lrs[0] for lrs in seen]
    assert max(range(30), key=flat.__getitem__) + 1 == 10  # the 10th update uses the peak
    assert flat[0] > 0  # the first update does not run at lr 0


def test_scheduler_state_dict_resume():
    p = torch.nn.Parameter(torch.zeros(1))
    opt, sched = paper_optimizer_and_schedule([p], d_model=256, warmup_steps=5, factor=2.0)
    _lrs_during_updates(opt, sched, 7)
    state_o, state_s = opt.state_dict(), sched.state_dict()
    p2 = torch.nn.Parameter(torch.zeros(1))
    opt2, sched2 = paper_optimizer_and_schedule([p2], d_model=256, warmup_steps=5, factor=2.0)
    opt2.load_state_dict(state_o)
    sched2.load_state_dict(state_s)
    assert opt2.param_groups[0]["lr"] == pytest.approx(paper_learning_rate(8, 256, 5, 2.0))


def test_zero_lr_group_rejected():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    with pytest.raises(ValueError, match=r"param_groups\[0\] has lr=0.0"):
        get_inverse_sqrt_schedule(opt, 512, 4000)


def test_paper_adam_hyperparameters():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = paper_adam([p], lr=1.0)
    g = opt.param_groups[0]
    assert isinstance(opt, torch.optim.Adam)
    assert g["betas"] == (0.9, 0.98) and g["eps"] == 1e-9 and g["weight_decay"] == 0.0
    with pytest.raises(TypeError):
        paper_adam([p])  # lr is required: no silent placeholder lr
    opt, sched = paper_optimizer_and_schedule([torch.nn.Parameter(torch.zeros(1))], 512)
    assert opt.param_groups[0]["lr"] == pytest.approx(512 ** -0.5 * 4000 ** -1.5)
    assert math.isclose(inverse_sqrt_lambda(512)(3999), 512 ** -0.5 * 4000 ** -0.5)


def test_cooldown_follows_eq3_then_falls_linearly_to_zero():
    from vaswani_hf.schedule import cooldown_learning_rate

    # 100 updates, warmup 20, the last 25 in the cooldown: updates 1..75 are Eq. 3.
    for n in (1, 10, 20, 50, 75):
        assert cooldown_learning_rate(n, 256, 20, 0.5, 100, 25) == paper_learning_rate(n, 256, 20, 0.5)
    start = paper_learning_rate(75, 256, 20, 0.5)
    assert cooldown_learning_rate(76, 256, 20, 0.5, 100, 25) == pytest.approx(start * 25 / 26, rel=1e-12)
    assert cooldown_learning_rate(100, 256, 20, 0.5, 100, 25) == pytest.approx(start / 26, rel=1e-12)
    assert cooldown_learning_rate(101, 256, 20, 0.5, 100, 25) == 0.0
    lrs = [cooldown_learning_rate(n, 256, 20, 0.5, 100, 25) for n in range(75, 101)]
    steps = [a - b for a, b in zip(lrs, lrs[1:])]
    assert all(d == pytest.approx(start / 26, rel=1e-9) for d in steps)  # a straight line
    with pytest.raises(ValueError, match="cooldown_steps"):
        cooldown_learning_rate(1, 256, 20, 0.5, 100, 100)
    with pytest.raises(ValueError, match="total_steps"):
        cooldown_learning_rate(1, 256, 20, 0.5, 0, 0)


def test_scheduler_end_moves_while_training_and_survives_resume():
    p = torch.nn.Parameter(torch.zeros(1))
    opt, sched = paper_optimizer_and_schedule([p], d_model=256, warmup_steps=5, factor=2.0)
    seen = _lrs_during_updates(opt, sched, 10)
    assert [s[0] for s in seen] == pytest.approx([paper_learning_rate(n, 256, 5, 2.0) for n in range(1, 11)])
    for fn in sched.lr_lambdas:
        fn.set_cooldown(40, 10)  # planned: end at update 40, cooldown from update 31
    state_o, state_s = opt.state_dict(), sched.state_dict()
    rest = [s[0] for s in _lrs_during_updates(opt, sched, 32)]
    from vaswani_hf.schedule import cooldown_learning_rate

    assert rest == pytest.approx([cooldown_learning_rate(n, 256, 5, 2.0, 40, 10) for n in range(11, 43)])
    assert rest[-2:] == [0.0, 0.0] and rest[29] > 0  # update 40 still moves, 41 and 42 do not

    p2 = torch.nn.Parameter(torch.zeros(1))
    opt2, sched2 = paper_optimizer_and_schedule([p2], d_model=256, warmup_steps=5, factor=2.0)
    opt2.load_state_dict(state_o)
    sched2.load_state_dict(state_s)  # the planned end is part of the scheduler's state
    assert sched2.lr_lambdas[0].total_steps == 40
    assert [s[0] for s in _lrs_during_updates(opt2, sched2, 32)] == pytest.approx(rest)
