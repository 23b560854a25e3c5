"""`vaswani-train` (training/train.py, called in-process) on the tiny preset and slices of the shipped Multi30k.

- End to end: a few steps write the model, metrics, checkpoints and test translations; the folder loads with the Auto
  classes and the pipeline; the console scripts run; the wheel installs the package with its data.
- Flags mean what they say and are checked, with every model, tokenizer or position table that does not fit, before
  the first step.
- A run never writes into another run's folder; a resumed run is checked against the run it continues, before
  training, and nothing of the earlier run is lost.
- The run's outputs follow the umask, SIGTERM ends it at the next decoding step with a checkpoint, and no Hub token
  reaches a file.

Faults run for real in subprocesses (SIGKILL, then resume) are in tests/test_resume.py; the data checks through this
command in tests/test_data.py.
"""

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import (
    GERMAN,
    PLANTED_TOKEN,
    ROOT,
    copy_run,
    exits_with,
    listing,
    tiny_model,
    train_cli,
    write_parallel,
)
from transformers import AutoModelForSeq2SeqLM

from vaswani_hf.checks import CheckError, read_json
from vaswani_hf.decoding.translate import translate_sentences
from vaswani_training.lib.output_dir import RunLock

# End to end -----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from vaswani_training.train import main

    out = tmp_path_factory.mktemp("run")
    cache = tmp_path_factory.mktemp("cache")
    args = ["--preset", "tiny", "--output_dir", str(out), "--cache_dir", str(cache),
            "--max_train_samples", "400", "--max_eval_samples", "8", "--max_test_samples", "12",
            "--max_steps", "8", "--eval_steps", "4", "--save_steps", "4", "--logging_steps", "2",
            "--per_device_eval_batch_size", "8", "--num_samples", "2", "--length_penalty", "0.6"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = main(args)
    trained_warnings.extend(str(w.message) for w in caught)
    return out, cache, metrics, args


trained_warnings: list[str] = []  # what the run of `trained` warned


def test_run_writes_model_metrics_and_checkpoints(trained):
    out, cache, metrics, _ = trained
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["train_steps"] == 8 == metrics["train_steps"]
    assert 0.0 <= saved["test_bleu"] <= 100.0 and saved["test_sentences"] == 12
    assert "tok:13a" in saved["test_bleu_signature"] and "test_tok_bleu" in saved
    assert saved["num_beams"] == 4 and saved["length_penalty"] == 0.6
    assert len((out / "test_translations.txt").read_text(encoding="utf-8").splitlines()) == 12
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    state = json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())
    assert any("eval_bleu" in log for log in state["log_history"]), "validation BLEU is computed during training"
    losses = [log["loss"] for log in state["log_history"] if "loss" in log]
    assert all(loss == loss and loss > 0 for loss in losses)
    # The paper's schedule: lr grows linearly during warmup (tiny preset warmup 10 > 8 steps).
    lrs = [log["learning_rate"] for log in state["log_history"] if "learning_rate" in log]
    assert lrs == sorted(lrs) and lrs[0] > 0
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert list(cache.glob("tokenizers/*/tokenizer.json")), "the joint BPE is cached for the next run"


def test_a_run_on_a_cpu_pins_no_memory(trained):
    """Validation and test loaders too: torch warns that pinned memory is unused where there is no accelerator (with
    one, the loaders pin memory on purpose and nothing warns either)."""
    assert not [w for w in trained_warnings if "pin_memory" in w], trained_warnings


def test_output_folder_loads_with_auto_classes_and_pipeline(trained):
    from transformers import AutoTokenizer, pipeline

    import vaswani_hf  # noqa: F401

    out = trained[0]
    model = AutoModelForSeq2SeqLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "VaswaniForConditionalGeneration"
    assert model.generation_config.num_beams == 4 and model.generation_config.length_penalty == 0.6
    translator = pipeline("translation", model=model, tokenizer=tokenizer)
    result = translator("Ein Mann fährt Fahrrad.", max_new_tokens=5)
    assert isinstance(result[0]["translation_text"], str)


def test_translate_command_reads_file_and_writes_aligned_output(trained, tmp_path):
    from vaswani_training.translate import main as translate_main

    out = trained[0]
    src = tmp_path / "in.de"
    src.write_text("Ein Hund läuft.\n\nZwei Männer spielen Fußball.\n", encoding="utf-8")
    dst = tmp_path / "out.en"
    assert translate_main(["--model", str(out), "--input", str(src), "--output", str(dst),
                           "--num_beams", "2", "--max_new_tokens", "6"]) == 0
    lines = dst.read_text(encoding="utf-8").split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""  # 3 lines + final newline; the empty one kept


