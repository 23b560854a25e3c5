"""The time-budget planner of the cpu preset (training/lib/planner.py): it measures the first steps, plans the number
of updates that fit the budget of the whole command, ends the schedule there with a cooldown, and stops training."""

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import tiny_config
from transformers import TrainerControl, TrainerState

from vaswani_hf.schedule import paper_optimizer_and_schedule
from vaswani_training.lib.planner import BudgetPlanner, process_start_monotonic


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def run(planner, clock, steps, seconds_per_step, lr_scheduler, eval_every=None, eval_seconds=0.0):
    """Drive the callback as the Trainer would; returns the step at which it asked to stop (or None)."""
    args = SimpleNamespace(eval_steps=eval_every, eval_strategy="steps" if eval_every else "no")
    state, control = TrainerState(), TrainerControl()
    planner.on_train_begin(args, state, control)
    for step in range(1, steps + 1):
        clock.now += seconds_per_step
        lr_scheduler.optimizer.step()
        lr_scheduler.step()
        state.global_step = step
        planner.on_step_end(args, state, control, lr_scheduler=lr_scheduler)
        if eval_every and step % eval_every == 0:
            clock.now += eval_seconds
            planner.on_evaluate(args, state, control, metrics={"eval_runtime": eval_seconds},
                                lr_scheduler=lr_scheduler)
        if control.should_training_stop:
            return step
    return None


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr("vaswani_training.lib.planner.time.monotonic", c)
    return c


def _schedule():
    p = torch.nn.Parameter(torch.zeros(1))
    return paper_optimizer_and_schedule([p], d_model=256, warmup_steps=40, factor=0.5)[1]


def _train(clock, planner, seconds_of_step):
    """Drive `planner` as the Trainer would, step k taking `seconds_of_step(k, planner)` on the clock, until it stops
    training; return the last step, the schedule and the plan after each step (None before the first)."""
    sched = _schedule()
    args = SimpleNamespace(eval_steps=None, eval_strategy="no")
    state, control = TrainerState(), TrainerControl()
    step, ends = 0, []
    while not control.should_training_stop:
        step += 1
        clock.now += seconds_of_step(step, planner)
        sched.optimizer.step()
        sched.step()
        state.global_step = step
        planner.on_step_end(args, state, control, lr_scheduler=sched)
        ends.append(planner.planned_steps)
    assert control.should_save
    return step, sched, ends


@pytest.mark.parametrize("seconds_per_step", [0.5, 1.0, 2.0])
def test_slower_machines_plan_fewer_steps_and_finish_inside_the_budget(clock, seconds_per_step, capsys):
    sched = _schedule()
    start = clock.now - 60  # one minute of start-up before training
    planner = BudgetPlanner(10, 10_000, cooldown_fraction=0.2, test_sentences=100,
                            seconds_per_test_sentence=0.3, start=start)
    stopped = run(planner, clock, 10_000, seconds_per_step, sched)
    # the whole command: training, then 10 s of saving and 100 x 0.3 s of test translation
    whole = clock.now - start + planner.final_seconds()
    assert stopped == planner.planned_steps
    expected = (600 - 60 - 40) / seconds_per_step  # budget - start-up - final work, over the step time
    assert planner.planned_steps == pytest.approx(expected, abs=2)
    assert 590 <= whole <= 600
    assert planner.cooldown_steps == round(0.2 * planner.planned_steps)
    # the schedule ends at the plan: the last update's lr is small and positive, the next one would be 0
    lam = sched.lr_lambdas[0]
    assert lam(stopped - 1) > 0 and lam(stopped) == 0.0
    assert lam(stopped - planner.cooldown_steps - 1) > 10 * lam(stopped - 1)
    out = capsys.readouterr().out
    assert "Precision fp32" in out and f"{seconds_per_step:.2f} s/step -> {planner.planned_steps} steps" in out


def test_fast_machine_stops_at_the_presets_schedule(clock, capsys):
    sched = _schedule()
    planner = BudgetPlanner(30, 500, cooldown_fraction=0.2, start=clock.now)
    assert run(planner, clock, 10_000, 0.5, sched) == 500
    assert planner.planned_steps == 500 and planner.cooldown_steps == 100
    assert "500 steps (the preset's full schedule)" in capsys.readouterr().out
    assert clock.now - 1000 == pytest.approx(250)  # 500 steps x 0.5 s: the budget is not spent for nothing


