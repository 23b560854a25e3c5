"""End to end: train a tiny model for a few steps on a slice of the shipped Multi30k, evaluate, translate, reload."""

import json
import subprocess
import sys
import warnings

import pytest
import torch
from helpers import ROOT


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from vaswani_training.train import main

    out = tmp_path_factory.mktemp("run")
    cache = tmp_path_factory.mktemp("cache")
    args = ["--preset", "tiny", "--output_dir", str(out), "--cache_dir", str(cache),
            "--max_train_samples", "400", "--max_eval_samples", "8", "--max_test_samples", "12",
            "--max_steps", "8", "--eval_steps", "4", "--save_steps", "4", "--logging_steps", "2",
            "--per_device_eval_batch_size", "8", "--num_samples", "2"]
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
    """Validation and test loaders too: torch warns that pinned memory is unused where there is no accelerator."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: pinning is wanted there")
    assert not [w for w in trained_warnings if "pin_memory" in w], trained_warnings


def test_output_folder_loads_with_auto_classes_and_pipeline(trained):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline

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
    from vaswani_training.arguments import ModelArguments
    from vaswani_training.presets import parse_overrides, resolve_preset

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
    # The model card template of vaswani-export: training/model_card.md links to the one at the repository root.
    assert archive.read("vaswani_training/model_card.md") == (ROOT / "model_card.md").read_bytes()
    entry_points = archive.read("vaswani_hf-0.1.0.dist-info/entry_points.txt").decode().split("[console_scripts]")[1]
    targets = [line.split(" = ")[1] for line in entry_points.split("\n") if " = " in line]
    assert len(targets) == 8 and all(target.startswith("vaswani_training.") for target in targets)


def test_training_smooths_labels_and_evaluation_does_not(tmp_path):
    """§5.4: the recipe trains on the label-smoothed loss (config.label_smoothing, 0.1); eval_loss is the model's
    plain cross-entropy, the number transformers users read as log-perplexity."""
    from helpers import padded_batch, tiny_model
    from transformers import Seq2SeqTrainingArguments

    from vaswani_training.train import PaperTrainer

    model = tiny_model(dropout=0.0)
    ids, mask = padded_batch(length=9)
    labels, _ = padded_batch(seed=2, length=7)
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels.masked_fill(labels.eq(0), -100))
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = PaperTrainer(model=model, args=args, max_tokens=64, d_model=32, warmup=10, lr_factor=1.0)
    with torch.no_grad():
        plain = model(**batch).loss
        smoothed = model(**batch, label_smoothing=0.1).loss
        model.train()
        training_loss = trainer.compute_loss(model, batch)
        model.eval()
        eval_loss = trainer.compute_loss(model, batch)
    assert abs(smoothed.item() - plain.item()) > 1e-3
    torch.testing.assert_close(training_loss, smoothed)
    torch.testing.assert_close(eval_loss, plain)


def test_paper_trainer_uses_the_papers_adam_fused_on_the_cpu(tmp_path):
    """§5.3's Adam(0.9, 0.98, 1e-9), as one fused kernel on the CPU; its updates equal the foreach Adam's."""
    from helpers import tiny_model
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
    from helpers import tiny_model
    from transformers import Seq2SeqTrainingArguments

    from vaswani_training.train import PaperTrainer

    # transformers' default where `use_cpu` is not given, as in vaswani-train on a machine without a GPU
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), report_to=[], dataloader_pin_memory=True)
    if args.device.type != "cpu":
        pytest.skip("this machine has an accelerator: pinning is wanted there")
    from datasets import Dataset

    rows = Dataset.from_list([{"input_ids": [5, 6, 2], "attention_mask": [1, 1, 1], "labels": [7, 2]}] * 4)
    trainer = PaperTrainer(model=tiny_model(), args=args, train_dataset=rows, max_tokens=64, d_model=32,
                           warmup=10, lr_factor=1.0)
    loader = trainer.get_train_dataloader()
    assert getattr(loader, "base_dataloader", loader).pin_memory is False
    next(iter(loader))
    assert not [w for w in recwarn if "pin_memory" in str(w.message)]