def test_second_run_reuses_cached_tokenizer(trained, tmp_path, caplog):
    from vaswani_training.train import main

    out, cache, _, args = trained
    args = list(args)
    args[args.index("--output_dir") + 1] = str(tmp_path / "again")
    args[args.index("--max_steps") + 1] = "1"
    args += ["--eval_strategy", "no", "--max_test_samples", "2"]
    before = sorted(cache.glob("tokenizers/*"))
    with caplog.at_level("INFO", logger="vaswani_hf.training"):
        main(args)
    assert sorted(cache.glob("tokenizers/*")) == before
    assert any("Reusing the joint BPE" in r.message for r in caplog.records)


def test_bad_preset_and_override_errors_are_clear():
    from vaswani_training.lib.arguments import ModelArguments
    from vaswani_training.lib.presets import parse_overrides, resolve_preset

    with pytest.raises(ValueError, match="unknown; choose one of"):
        resolve_preset(ModelArguments(preset="huge"))
    with pytest.raises(ValueError, match="no field 'd_modle'"):
        parse_overrides("d_modle=3")
    assert parse_overrides("d_model=64,normalize_before=true,dropout=0.2") == {
        "d_model": 64, "normalize_before": True, "dropout": 0.2}


def test_train_script_help_runs_as_a_script():
    result = subprocess.run([sys.executable, str(ROOT / "training" / "train.py"), "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "--max_tokens" in result.stdout and "--preset" in result.stdout


def test_console_entry_points_exit_0_after_a_run(monkeypatch):
    """`vaswani-train` must exit 0: `main` returns the metrics dict, which `sys.exit(main())` would turn into status
    1."""
    import tomllib

    import vaswani_training.train as train
    import vaswani_training.train_no_trainer as no_trainer

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["vaswani-train"] == "vaswani_training.train:cli"
    assert scripts["vaswani-train-no-trainer"] == "vaswani_training.train_no_trainer:cli"
    for module in (train, no_trainer):
        monkeypatch.setattr(module, "main", lambda argv=None: {"test_bleu": 35.0})
        assert module.cli() == 0


def test_the_wheel_installs_vaswani_hf_with_its_data_and_vaswani_training(tmp_path):
    """The wheel holds two packages and no generic top-level `training`: the library with the shipped Multi30k as its
    package data (it reads it), and the commands of training/ as vaswani_training, where every console entry points."""
    import shutil
    import zipfile

    source = tmp_path / "source"  # built from a copy: a build writes build/ and *.egg-info beside pyproject.toml
    for name in ("vaswani_hf", "training"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                             "-q", "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    archive = zipfile.ZipFile(wheel)
    names = set(archive.namelist())
    assert {name.split("/")[0] for name in names} == {"vaswani_hf", "vaswani_training", "vaswani_hf-0.1.0.dist-info"}
    library = {p.relative_to(ROOT).as_posix() for p in (ROOT / "vaswani_hf").rglob("*")
               if p.is_file() and (p.suffix == ".py" or "corpora" in p.parts) and "__pycache__" not in p.parts}
    assert {"vaswani_hf/corpora/multi30k/train.de.gz", "vaswani_hf/corpora/multi30k/README.md",
            "vaswani_hf/corpora/multi30k/tok/test_2016_flickr.lc.norm.tok.en.gz"} <= library
    assert library <= names, sorted(library - names)  # every module and data file, subpackages included
    folder = ROOT / "training"
    commands = {"vaswani_training/" + p.relative_to(folder).as_posix() for p in folder.rglob("*")
                if p.is_file() and p.suffix in (".py", ".yaml") and "__pycache__" not in p.parts}
    assert "vaswani_training/accelerate_configs/cpu_2proc.yaml" in commands and commands <= names
    # The model card template of vaswani-publish: training/model_card.md links to the one at the repository root.
    assert archive.read("vaswani_training/model_card.md") == (ROOT / "model_card.md").read_bytes()
    entry_points = archive.read("vaswani_hf-0.1.0.dist-info/entry_points.txt").decode().split("[console_scripts]")[1]
    targets = [line.split(" = ")[1] for line in entry_points.split("\n") if " = " in line]
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert sorted(targets) == sorted(scripts.values()) and len(targets) >= 9  # vaswani-train ... vaswani-demo
    assert all(target.startswith("vaswani_training.") for target in targets)


def test_training_smooths_labels_and_evaluation_does_not(tmp_path):
    """§5.4: the recipe trains on the label-smoothed loss (--label_smoothing_factor, 0.1 by default); eval_loss, also
    during training, is the model's plain cross-entropy, the number transformers users read as log-perplexity."""
    from datasets import Dataset
    from transformers import Seq2SeqTrainingArguments

    from vaswani_hf.modeling_vaswani import cross_entropy_loss
    from vaswani_training.train import TRAINER_DEFAULTS, PaperTrainer

    assert TRAINER_DEFAULTS["label_smoothing_factor"] == 0.1
    model = tiny_model(dropout=0.0)
    generator = torch.Generator().manual_seed(2)
    ids, labels = torch.randint(4, 99, (3, 9), generator=generator), torch.randint(4, 99, (3, 7), generator=generator)
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    with torch.no_grad():
        logits = model(**batch).logits
    smoothed, plain_before = (cross_entropy_loss(logits, labels, label_smoothing=eps).item() for eps in (0.1, 0.0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * 9] * 3, "labels": labels.tolist()})
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1, logging_steps=1,
                                    eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=3,
                                    save_strategy="no", label_smoothing_factor=0.1)
    stack = lambda rows: {key: torch.tensor([row[key] for row in rows]) for key in rows[0]}  # noqa: E731
    trainer = PaperTrainer(model=model, args=args, train_dataset=data, eval_dataset=data, max_tokens=64, d_model=32,
                           warmup=10, lr_factor=1.0, data_collator=stack)
    trainer.train()
    logged = {key: entry[key] for entry in trainer.state.log_history for key in ("loss", "eval_loss") if key in entry}
    with torch.no_grad():
        plain_after = model.eval()(**batch).loss.item()
    assert logged["loss"] == pytest.approx(smoothed, rel=1e-5)  # the step's loss, before its update
    assert logged["eval_loss"] == pytest.approx(plain_after, rel=1e-5)  # evaluated after the update, unsmoothed
    assert abs(smoothed - plain_before) > 1e-3 and abs(plain_after - plain_before) > 1e-4  # the step changed it


def test_paper_trainer_takes_the_gradient_norm_at_the_steps_that_log_it(tmp_path, monkeypatch):
    """Trainer computes the gradient norm at every step only to log it; PaperTrainer computes it at the logging steps
    (every 3rd), and the logged value is the norm of that step's gradients (no clipping, as the recipe trains)."""
    from datasets import Dataset
    from transformers import Seq2SeqTrainingArguments

    from vaswani_training.train import PaperTrainer

    model = tiny_model(dropout=0.0)
    generator = torch.Generator().manual_seed(4)
    ids, labels = torch.randint(4, 99, (3, 9), generator=generator), torch.randint(4, 99, (3, 7), generator=generator)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * 9] * 3, "labels": labels.tolist()})
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=7, logging_steps=3,
                                    save_strategy="no", eval_strategy="no", max_grad_norm=0.0)
    stack = lambda rows: {key: torch.tensor([row[key] for row in rows]) for key in rows[0]}  # noqa: E731
    trainer = PaperTrainer(model=model, args=args, train_dataset=data, max_tokens=64, d_model=32, warmup=10,
                           lr_factor=1.0, data_collator=stack)
    norms, real = {}, trainer.accelerator.clip_grad_norm_

    def clip_grad_norm_(parameters, max_norm):
        parameters = list(parameters)
        norms[trainer.state.global_step + 1] = float(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad) for p in parameters if p.grad is not None])))
        return real(parameters, max_norm)

    monkeypatch.setattr(trainer.accelerator, "clip_grad_norm_", clip_grad_norm_)
    trainer.train()
    logged = {entry["step"]: entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry}
    assert sorted(norms) == sorted(logged) == [3, 6]
    for step, norm in logged.items():
        assert norm == pytest.approx(norms[step], rel=1e-5) and norm > 0