def test_validation_time_is_budgeted_and_replanned(clock):
    sched = _schedule()
    start = clock.now
    planner = BudgetPlanner(10, 10_000, cooldown_fraction=0.1, test_sentences=200, eval_sentences=100,
                            seconds_per_test_sentence=0.1, start=start)
    # validation every 100 steps takes 30 s (0.3 s a sentence): the test estimate grows to 200 x 0.3 = 60 s
    stopped = run(planner, clock, 10_000, 0.5, sched, eval_every=100, eval_seconds=30.0)
    assert planner.seconds_per_sentence == pytest.approx(0.3)
    whole = clock.now - start + planner.final_seconds()
    assert whole <= 600 and whole >= 540
    assert stopped == planner.planned_steps


def test_one_slow_validation_run_does_not_move_the_estimate_after_training(clock):
    """The decoding after training is estimated from the median per-sentence time of the last 3 validation runs: one
    run slowed by other load leaves it alone, two in a row move it."""
    planner = BudgetPlanner(10, 10_000, test_sentences=200, eval_sentences=100, seconds_per_test_sentence=0.1,
                            search_sentences=300, start=clock.now)
    args = SimpleNamespace(eval_steps=100, eval_strategy="steps")
    state, control = TrainerState(), TrainerControl()
    assert planner.final_seconds() == pytest.approx(10 + 500 * 0.1)  # the guess until a validation run is timed
    seconds = []
    for runtime in (60.0, 30.0, 30.0, 90.0, 30.0, 90.0, 90.0):
        planner.on_evaluate(args, state, control, metrics={"eval_runtime": runtime})
        seconds.append(planner.final_seconds())
    assert seconds == pytest.approx([10 + 500 * s for s in (0.6, 0.45, 0.3, 0.3, 0.3, 0.9, 0.9)])


def test_a_machine_that_slows_down_is_stopped_by_the_budget(clock):
    planner = BudgetPlanner(5, 10_000, cooldown_fraction=0.5, start=clock.now, replan_every=10_000)
    step, _, _ = _train(clock, planner, lambda step, _: 0.5 if step <= 100 else 5.0)  # 10x slower after the plan
    assert step < planner.planned_steps
    assert clock.now - 1000 + planner.final_seconds() <= 300 + 5.0


def test_a_run_that_falls_behind_in_the_cooldown_ends_sooner_with_lr_0(clock):
    """Steps slow down by half once the cooldown has begun: re-plans move the end sooner (never later), training
    stops at the plan rather than at the safety stop, the schedule reaches 0 there, and the budget holds."""
    planner = BudgetPlanner(10, 10_000, cooldown_fraction=0.2, start=clock.now, replan_every=10)
    first_plan = None

    def seconds(step, planner):
        nonlocal first_plan
        first_plan = first_plan or planner.planned_steps
        return 0.75 if first_plan is not None and step > first_plan - planner.cooldown_steps // 2 else 0.5

    step, sched, ends = _train(clock, planner, seconds)
    assert step == planner.planned_steps < first_plan  # stopped by the plan, which moved sooner
    cooldown_ends = ends[ends.index(first_plan):]
    assert all(later <= earlier for earlier, later in zip(cooldown_ends, cooldown_ends[1:], strict=False))
    lam = sched.lr_lambdas[0]
    assert lam(step - 1) > 0 and lam(step) == 0.0
    assert clock.now - 1000 + planner.final_seconds() <= 600


def _run_with_slow_steps(clock, slow_steps: dict[int, float]) -> int:
    """A 10-minute run at 0.5 s a step, step k taking `slow_steps[k]` instead: its last step, which the plan set and
    which ends inside the budget."""
    planner = BudgetPlanner(10, 10_000, cooldown_fraction=0.2, start=clock.now, replan_every=10)
    step, _, _ = _train(clock, planner, lambda step, _: slow_steps.get(step, 0.5))
    assert step == planner.planned_steps and clock.now - 1000 + planner.final_seconds() <= 600
    return step


def test_one_slow_step_in_the_cooldown_costs_its_own_time_not_a_slower_pace(clock):
    """The cooldown's pace is the median of the last `replan_every` steps: one step slowed by 5 s (a checkpoint
    saved) moves the end sooner by the ~9 steps that time would have trained, not by the pace of a mean that the one
    step doubles."""
    start = clock.now
    plain = _run_with_slow_steps(clock, {})
    clock.now = start
    slowed = _run_with_slow_steps(clock, {plain - 100: 5.0})
    assert plain - 10 <= slowed <= plain - 8


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="positive number of minutes"):
        BudgetPlanner(0, 100)
    with pytest.raises(ValueError, match="cooldown_fraction"):
        BudgetPlanner(5, 100, cooldown_fraction=1.0)
    with pytest.raises(ValueError, match="max_steps"):
        BudgetPlanner(5, 0)


