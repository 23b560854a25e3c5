"""Dropout set on a built model (training/lib/dropout.py): the cpu preset's `long_run_dropout`, which a run takes when
its plan fits enough updates, computes as a model built with it, and a resumed run keeps its checkpoint's choice."""

import json
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from helpers import padded_batch, tiny_model
from transformers import TrainerControl, TrainerState

from vaswani_hf import VaswaniForConditionalGeneration
from vaswani_hf.fast_paths_vaswani import training_fast_paths
from vaswani_training.lib.dropout import LongRunDropout, long_run_dropout, set_dropout
from vaswani_training.lib.presets import PRESETS
from vaswani_training.lib.publishing import render_model_card

SET = {"dropout": 0.2, "attention_dropout": 0.3, "activation_dropout": 0.25}


def _train_mode_loss(model, seed: int = 5) -> torch.Tensor:
    ids, mask = padded_batch(seed=1)
    labels = ids.roll(1, dims=1).masked_fill(mask == 0, -100)
    torch.manual_seed(seed)
    return model.train()(input_ids=ids, attention_mask=mask, labels=labels).loss


@pytest.mark.parametrize("fast_paths", [False, True])
def test_set_dropout_computes_as_the_model_built_with_it(fast_paths):
    """Same weights, same random state: the model given the dropout after construction (with the CPU training fast
    paths installed or not) gives the loss of the model built with it, and not the loss it gave before."""
    built = tiny_model(seed=3, **SET)
    changed = tiny_model(seed=3)
    changed.load_state_dict(built.state_dict())
    installed = (training_fast_paths(built), training_fast_paths(changed)) if fast_paths else (nullcontext(),) * 2
    with installed[0], installed[1]:
        before = _train_mode_loss(changed)
        set_dropout(changed, **SET)
        after, expected = _train_mode_loss(changed), _train_mode_loss(built)
    torch.testing.assert_close(after, expected, rtol=0, atol=0)
    assert abs(before.item() - after.item()) > 1e-3
    assert {name: getattr(changed.config, name) for name in SET} == SET


def test_set_dropout_refuses_what_is_not_a_dropout_probability():
    model = tiny_model()
    with pytest.raises(ValueError, match="'label_smoothing' is not a dropout field"):
        set_dropout(model, label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"attention_dropout=1.0 is not a probability in \[0, 1\)"):
        set_dropout(model, attention_dropout=1.0)
    assert model.config.attention_dropout == 0.0  # nothing set when one value is refused
    planner = SimpleNamespace(planned_steps=None)
    with pytest.raises(ValueError, match="LongRunDropout: no dropout field to set"):
        LongRunDropout(planner, 4000, {})
    with pytest.raises(ValueError, match=r"LongRunDropout: activation_dropout=1.5 is not a probability"):
        LongRunDropout(planner, 4000, {"activation_dropout": 1.5})
    with pytest.raises(ValueError, match="at_step must be >= 1, got 0"):
        LongRunDropout(planner, 4000, {"activation_dropout": 0.1}, at_step=0)


def _drive(callback, model, plans):
    """Call the callback as the Trainer would, the planner's plan after each step being `plans[step - 1]`."""
    args, state, control = SimpleNamespace(), TrainerState(), TrainerControl()
    callback.on_train_begin(args, state, control, model=model)
    for step, planned in enumerate(plans, start=1):
        callback.planner.planned_steps = planned
        state.global_step = step
        callback.on_step_end(args, state, control, model=model)


@pytest.mark.parametrize("first_plan, applied", [(4000, True), (4690, True), (3999, False), (3650, False)])
def test_the_first_plan_decides_once(first_plan, applied, capsys):
    """The dropout applies from `min_steps` planned updates on, decided at the first plan (at_step 1): a later plan
    across the threshold (a run that slows down, or speeds up) does not change it."""
    model = tiny_model()
    callback = LongRunDropout(SimpleNamespace(planned_steps=None), 4000,
                              {"attention_dropout": 0.1, "activation_dropout": 0.1})
    later = 3000 if applied else 6000
    _drive(callback, model, [None] * 11 + [first_plan] + [later] * 5)
    expected = 0.1 if applied else 0.0
    assert model.config.attention_dropout == expected and model.config.activation_dropout == expected
    assert all(layer.self_attn.dropout == expected and layer.activation_dropout.p == expected
               for layer in model.model.encoder.layers)
    assert all(layer.encoder_attn.dropout == expected for layer in model.model.decoder.layers)
    assert model.config.dropout == 0.1  # the paper's residual dropout stays
    assert callback.applied is applied
    printed = capsys.readouterr().out
    assert (f"Planned {first_plan} >= 4000 steps at step 12: training on with attention_dropout 0.1, "
            f"activation_dropout 0.1" in printed) is applied