def test_paper_trainer_uses_the_papers_adam_fused_on_the_cpu(tmp_path):
    """§5.3's Adam(0.9, 0.98, 1e-9), as one fused kernel on the CPU; its updates equal the foreach Adam's."""
    from transformers import Seq2SeqTrainingArguments

    from vaswani_hf.schedule import paper_adam
    from vaswani_training.train import PaperTrainer

    model = tiny_model(dropout=0.0)
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = PaperTrainer(model=model, args=args, max_tokens=64, d_model=32, warmup=10, lr_factor=1.0)
    optimizer = trainer.create_optimizer()
    group = optimizer.param_groups[0]
    assert group["fused"] is True and group["betas"] == (0.9, 0.98) and group["eps"] == 1e-9
    reference_model = tiny_model(dropout=0.0)
    reference_model.load_state_dict(model.state_dict())
    reference = paper_adam(reference_model.parameters(), lr=1e-3, foreach=True)
    for g in optimizer.param_groups:
        g["lr"] = 1e-3
    for _ in range(3):
        for m, opt in ((model, optimizer), (reference_model, reference)):
            loss = sum((p.float() ** 2).sum() for p in m.parameters())
            loss.backward()
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(model.state_dict().items(), reference_model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_paper_trainer_pins_batches_only_for_an_accelerator(tmp_path, recwarn):
    """On a CPU the training batches are not pinned (nothing to copy them to; torch would warn at every epoch)."""
    from transformers import Seq2SeqTrainingArguments

    from vaswani_training.train import PaperTrainer

    # the CPU device, as vaswani-train gets on a machine without a GPU (use_cpu: the same on any machine)
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), report_to=[], dataloader_pin_memory=True, use_cpu=True)
    assert args.device.type == "cpu"
    from datasets import Dataset

    rows = Dataset.from_list([{"input_ids": [5, 6, 2], "attention_mask": [1, 1, 1], "labels": [7, 2]}] * 4)
    trainer = PaperTrainer(model=tiny_model(), args=args, train_dataset=rows, max_tokens=64, d_model=32,
                           warmup=10, lr_factor=1.0)
    loader = trainer.get_train_dataloader()
    assert getattr(loader, "base_dataloader", loader).pin_memory is False
    next(iter(loader))
    assert not [w for w in recwarn if "pin_memory" in str(w.message)]