def test_process_start_is_in_the_past():
    import time

    assert 0 <= time.monotonic() - process_start_monotonic() < 3600


def test_vaswani_train_plans_prints_and_ends_the_schedule_at_the_plan(tmp_path, monkeypatch, capsys):
    """The real command with a budget: the plan is printed and recorded, training stops at the planned step, and
    the logged learning rate falls linearly over the cooldown."""
    import json

    from vaswani_training.lib.presets import PRESETS
    from vaswani_training.train import main

    monkeypatch.setitem(PRESETS["tiny"], "cooldown_fraction", 0.5)
    out = tmp_path / "run"
    metrics = main(["--preset", "tiny", "--output_dir", str(out), "--cache_dir", str(tmp_path / "cache"),
                    "--max_train_samples", "300", "--max_steps", "24", "--time_budget_minutes", "60",
                    "--length_penalty", "0.6", "--warmup_steps", "4", "--eval_strategy", "no",
                    "--max_test_samples", "4", "--save_steps", "100", "--logging_steps", "1", "--cpu_bf16", "no"])
    printed = capsys.readouterr().out
    assert "Time budget 60 min for the whole command" in printed and "Precision fp32 (--cpu_bf16 no)" in printed
    assert "-> 24 steps (the preset's full schedule), lr cooldown over the last 12" in printed
    assert metrics["train_steps"] == 24 and metrics["plan"]["planned_steps"] == 24
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["plan"]["cooldown_steps"] == 12 and 0 < saved["command_minutes"] < 60
    state = json.loads((out / "checkpoint-24" / "trainer_state.json").read_text())
    lrs = [log["learning_rate"] for log in state["log_history"] if "learning_rate" in log]
    tail = lrs[-12:]  # updates 13..24: a straight line down to lr(12) / 13
    assert all(a > b for a, b in zip(tail, tail[1:]))
    assert tail[-1] == pytest.approx(lrs[11] / 13, rel=1e-3)


@pytest.mark.parametrize("flags, capability, onednn_isa, native", [
    ("fpu avx2 avx512f avx512_bf16", "AVX512", None, True),
    ("fpu avx2 amx_bf16", "AVX512", "ALL", True),
    ("fpu avx2 avx512f avx512_bf16", "AVX2", None, False),  # ATEN_CPU_CAPABILITY=avx2
    ("fpu avx2 avx512f avx512_bf16", "AVX512", "AVX2", False),  # ONEDNN_MAX_CPU_ISA=AVX2
    ("fpu avx2 avx512f", "AVX512", None, False),  # no bf16 instructions at all
])
def test_native_bf16_follows_the_cpu_flags_and_the_restrictions(monkeypatch, tmp_path, flags, capability, onednn_isa,
                                                                native):
    """`cpu_has_native_bf16` on any CPU, with /proc/cpuinfo's flags and torch's capability stood in for."""
    import vaswani_training.lib.precision as precision

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor : 0\nflags : {flags}\n")
    real_path = precision.Path
    monkeypatch.setattr(precision, "Path", lambda path: cpuinfo if path == "/proc/cpuinfo" else real_path(path))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    if onednn_isa is None:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    else:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn_isa)
    assert precision.cpu_has_native_bf16() is native


def _cpu_flags() -> str:
    try:
        return open("/proc/cpuinfo").read()
    except OSError:
        return ""


@pytest.mark.skipif("avx512_bf16" not in _cpu_flags(),
                    reason="the real-hardware check needs a CPU with avx512_bf16 (on others bf16 is never native, and "
                           "test_native_bf16_follows_the_cpu_flags_and_the_restrictions covers the logic)")
def test_an_instruction_set_restriction_turns_native_bf16_off():
    """ATEN_CPU_CAPABILITY=avx2 / ONEDNN_MAX_CPU_ISA=AVX2 measure a plain AVX2 machine on one that has more: the run
    must then choose fp32, as it would there."""
    import subprocess
    import sys

    code = "from vaswani_training.lib.precision import cpu_has_native_bf16; print(cpu_has_native_bf16())"
    env = dict(__import__("os").environ)
    env.pop("ATEN_CPU_CAPABILITY", None), env.pop("ONEDNN_MAX_CPU_ISA", None)
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert plain.stdout.strip() == "True", plain.stderr
    for name, value in (("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2")):
        limited = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 env={**env, name: value})
        assert limited.stdout.strip() == "False", (name, limited.stderr)


def _recipe(cpu_bf16: str):
    from vaswani_training.lib.arguments import RecipeArguments

    return RecipeArguments(cpu_bf16=cpu_bf16)