@pytest.mark.parametrize("plan_at_50, applied", [(4200, True), (4451, True), (4199, False), (3788, False)])
def test_the_plan_at_at_step_decides_not_the_first(plan_at_50, applied, capsys):
    """With at_step 50 the plans of steps 12-49 do not decide, even across the threshold either way: the model keeps
    its build until the end of step 50, whose plan decides once for the rest of the run."""
    model = tiny_model()
    callback = LongRunDropout(SimpleNamespace(planned_steps=None), 4200,
                              {"attention_dropout": 0.1, "activation_dropout": 0.1}, at_step=50)
    before = 3000 if applied else 5000  # the first plans lie on the other side of the threshold
    _drive(callback, model, [None] * 11 + [before] * 38)
    assert callback.applied is None and model.config.attention_dropout == 0.0
    assert model.model.decoder.layers[0].activation_dropout.p == 0.0
    assert "Planned" not in capsys.readouterr().out
    plans = [None] * 11 + [before] * 38 + [plan_at_50] + [6000 if not applied else 3000] * 5
    model = tiny_model()
    callback = LongRunDropout(SimpleNamespace(planned_steps=None), 4200,
                              {"attention_dropout": 0.1, "activation_dropout": 0.1}, at_step=50)
    _drive(callback, model, plans)
    expected = 0.1 if applied else 0.0
    assert callback.applied is applied
    assert model.config.attention_dropout == expected and model.model.encoder.layers[1].self_attn.dropout == expected
    assert model.model.decoder.layers[0].activation_dropout.p == expected
    sign = ">=" if applied else "<"
    assert f"Planned {plan_at_50} {sign} 4200 steps at step 50:" in capsys.readouterr().out


def test_a_run_planned_to_end_before_at_step_decides_at_its_first_plan(capsys):
    """A plan that ends the run at or before at_step decides at once (not applied: it is below any useful
    threshold), so that metrics.json never records a choice that was not made."""
    callback = LongRunDropout(SimpleNamespace(planned_steps=None), 4200, {"attention_dropout": 0.1}, at_step=50)
    _drive(callback, tiny_model(), [None] * 11 + [40] * 3)
    assert callback.applied is False
    assert "Planned 40 < 4200 steps at step 12" in capsys.readouterr().out


def test_a_resumed_run_keeps_its_checkpoints_dropout(tmp_path):
    """Resuming: the checkpoint's config.json says what the run chose; the plan of the resumed run does not decide
    again, either way."""
    for saved, plan, expected in [(0.1, 3000, 0.1), (0.0, 6000, 0.0)]:
        checkpoint = tmp_path / f"checkpoint-{saved}"
        checkpoint.mkdir()
        (checkpoint / "config.json").write_text(json.dumps({"attention_dropout": saved, "activation_dropout": saved}))
        model = tiny_model()
        callback = LongRunDropout(SimpleNamespace(planned_steps=None), 4000,
                                  {"attention_dropout": 0.1, "activation_dropout": 0.1}, resume_from=str(checkpoint))
        _drive(callback, model, [plan] * 3)
        assert model.config.attention_dropout == expected and model.model.decoder.layers[0].activation_dropout.p \
            == expected