# Flags mean what they say, and are checked before training ------------------------------------------------------------


def test_the_dashed_max_steps_overrides_the_preset(tiny_run):
    out, metrics = tiny_run
    assert metrics["train_steps"] == 3  # the tiny preset's max_steps is 20
    assert sorted(p.name for p in out.glob("checkpoint-*"))[-1] == "checkpoint-3"


def test_given_flags_counts_every_spelling():
    from vaswani_training.lib.run import given_flags
    from vaswani_training.train import build_parser

    parser = build_parser()
    assert {"max_steps", "warmup_steps", "save_steps"} <= given_flags(
        parser, ["--max-steps", "3", "--warmup_steps=2", "--save-steps=4"])
    # An abbreviation would set a flag without counting as given (the preset would win): refused.
    with pytest.raises(ValueError, match="not used by the HfArgumentParser: \\['--max_st', '3'\\]"):
        parser.parse_args_into_dataclasses(args=["--max_st", "3", "--output_dir", "x"])


def test_config_overrides_are_refused_with_a_saved_model(tmp_path, model_folder, train_cache):
    with pytest.raises(CheckError, match="--config_overrides .* cannot apply to --model_name_or_path"):
        train_cli(tmp_path / "out", train_cache, "--model_name_or_path", model_folder, "--config_overrides", "d_ff=8")
    assert not (tmp_path / "out").exists()


def test_a_truthy_string_for_a_bool_override_is_refused(tmp_path, train_cache):
    with pytest.raises(ValueError, match="normalize_before must be true or false .* got 'no'"):
        train_cli(tmp_path / "out", train_cache, "--max_steps", "1", "--config_overrides", "normalize_before=no")
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_average_last_is_checked_before_training(tmp_path, train_cache):
    from vaswani_training.lib.checkpoints import check_average_last

    with pytest.raises(CheckError, match="--save_total_limit 2 deletes all but 2"):
        train_cli(tmp_path / "a", train_cache, "--max_steps", "4", "--save_steps", "1", "--average_last", "3",
                  "--save_total_limit", "2")
    with pytest.raises(CheckError, match="writes only 1 checkpoint"):
        train_cli(tmp_path / "b", train_cache, "--max_steps", "4", "--save_steps", "4", "--average_last", "5")
    for folder in (tmp_path / "a", tmp_path / "b"):
        assert not list(folder.glob("checkpoint-*")), "refused before any training"
    # The default limit (not the user's choice) is raised to what averaging needs.
    assert check_average_last(6, save_total_limit=5, save_total_limit_given=False, saving=True, max_steps=60,
                              save_steps=10, resuming=False) == 6


@pytest.mark.parametrize(("flags", "message"), [
    (["--lr_factor", "0"], "--lr_factor must be a positive number"),
    (["--lr_factor", "nan"], "--lr_factor must be a positive number"),
    (["--max_train_minutes", "0"], "--max_train_minutes must be a positive number"),
    (["--config_overrides", "pad_token_id=5"], "--config_overrides pad_token_id: set by the joint BPE"),
    (["--config_overrides", "d_model=64,vocab_size=300"], "--config_overrides vocab_size: set by the joint BPE"),
    (["--length_penalty_style", "paper"], "--length_penalty_style must be hf (transformers' generate(): |Y|^alpha) or "
                                          "gnmt"),
])
def test_flags_that_would_be_ignored_or_crash_are_refused(tmp_path, train_cache, flags, message):
    with pytest.raises(CheckError, match=re.escape(message)):
        train_cli(tmp_path / "out", train_cache, "--max_steps", "1", *flags)
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_run_output_dir_that_is_a_file_is_refused_before_work(tmp_path, train_cache):
    (tmp_path / "out").write_text("not a folder")
    with pytest.raises(CheckError, match="is a file, not a folder"):
        train_cli(tmp_path / "out", train_cache, "--max_steps", "1")


# A run never writes into another run's folder -------------------------------------------------------------------------