@pytest.mark.parametrize("fp32, bf16, chosen", [
    (0.30, 0.19, True),  # bf16 1.6x faster (as on a Zen 5 EPYC)
    (0.30, 0.27, False),  # 1.11x: under the 1.15x margin, fp32
    (0.15, 0.22, False),  # bf16 slower (a Xeon with AVX512-BF16 and no AMX)
])
def test_auto_precision_measures_where_bf16_is_native(monkeypatch, fp32, bf16, chosen):
    from vaswani_training.lib import precision
    from vaswani_training.lib.arguments import ModelArguments
    from vaswani_training.lib.presets import PRESETS

    measured = []
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(precision, "time_training_precisions", lambda config: measured.append(config) or (fp32, bf16))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    use_bf16, reason = precision.cpu_precision(_recipe("auto"), ModelArguments(), PRESETS["cpu"])
    assert use_bf16 is chosen
    assert f"{bf16 * 1e3:.0f} ms in bf16 autocast against {fp32 * 1e3:.0f} ms in fp32" in reason
    assert ("--cpu_bf16 no for fp32" if chosen else "--cpu_bf16 yes for bf16") in reason
    (config,) = measured  # measured once, at the preset's widths and vocabulary
    assert (config.d_model, config.d_ff, config.num_heads, config.vocab_size) == (256, 1024, 4, 8000)


@pytest.mark.parametrize("cpu_bf16, native, world_size, chosen", [
    ("auto", False, "1", False),  # emulated bf16: never measured
    ("yes", False, "1", True),
    ("no", True, "1", False),
    ("yes", True, "1", True),
    ("auto", True, "2", True),  # several processes would each measure and could disagree: native means bf16
])
def test_precision_is_not_measured_where_nothing_is_to_choose(monkeypatch, cpu_bf16, native, world_size, chosen):
    from vaswani_training.lib import precision
    from vaswani_training.lib.arguments import ModelArguments
    from vaswani_training.lib.presets import PRESETS

    def fail(config):
        raise AssertionError("measured")

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(precision, "time_training_precisions", fail)
    monkeypatch.setenv("WORLD_SIZE", world_size)
    assert precision.cpu_precision(_recipe(cpu_bf16), ModelArguments(), PRESETS["cpu"])[0] is chosen
    with pytest.raises(ValueError, match="--cpu_bf16 must be auto, yes or no, got 'maybe'"):
        _recipe("maybe")  # refused when the flags are parsed


def test_precision_probe_uses_the_overridden_widths_and_a_saved_models_config(tmp_path):
    from vaswani_training.lib.arguments import ModelArguments
    from vaswani_training.lib.precision import precision_probe_config
    from vaswani_training.lib.presets import PRESETS

    config = precision_probe_config(ModelArguments(config_overrides="d_model=128,d_ff=512", vocab_size=3000),
                                    PRESETS["cpu"])
    assert (config.d_model, config.d_ff, config.num_heads, config.vocab_size) == (128, 512, 4, 3000)
    tiny_config(vocab_size=700, d_model=64, num_heads=2, d_ff=96).save_pretrained(tmp_path)
    saved = precision_probe_config(ModelArguments(model_name_or_path=str(tmp_path)), PRESETS["cpu"])
    assert (saved.d_model, saved.d_ff, saved.vocab_size) == (64, 96, 700)


def test_timing_both_precisions_leaves_the_random_state_and_the_config_alone():
    """The real measurement, on tiny widths; with learned positions it stays within their table."""
    from vaswani_training.lib.precision import time_training_precisions

    config = tiny_config(vocab_size=300, encoder_layers=2, decoder_layers=2, num_heads=2, d_ff=64)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    with torch.no_grad():  # the measured step needs gradients whatever the caller's mode
        fp32, bf16 = time_training_precisions(config, rows=4, length=6, repetitions=2)
    assert torch.equal(torch.rand(3), expected)
    assert all(math.isfinite(t) and t > 0 for t in (fp32, bf16))  # a measurement, not a speed: no upper bound
    assert (config.encoder_layers, config.decoder_layers) == (2, 2) and torch.is_grad_enabled()
    assert not torch.is_autocast_enabled("cpu")
    learned = tiny_config(vocab_size=300, num_heads=2, d_ff=64, position_embedding_type="learned",
                          max_position_embeddings=4)
    assert min(time_training_precisions(learned, rows=2, length=6, repetitions=1)) > 0  # 4 tokens, not 6