def test_a_run_resumed_from_before_at_step_still_decides(tmp_path, capsys):
    """A checkpoint saved before the deciding step (trainer_state.json's global_step < at_step) holds the model as
    built, not a choice: the resumed run decides at at_step; one saved at or after it keeps its choice."""
    for saved_step, saved, expected in [(20, 0.0, 0.1), (50, 0.0, 0.0)]:
        checkpoint = tmp_path / f"checkpoint-{saved_step}"
        checkpoint.mkdir()
        (checkpoint / "config.json").write_text(json.dumps({"attention_dropout": saved, "activation_dropout": saved}))
        (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": saved_step}))
        model = tiny_model()
        callback = LongRunDropout(SimpleNamespace(planned_steps=None), 4200,
                                  {"attention_dropout": 0.1, "activation_dropout": 0.1}, at_step=50,
                                  resume_from=str(checkpoint))
        _drive(callback, model, [5000] * 60)
        assert model.config.attention_dropout == expected and model.model.decoder.layers[0].activation_dropout.p \
            == expected
        assert ("Planned 5000 >= 4200 steps at step 50" in capsys.readouterr().out) is (expected == 0.1)


def test_the_cpu_preset_offers_it_and_the_command_line_wins():
    assert long_run_dropout(PRESETS["cpu"]) == {
        "min_steps": 4200, "at_step": 50, "probabilities": {"attention_dropout": 0.1, "activation_dropout": 0.1}}
    assert long_run_dropout(PRESETS["cpu"], "attention_dropout=0.0,d_model=128") == {
        "min_steps": 4200, "at_step": 50, "probabilities": {"activation_dropout": 0.1}}
    assert long_run_dropout({"long_run_dropout": {"min_steps": 10, "dropout": 0.2}}) == {
        "min_steps": 10, "at_step": 1, "probabilities": {"dropout": 0.2}}
    assert long_run_dropout(PRESETS["cpu"], "attention_dropout=0,activation_dropout=0") is None
    assert long_run_dropout(PRESETS["cpu"], model_name_or_path="some/model") is None
    assert all(long_run_dropout(PRESETS[name]) is None for name in ("base", "big", "gpu", "tiny"))


def test_vaswani_train_records_the_choice_in_the_saved_config_and_metrics(tmp_path, monkeypatch, capsys):
    """The real command with a budget: a plan of 24 updates reaches the tiny preset's threshold of 20 (set here,
    decided at step 15), so the saved model's config.json has the dropout and metrics.json says it was applied."""
    from vaswani_training.train import main

    monkeypatch.setitem(PRESETS["tiny"], "long_run_dropout", {"min_steps": 20, "at_step": 15, "attention_dropout": 0.1,
                                                              "activation_dropout": 0.05})
    out = tmp_path / "run"
    metrics = main(["--preset", "tiny", "--output_dir", str(out), "--cache_dir", str(tmp_path / "cache"),
                    "--max_train_samples", "300", "--max_steps", "24", "--time_budget_minutes", "60",
                    "--length_penalty", "0.6", "--warmup_steps", "4", "--eval_strategy", "no",
                    "--max_test_samples", "4", "--save_steps", "100", "--cpu_bf16", "no", "--report_to", "none"])
    assert "Planned 24 >= 20 steps at step 15: training on with attention_dropout 0.1, activation_dropout 0.05" in \
        capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["attention_dropout"] == 0.1 and config["activation_dropout"] == 0.05 and config["dropout"] == 0.1
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["long_run_dropout"] == metrics["long_run_dropout"] == {
        "min_steps": 20, "at_step": 15, "attention_dropout": 0.1, "activation_dropout": 0.05, "applied": True}
    card = render_model_card(VaswaniForConditionalGeneration.from_pretrained(out), saved, repo_id="someone/tiny")
    assert "| 0.1 (and 0.1 on attention probabilities, 0.05 after the FFN's ReLU: not in the paper) / 0.1 |" in card
    plain = render_model_card(tiny_model(), saved, repo_id="someone/tiny")
    assert "| 0.1 / 0.1 |" in plain and "not in the paper" not in plain


def test_vaswani_train_resumed_keeps_the_choice_its_checkpoint_made(tmp_path, monkeypatch, capsys):
    """The real command, stopped and resumed: the first run's plan (24 updates) takes the dropout at step 12 and
    checkpoint-12 records it; resumed from there with a threshold its plan no longer reaches, the run keeps the
    checkpoint's choice and says so in config.json and metrics.json, and it prints no new decision."""
    from vaswani_training.train import main

    out = tmp_path / "run"
    common = ["--preset", "tiny", "--output_dir", str(out), "--cache_dir", str(tmp_path / "cache"),
              "--max_train_samples", "300", "--max_steps", "24", "--time_budget_minutes", "60",
              "--length_penalty", "0.6", "--warmup_steps", "4", "--eval_strategy", "no", "--max_test_samples", "4",
              "--save_steps", "12", "--cpu_bf16", "no", "--report_to", "none"]
    monkeypatch.setitem(PRESETS["tiny"], "long_run_dropout", {"min_steps": 20, "attention_dropout": 0.1,
                                                              "activation_dropout": 0.05})
    main(common)
    assert "Planned 24 >= 20 steps" in capsys.readouterr().out
    saved = json.loads((out / "checkpoint-12" / "config.json").read_text())
    assert saved["attention_dropout"] == 0.1 and saved["activation_dropout"] == 0.05

    monkeypatch.setitem(PRESETS["tiny"], "long_run_dropout", {"min_steps": 1000, "attention_dropout": 0.1,
                                                              "activation_dropout": 0.05})
    metrics = main([*common, "--resume_from_checkpoint", str(out / "checkpoint-12")])
    printed = capsys.readouterr().out
    assert "1000 steps" not in printed
    config = json.loads((out / "config.json").read_text())
    assert config["attention_dropout"] == 0.1 and config["activation_dropout"] == 0.05
    assert metrics["long_run_dropout"] == {"min_steps": 1000, "at_step": 1, "attention_dropout": 0.1,
                                           "activation_dropout": 0.05, "applied": True}