def test_averaging_uses_only_this_runs_checkpoints(tiny_run):
    out, _ = tiny_run
    averaged = json.loads((out / "averaged_from.json").read_text())["averaged_checkpoints"]
    assert [Path(p).name for p in averaged] == ["checkpoint-2", "checkpoint-3"]


def test_another_runs_folder_is_refused_unless_overwritten(tiny_run, tmp_path, train_cache):
    earlier, _ = tiny_run
    folder = tmp_path / "shared"
    for step in (100, 200):  # an earlier, longer run's checkpoints: newer by step than anything the new run writes
        shutil.copytree(earlier / "checkpoint-3", folder / f"checkpoint-{step}")
    before = listing(folder)
    with pytest.raises(CheckError, match="holds another run .* --overwrite_output_dir"):
        train_cli(folder, train_cache, "--max_steps", "2", "--save_steps", "1", "--average_last", "2")
    assert listing(folder) == before, "nothing written into the earlier run"
    train_cli(folder, train_cache, "--max_steps", "2", "--save_steps", "1", "--average_last", "2",
              "--overwrite_output_dir")
    averaged = json.loads((folder / "averaged_from.json").read_text())["averaged_checkpoints"]
    assert [Path(p).name for p in averaged] == ["checkpoint-1", "checkpoint-2"]
    assert sorted(p.name for p in folder.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"], "earlier ones gone"


def test_a_second_run_into_a_folder_in_use_is_refused(tmp_path, train_cache):
    folder = tmp_path / "busy"
    with RunLock(folder):
        with pytest.raises(CheckError, match="another run is writing this folder"):
            train_cli(folder, train_cache, "--max_steps", "1")
    assert not list(folder.glob("checkpoint-*"))
    with RunLock(folder):  # released: the next run may take it
        pass


# Resuming: checked before training, nothing of the earlier run lost ---------------------------------------------------


def plant_nan(checkpoint: Path) -> None:
    """One tensor of a checkpoint's weights set to NaN, as a run that diverged saves it."""
    from safetensors.torch import load_file, save_file

    weights = load_file(checkpoint / "model.safetensors")
    name = next(name for name in weights if name.endswith("fc2.bias"))
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})


def test_resuming_a_checkpoint_with_nan_weights_is_refused_before_training(tiny_run, tmp_path, train_cache):
    source = copy_run(tiny_run, tmp_path)
    plant_nan(source / "checkpoint-3")
    before = listing(source)
    for value in ("last", str(source / "checkpoint-3")):
        with pytest.raises(CheckError, match=re.escape(f"the weights of {source / 'checkpoint-3'} hold NaN or infinite "
                                                       f"values (1 tensor(s)") + r"[\s\S]*newest earlier checkpoint "
                                             r"with finite weights is .*checkpoint-2"):
            train_cli(source, train_cache, "--max_steps", "5", "--save_steps", "1", "--resume_from_checkpoint", value)
    assert listing(source) == before, "the run's model, metrics and translations are untouched"


@pytest.mark.parametrize(("flags", "message"), [
    (["--max_tokens", "1024"], "--max_tokens: the run has 512, this command 1024"),
    (["--preset", "cpu"], "--preset: the run has 'tiny', this command 'cpu'"),
    (["--lr_factor", "2.0"], "--lr_factor: the run has 1.0, this command 2.0"),
])
def test_resuming_with_other_settings_is_refused_before_training(tiny_run, tmp_path, train_cache, flags, message):
    source = copy_run(tiny_run, tmp_path)
    before = listing(source)
    with pytest.raises(CheckError, match=re.escape(message) + ".*pass the run's values"):
        train_cli(source, train_cache, "--max_steps", "5", "--save_steps", "1", "--resume_from_checkpoint", "last",
                  *flags)
    assert listing(source) == before


def test_resuming_a_checkpoint_without_settings_compares_the_models_shape(tiny_run, tmp_path, train_cache):
    from vaswani_training.lib.checkpoints import RUN_SETTINGS

    source = copy_run(tiny_run, tmp_path)
    (source / "checkpoint-3" / RUN_SETTINGS).unlink()
    with pytest.raises(CheckError, match=r"config d_model: the run has 32, this command 256"):
        train_cli(source, train_cache, "--max_steps", "5", "--resume_from_checkpoint", "last", "--preset", "cpu")