def test_a_burst_of_load_on_some_bf16_steps_does_not_decide_the_precision(monkeypatch):
    """Three of five bf16 steps slowed by other load (their median, 158 ms, against fp32's 166 ms is under the 1.15x
    margin and would take fp32): the fastest step of each precision counts, 110 ms against 165."""
    from vaswani_training.lib import precision

    script = iter([0.5, 0.5,  # the untimed first step of each
                   0.165, 0.160, 0.170, 0.158, 0.165, 0.110, 0.168, 0.158, 0.166, 0.112])  # fp32, bf16 alternating
    asked = []
    monkeypatch.setattr(precision, "_timed_step", lambda model, batch, bf16: asked.append(bf16) or next(script))
    fp32, bf16 = precision.time_training_precisions(tiny_config(vocab_size=300, num_heads=2, d_ff=64))
    assert (fp32, bf16) == (0.165, 0.110)
    assert asked == [False, True] * 6  # 1 untimed + 5 timed each, alternating
    assert fp32 >= precision.BF16_MIN_SPEEDUP * bf16  # bf16 is taken (the choice itself: the test above)


@pytest.mark.parametrize("cpu_bf16, native, budget", [
    ("auto", True, 18), ("yes", True, 18), ("no", True, 26), ("auto", False, 26), ("yes", False, 26)])
def test_the_budget_follows_the_cpu_not_the_precision_it_measures(monkeypatch, cpu_bf16, native, budget):
    """The cpu preset gives every CPU 26 minutes (a faster one spends them on more steps); a preset with a budget of
    its own for native bf16 (here one of 18 minutes) gives it to such a CPU whichever precision its measurement picks
    (a Xeon whose fp32 is faster trains in fp32 within it); --cpu_bf16 no, or no native bf16, the other; a GPU, the
    preset's."""
    from vaswani_training.lib import run
    from vaswani_training.lib.presets import PRESETS

    monkeypatch.setattr(run, "cpu_has_native_bf16", lambda: native)
    assert run.default_budget_minutes(PRESETS["cpu"], _recipe(cpu_bf16), "cpu") == 26
    split = {**PRESETS["cpu"], "time_budget_minutes_native_bf16": 18}
    assert run.default_budget_minutes(split, _recipe(cpu_bf16), "cpu") == budget
    assert run.default_budget_minutes(split, _recipe(cpu_bf16), "cuda") == 26
    assert run.default_budget_minutes(PRESETS["base"], _recipe(cpu_bf16), "cpu") is None


def test_the_loop_without_the_planner_stops_in_time_for_the_test_translation(tmp_path, monkeypatch):
    """train_no_trainer.py has no planner: with a budget it stops training at the budget (counted from the process
    start) less the estimated time after training, 10 s + the test sentences at the preset's guess per sentence (a
    CPU's: 0.05 s)."""
    import time

    from vaswani_training.lib import run as scaffold
    from vaswani_training.lib.arguments import DataArguments, ModelArguments, RecipeArguments
    from vaswani_training.lib.presets import PRESETS

    def new_run(preset: str, recipe: RecipeArguments, *, max_steps_given: bool = False):
        return scaffold.new_run(ModelArguments(preset=preset), DataArguments(), recipe, preset=PRESETS[preset],
                                output_dir=tmp_path, max_steps=100, warmup_steps=10, max_steps_given=max_steps_given,
                                device_type="cpu", resume_value=None)

    monkeypatch.setattr(scaffold, "process_start_monotonic", lambda: 1000.0)
    cpu = new_run("cpu", RecipeArguments(cpu_bf16="no"))
    assert cpu.plan.budget_minutes == 26 and cpu.data_args.max_eval_samples == 200
    assert scaffold.training_deadline(cpu, test_sentences=100) == pytest.approx(1000 + 26 * 60 - (10 + 100 * 0.05))
    gpu = new_run("gpu", RecipeArguments(cpu_bf16="no", time_budget_minutes=10))
    assert scaffold.training_deadline(gpu, test_sentences=1000) == pytest.approx(1000 + 600 - (10 + 1000 * 0.03))
    clock = new_run("cpu", RecipeArguments(cpu_bf16="no", max_train_minutes=1), max_steps_given=True)
    assert scaffold.training_deadline(clock, test_sentences=100) == pytest.approx(time.monotonic() + 60, abs=5)
    assert new_run("cpu", RecipeArguments(cpu_bf16="no"), max_steps_given=True).plan.budget_minutes is None
    assert scaffold.training_deadline(new_run("tiny", RecipeArguments(cpu_bf16="no")), test_sentences=9) is None
    with pytest.raises(ValueError, match="--time_budget_minutes must be a positive number of minutes, got 0"):
        new_run("tiny", RecipeArguments(time_budget_minutes=0))