def test_run_settings_name_a_hub_model_as_given_and_a_local_folder_by_its_absolute_path(tmp_path, monkeypatch):
    """What a checkpoint's vaswani_run.json records of the model and tokenizer a run starts from: the same local folder
    given from another working directory compares equal, and a Hub id is kept, so that another one is refused."""
    from vaswani_training.lib.arguments import DataArguments, ModelArguments, RecipeArguments
    from vaswani_training.lib.checkpoints import run_settings
    from vaswani_training.lib.presets import PRESETS
    from vaswani_training.lib.run import new_run

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bpe").mkdir()
    model_args = ModelArguments(preset="tiny", model_name_or_path="someone/vaswani-base", tokenizer_name="bpe")
    run = new_run(model_args, DataArguments(), RecipeArguments(), preset=PRESETS["tiny"], output_dir=tmp_path / "out",
                  max_steps=10, warmup_steps=2, max_steps_given=True, device_type="cpu", resume_value=None)
    settings = run_settings(run)
    assert settings["model_name_or_path"] == "someone/vaswani-base"
    assert settings["tokenizer_name"] == str((tmp_path / "bpe").resolve())


def test_a_resumed_run_with_too_few_checkpoints_to_average_is_refused_before_training(tiny_run, tmp_path, train_cache):
    source = copy_run(tiny_run, tmp_path)
    before = listing(source)
    with pytest.raises(CheckError, match=r"--average_last 5: resuming checkpoint-3 to --max_steps 4 with "
                                         r"--save_steps 1 leaves 4 checkpoint\(s\)"):
        train_cli(source, train_cache, "--max_steps", "4", "--save_steps", "1", "--resume_from_checkpoint", "last",
                  "--average_last", "5")
    assert listing(source) == before


def test_a_resumed_run_stopped_in_its_test_translation_leaves_no_old_metrics_beside_new_weights(
        tiny_run, tmp_path, train_cache, monkeypatch):
    """A resumed run writes its model, then is killed while it translates the test set: the earlier metrics and
    translations were moved aside first, so that publishing shows no BLEU for the new weights; put back, they are
    refused."""
    import vaswani_training.lib.scoring
    from vaswani_training.publish import main as publish_main

    source = copy_run(tiny_run, tmp_path)
    old_metrics = (source / "metrics.json").read_bytes()
    old_translations = (source / "test_translations.txt").read_bytes()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed during the test translation")

    monkeypatch.setattr(vaswani_training.lib.scoring, "evaluate_test_set", killed)
    with pytest.raises(KeyboardInterrupt):
        train_cli(source, train_cache, "--max_steps", "4", "--save_steps", "1", "--resume_from_checkpoint", "last")
    assert (source / "checkpoint-4").is_dir()
    assert not (source / "metrics.json").exists() and not (source / "test_translations.txt").exists()
    assert (source / "metrics.step-3.json").read_bytes() == old_metrics, "kept, under another name"
    assert (source / "test_translations.step-3.txt").read_bytes() == old_translations
    published = tmp_path / "published"
    assert publish_main(["--model_dir", str(source), "--output_dir", str(published)]) == 0
    readme = (published / "README.md").read_text(encoding="utf-8")
    assert str(json.loads(old_metrics)["test_bleu_signature"]) not in readme and "model-index" not in readme
    assert "carries no record of how the model was trained" in readme
    (source / "metrics.json").write_bytes(old_metrics)  # a user puts the old file back
    exits_with(lambda: publish_main(["--model_dir", str(source), "--output_dir", str(tmp_path / "again")]),
               re.escape(f"{source / 'metrics.json'} does not describe the weights in {source}"), "vaswani-evaluate")
    assert not (tmp_path / "again").exists()


# The run's outputs: permissions, SIGTERM, no secrets, the tokenizer cache ---------------------------------------------


def test_the_runs_outputs_follow_the_umask(tiny_run):
    from vaswani_hf.checks import current_umask

    out, _ = tiny_run
    mask = current_umask()
    for path in (out / "metrics.json", out / "test_translations.txt", out / "model.safetensors",
                 out / "averaged_from.json", out / "checkpoint-3" / "model.safetensors",
                 out / "checkpoint-3" / "vaswani_run.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask, path


def test_sigterm_during_validation_stops_within_a_decoding_step(tmp_path, train_cache, monkeypatch):
    """SIGTERM while the validation set is being translated: the batch ends at its next token, the rest of the
    validation set is skipped, the step's checkpoint is saved and the run ends without the test translation (a
    scheduler's SIGKILL follows), with metrics.json saying so."""
    from transformers import Seq2SeqTrainer

    from vaswani_training.lib.checkpoints import checkpoint_problems

    original = Seq2SeqTrainer.prediction_step
    lengths = []

    def first_batch_then_sigterm(self, *args, **kwargs):
        if not lengths:
            os.kill(os.getpid(), signal.SIGTERM)
        output = original(self, *args, **kwargs)
        lengths.append(int(output[1].ne(self.model.config.pad_token_id).sum(-1).max()))  # Trainer pads them
        return output

    monkeypatch.setattr(Seq2SeqTrainer, "prediction_step", first_batch_then_sigterm)
    out = tmp_path / "out"
    metrics = train_cli(out, train_cache, "--max_steps", "6", "--save_steps", "100", "--eval_strategy", "steps",
                        "--eval_steps", "2", "--max_eval_samples", "40", "--per_device_eval_batch_size", "4",
                        "--generation_max_length", "128")
    assert len(lengths) == 1 and lengths[0] <= 3, lengths  # 1 of 10 batches, cut after its first token
    assert metrics["train_steps"] == 2 and metrics["stopped_by"] == "SIGTERM" and "test_bleu" not in metrics
    assert json.loads((out / "metrics.json").read_text())["stopped_by"] == "SIGTERM"
    assert not (out / "test_translations.txt").exists()
    assert checkpoint_problems(out / "checkpoint-2") == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "the handler is given back after training"


def test_the_hub_token_is_in_no_file_of_a_run_or_a_published_folder(tiny_run, tmp_path):
    from vaswani_training.publish import main as publish_main

    out, _ = tiny_run
    published = tmp_path / "published"
    assert publish_main(["--model_dir", str(out), "--output_dir", str(published), "--hub_token", PLANTED_TOKEN]) == 0
    files = [p for folder in (out, published) for p in folder.rglob("*") if p.is_file()]
    assert any(p.name == "training_args.bin" for p in files), "the search covers Trainer's pickled arguments"
    leaked = [str(p) for p in files if PLANTED_TOKEN.encode() in p.read_bytes()]
    assert not leaked, f"the token was written to {leaked}"


def test_a_damaged_cached_tokenizer_is_trained_again(tmp_path):
    import datasets

    from vaswani_training.lib.arguments import DataArguments, ModelArguments
    from vaswani_training.lib.prepare import get_tokenizer

    data = datasets.Dataset.from_dict({"translation": [{"de": "Ein Hund läuft.", "en": "A dog runs."},
                                                       {"de": "Eine Katze.", "en": "A cat."}]})
    model_args = ModelArguments(cache_dir=str(tmp_path))
    first = get_tokenizer(model_args, data, DataArguments(), 300)
    (cached,) = (tmp_path / "tokenizers").iterdir()
    (cached / "tokenizer.json").write_text('{"version": ')
    again = get_tokenizer(model_args, data, DataArguments(), 300)
    assert again.get_vocab() == first.get_vocab()
    assert read_json(cached / "tokenizer.json")["model"]["type"] == "BPE", "the cache entry is rebuilt"


# Model, tokenizer and positions that do not fit are refused before the first step -------------------------------------


def test_train_cli_tokenizer_of_another_size_than_the_model(tmp_path, model_folder, tiny_tokenizer):
    small = tmp_path / "small"
    tiny_model().save_pretrained(small)  # vocabulary of 99, the tokenizer has 420
    prefix = write_parallel(tmp_path / "data")
    with pytest.raises(ValueError, match=f"tokenizer has {len(tiny_tokenizer)} entries but the model's vocabulary "
                                         f"has 99; pass the tokenizer saved with the model"):
        train_cli(tmp_path / "out", tmp_path / "cache", "--max_steps", "1", "--train_file", prefix,
                  "--model_name_or_path", small, "--tokenizer_name", model_folder)


def test_train_cli_impossible_config_sizes(tmp_path):
    prefix = write_parallel(tmp_path / "data")
    one_step = (tmp_path / "out", tmp_path / "cache", "--max_steps", "1", "--train_file", prefix)
    with pytest.raises(ValueError, match=r"d_model \(30\) must be divisible by num_heads \(4\).*num_heads=3"):
        train_cli(*one_step, "--config_overrides", "d_model=30,num_heads=4")
    with pytest.raises(ValueError, match="d_ff must be a positive integer, got 0"):
        train_cli(*one_step, "--config_overrides", "d_ff=0")
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.5"):
        train_cli(*one_step, "--config_overrides", "dropout=1.5")


def test_learned_positions_refuse_long_input_when_translating_and_training(tmp_path, tiny_tokenizer):
    model = tiny_model(vocab_size=len(tiny_tokenizer), position_embedding_type="learned",
                       max_position_embeddings=8)
    with pytest.raises(ValueError, match=r"Sequence of \d+ tokens is longer than max_position_embeddings=8.*"
                                         r"Truncate the input"):
        translate_sentences(model, tiny_tokenizer, [" ".join(GERMAN[:2])], num_beams=1, max_new_tokens=3)
    # Generating past the table fails the same way, at the first position past it.
    with pytest.raises(ValueError, match=r"Sequence of 9 tokens is longer than max_position_embeddings=8"):
        model.generate(input_ids=torch.tensor([[5, 6, 2]]), num_beams=1, min_new_tokens=12, max_new_tokens=12)
    # The train command refuses before the first step.
    prefix = write_parallel(tmp_path / "data")
    with pytest.raises(ValueError, match=r"learned positions for 16 tokens \(max_position_embeddings\), fewer than "
                                         r"--max_source_length 256, --max_target_length 256.*sinusoidal"):
        train_cli(tmp_path / "out", tmp_path / "cache", "--max_steps", "1", "--train_file", prefix,
                  "--config_overrides", "position_embedding_type=learned,max_position_embeddings=16")
    # The loop without Trainer runs the same check, with the same message.
    from vaswani_training.train_no_trainer import main as train_no_trainer

    with pytest.raises(ValueError, match=r"learned positions for 16 tokens \(max_position_embeddings\), fewer than "
                                         r"--max_source_length 256, --max_target_length 256.*sinusoidal"):
        train_no_trainer(["--preset", "tiny", "--output_dir", str(tmp_path / "nt"), "--cache_dir",
                          str(tmp_path / "cache"), "--max_steps", "1", "--cpu_bf16", "no", "--train_file", prefix,
                          "--config_overrides", "position_embedding_type=learned,max_position_embeddings=16"])
    assert not list((tmp_path / "nt").glob("*checkpoint-*"))


# --streaming: the training split read as a stream, for corpora larger than memory -------------------------------------


def test_streaming_trains_on_a_local_folder_in_the_hubs_layout(tmp_path):
    """A wmt14-layout folder (train/validation/test.jsonl) read with --streaming: the BPE learns from one pass over the
    stream, training runs its --max_steps, and test BLEU is computed from the test split as usual."""
    from vaswani_training.synthetic import write_synthetic_corpus

    write_synthetic_corpus(tmp_path / "wmt", 300, validation_pairs=20, test_pairs=4, seed=1)
    metrics = train_cli(tmp_path / "out", tmp_path / "cache", "--dataset_name", tmp_path / "wmt", "--streaming",
                        "--max_steps", "4", "--max_tokens", "400", "--vocab_size", "400", "--max_source_length", "60",
                        "--max_target_length", "60")
    assert metrics["train_steps"] == 4
    assert "train_tokens_per_second" not in metrics and "test_bleu" in metrics
    assert (tmp_path / "out" / "model.safetensors").is_file()
    (bpe,) = (tmp_path / "cache" / "tokenizers").iterdir()  # trained on the stream, cached
    assert json.loads((bpe / "tokenizer.json").read_text())["model"]["type"] == "BPE"


def test_streaming_is_refused_without_max_steps_and_by_the_no_trainer_loop(tmp_path):
    prefix = write_parallel(tmp_path / "data")
    with pytest.raises(ValueError, match="--streaming needs --max_steps"):
        train_cli(tmp_path / "out", tmp_path / "cache", "--train_file", prefix, "--streaming",
                  "--time_budget_minutes", "1")
    from vaswani_training.train_no_trainer import main as no_trainer

    with pytest.raises(ValueError, match="--streaming is a flag of vaswani-train"):
        no_trainer(["--preset", "tiny", "--train_file", prefix, "--streaming", "--max_steps", "2", "--output_dir",
                    str(tmp_path / "out2"), "--cache_dir", str(tmp_path / "cache")])


def test_drop_long_pairs_leaves_out_what_truncation_would_cut(tmp_path):
    """--drop_long_pairs: training pairs over the length limits are left out, not truncated; validation and test are
    truncated as always."""
    from vaswani_training.lib.arguments import DataArguments, ModelArguments
    from vaswani_training.lib.prepare import prepare_data

    german = ["ein Hund", "ein sehr sehr sehr sehr sehr sehr sehr sehr sehr sehr langer Satz", "eine Katze"]
    english = ["a dog", "a short one", "a cat"]
    prefixes = {split: write_parallel(tmp_path / split, german, english) for split in ("train", "val", "test")}
    data = {"train_file": prefixes["train"], "validation_file": prefixes["val"], "test_file": prefixes["test"],
            "max_source_length": 8, "max_target_length": 8}
    model_args = ModelArguments(cache_dir=str(tmp_path / "cache"), vocab_size=300)
    _, _, truncated = prepare_data(model_args, DataArguments(**data), {"vocab_size": 300})
    _, _, dropped = prepare_data(model_args, DataArguments(**data, drop_long_pairs=True), {"vocab_size": 300})
    assert [len(ids) for ids in truncated["train"]["input_ids"]][1] == 8  # cut to the limit
    assert dropped["train"]["input_ids"] == [truncated["train"]["input_ids"][0], truncated["train"]["input_ids"][2]]
    assert dropped["validation"]["input_ids"] == truncated["validation"]["input_ids"]  # still truncated, all kept
    with pytest.raises(ValueError, match="No training pair fits"):
        prepare_data(model_args, DataArguments(**{**data, "max_source_length": 1}, drop_long_pairs=True),
                     {"vocab_size": 300})
