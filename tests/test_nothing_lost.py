"""Nothing lost, nothing silent: what would destroy a run is refused, inputs and outputs are checked before long work,
flags mean what they say, no secret reaches a file, and every damaged file is named.

Each case here went wrong before (a run destroyed with exit 0, a silent wrong result, a token on disk, a late failure,
or a traceback naming no file). The hypothesis properties at the end check the same principles on arbitrary inputs.
"""

import json
import os
import re
import shutil
import signal
import stat
import struct
from pathlib import Path

import pytest
import torch
from helpers import PLANTED_TOKEN, copy_run, exits_with, listing, tiny_model, train_cli, translate_cli
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from vaswani_hf import VaswaniConfig, VaswaniForConditionalGeneration, VaswaniModel
from vaswani_hf.checks import CheckError, RunLock, check_model_folder, read_json, safetensors_problem

# Flags mean what they say ---------------------------------------------------------------------------------------------


def test_the_dashed_max_steps_overrides_the_preset(tiny_run):
    out, metrics = tiny_run
    assert metrics["train_steps"] == 3  # the tiny preset's max_steps is 20
    assert sorted(p.name for p in out.glob("checkpoint-*"))[-1] == "checkpoint-3"


def test_given_flags_counts_every_spelling():
    from vaswani_training.run import given_flags
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


def test_gnmt_decoding_honours_max_new_tokens(model_folder, tmp_path, tiny_tokenizer):
    source = tmp_path / "in.de"
    source.write_text("Ein Hund läuft über die Wiese.\nZwei Kinder spielen.\n", encoding="utf-8")
    out = tmp_path / "out.en"
    translate_cli("--model", model_folder, "--input", source, "--output", out, "--length_penalty_style", "gnmt",
                  "--max_new_tokens", "2", "--device", "cpu")
    for line in out.read_text(encoding="utf-8").splitlines():  # an untrained model would go on to input length + 50
        assert len(tiny_tokenizer(line, add_special_tokens=False)["input_ids"]) <= 2


def test_average_last_is_checked_before_training(tmp_path, train_cache):
    from vaswani_training.run_checks import check_average_last

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


# Never destroy ------------------------------------------------------------------------------------------------------


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


def test_a_second_run_into_a_folder_in_use_is_refused(tmp_path, train_cache):
    folder = tmp_path / "busy"
    with RunLock(folder):
        with pytest.raises(CheckError, match="another run is writing this folder"):
            train_cli(folder, train_cache, "--max_steps", "1")
    assert not list(folder.glob("checkpoint-*"))
    with RunLock(folder):  # released: the next run may take it
        pass


@pytest.mark.parametrize("where", ["same", "inside", "parent"])
def test_export_never_replaces_the_model_folder(tiny_run, tmp_path, where):
    from vaswani_training.export import main as export_main

    source = copy_run(tiny_run, tmp_path)
    before = listing(source)
    output = {"same": source, "inside": source / "export", "parent": tmp_path}[where]
    exits_with(lambda: export_main(["--model_dir", str(source), "--output_dir", str(output), "--force"]),
               r"--output_dir .* (is the same folder as|lies inside|contains) --model_dir")
    assert listing(source) == before


@pytest.mark.parametrize("where", ["same", "parent"])
def test_ct2_export_never_replaces_the_model_folder(tiny_run, tmp_path, where):
    from vaswani_training.export_ct2 import main as export_ct2_main

    source = copy_run(tiny_run, tmp_path)
    before = listing(source)
    output = source if where == "same" else tmp_path
    exits_with(lambda: export_ct2_main(["--model_dir", str(source), "--output_dir", str(output), "--force"]),
               r"(is the same folder as|contains) --model_dir")
    assert listing(source) == before


def test_averaging_never_replaces_the_runs_own_model(tiny_run, tmp_path):
    from vaswani_training.average_checkpoints import main as average_main

    source = copy_run(tiny_run, tmp_path)
    before = listing(source)
    for output in (source, tmp_path):
        exits_with(lambda: average_main(["--checkpoint_dir", str(source), "--last", "2", "--output_dir", str(output)]),
                   r"(is the same folder as|contains) --checkpoint_dir")
    assert listing(source) == before
    assert average_main(["--checkpoint_dir", str(source), "--last", "2", "--output_dir", str(source / "averaged")]) == 0


def plant_nan(checkpoint: Path) -> None:
    """One tensor of a checkpoint's weights set to NaN, as a run that diverged saves it."""
    from safetensors.torch import load_file, save_file

    weights = load_file(checkpoint / "model.safetensors")
    name = next(name for name in weights if name.endswith("fc2.bias"))
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, checkpoint / "model.safetensors", metadata={"format": "pt"})


def test_evaluate_never_replaces_the_runs_metrics(tiny_run, tmp_path):
    from vaswani_training.evaluate_bleu import main as evaluate_main

    source = copy_run(tiny_run, tmp_path)
    metrics = source / "metrics.json"
    before = metrics.read_bytes()
    exits_with(lambda: evaluate_main(["--model", str(source), "--output", str(metrics), "--max_test_samples", "2"]),
               re.escape(f"--output {metrics} is a file of the model folder"))
    kept = tmp_path / "kept.json"
    kept.write_bytes(before)
    exits_with(lambda: evaluate_main(["--model", str(source), "--output", str(kept), "--max_test_samples", "2"]),
               r"holds a training run's metrics \(\d+ fields, train_steps 3\)")
    assert metrics.read_bytes() == before == kept.read_bytes()
    assert evaluate_main(["--model", str(source), "--max_test_samples", "2"]) == 0
    scores = json.loads((source / "test_metrics.json").read_text())
    assert scores["weights_sha256"] == json.loads(before)["weights_sha256"], "the same weights, the same fingerprint"


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
    from vaswani_training.run_checks import RUN_SETTINGS

    source = copy_run(tiny_run, tmp_path)
    (source / "checkpoint-3" / RUN_SETTINGS).unlink()
    with pytest.raises(CheckError, match=r"config d_model: the run has 32, this command 256"):
        train_cli(source, train_cache, "--max_steps", "5", "--resume_from_checkpoint", "last", "--preset", "cpu")


def test_a_resumed_run_with_too_few_checkpoints_to_average_is_refused_before_training(tiny_run, tmp_path, train_cache):
    source = copy_run(tiny_run, tmp_path)
    before = listing(source)
    with pytest.raises(CheckError, match=r"--average_last 5: resuming checkpoint-3 to --max_steps 4 with "
                                         r"--save_steps 1 leaves 4 checkpoint\(s\)"):
        train_cli(source, train_cache, "--max_steps", "4", "--save_steps", "1", "--resume_from_checkpoint", "last",
                  "--average_last", "5")
    assert listing(source) == before


@pytest.mark.parametrize(("flags", "message"), [
    (["--lr_factor", "0"], "--lr_factor must be a positive number"),
    (["--lr_factor", "nan"], "--lr_factor must be a positive number"),
    (["--max_train_minutes", "0"], "--max_train_minutes must be a positive number"),
    (["--config_overrides", "pad_token_id=5"], "--config_overrides pad_token_id: set by the joint BPE"),
    (["--config_overrides", "d_model=64,vocab_size=300"], "--config_overrides vocab_size: set by the joint BPE"),
])
def test_flags_that_would_be_ignored_or_crash_are_refused(tmp_path, train_cache, flags, message):
    with pytest.raises(CheckError, match=re.escape(message)):
        train_cli(tmp_path / "out", train_cache, "--max_steps", "1", *flags)
    assert not list((tmp_path / "out").glob("checkpoint-*"))


def test_a_resumed_run_stopped_in_its_test_translation_leaves_no_old_metrics_beside_new_weights(
        tiny_run, tmp_path, train_cache, monkeypatch):
    """A resumed run writes its model, then is killed while it translates the test set: the earlier metrics and
    translations were moved aside first, so that the export publishes no BLEU for the new weights; put back, they are
    refused."""
    import vaswani_training.evaluate_bleu
    from vaswani_training.export import main as export_main

    source = copy_run(tiny_run, tmp_path)
    old_metrics = (source / "metrics.json").read_bytes()
    old_translations = (source / "test_translations.txt").read_bytes()

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed during the test translation")

    monkeypatch.setattr(vaswani_training.evaluate_bleu, "evaluate_test_set", killed)
    with pytest.raises(KeyboardInterrupt):
        train_cli(source, train_cache, "--max_steps", "4", "--save_steps", "1", "--resume_from_checkpoint", "last")
    assert (source / "checkpoint-4").is_dir()
    assert not (source / "metrics.json").exists() and not (source / "test_translations.txt").exists()
    assert (source / "metrics.step-3.json").read_bytes() == old_metrics, "kept, under another name"
    assert (source / "test_translations.step-3.txt").read_bytes() == old_translations
    exported = tmp_path / "export"
    assert export_main(["--model_dir", str(source), "--output_dir", str(exported)]) == 0
    readme = (exported / "README.md").read_text(encoding="utf-8")
    assert str(json.loads(old_metrics)["test_bleu_signature"]) not in readme and "model-index" not in readme
    assert "carries no record of how the model was trained" in readme
    (source / "metrics.json").write_bytes(old_metrics)  # a user puts the old file back
    exits_with(lambda: export_main(["--model_dir", str(source), "--output_dir", str(tmp_path / "again")]),
               re.escape(f"{source / 'metrics.json'} does not describe the weights in {source}"), "vaswani-evaluate")
    assert not (tmp_path / "again").exists()


def test_the_runs_outputs_follow_the_umask(tiny_run):
    from vaswani_hf.checks import current_umask

    out, _ = tiny_run
    mask = current_umask()
    for path in (out / "metrics.json", out / "test_translations.txt", out / "model.safetensors",
                 out / "averaged_from.json", out / "checkpoint-3" / "model.safetensors",
                 out / "checkpoint-3" / "vaswani_run.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask, path


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_atomic_writes_follow_the_umask(tmp_path, umask):
    from vaswani_training.atomic import write_json_atomic, write_lines_atomic

    previous = os.umask(umask)
    try:
        write_json_atomic(tmp_path / "metrics.json", {"bleu": 1.0})
        write_lines_atomic(tmp_path / "test_translations.txt", ["a"])
    finally:
        os.umask(previous)
    for name in ("metrics.json", "test_translations.txt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask


def test_sigterm_during_validation_stops_within_a_decoding_step(tmp_path, train_cache, monkeypatch):
    """SIGTERM while the validation set is being translated: the batch ends at its next token, the rest of the
    validation set is skipped, the step's checkpoint is saved and the run ends without the test translation (a
    scheduler's SIGKILL follows), with metrics.json saying so."""
    from transformers import Seq2SeqTrainer

    from vaswani_training.run_checks import checkpoint_problems

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


# No secrets in files --------------------------------------------------------------------------------------------------


def test_the_hub_token_is_in_no_file_of_a_run_or_an_export(tiny_run, tmp_path):
    from vaswani_training.export import main as export_main

    out, _ = tiny_run
    exported = tmp_path / "export"
    assert export_main(["--model_dir", str(out), "--output_dir", str(exported), "--hub_token", PLANTED_TOKEN]) == 0
    files = [p for folder in (out, exported) for p in folder.rglob("*") if p.is_file()]
    assert any(p.name == "training_args.bin" for p in files), "the search covers Trainer's pickled arguments"
    leaked = [str(p) for p in files if PLANTED_TOKEN.encode() in p.read_bytes()]
    assert not leaked, f"the token was written to {leaked}"


# Fail fast: outputs and devices checked before any work -------------------------------------------------------------


def test_translate_output_is_checked_before_translating(model_folder, tmp_path, monkeypatch):
    import vaswani_hf.inference

    def never(*args, **kwargs):
        raise AssertionError("translated before checking --output")

    monkeypatch.setattr(vaswani_hf.inference, "translate_sentences", never)
    source = tmp_path / "in.de"
    source.write_text("Ein Hund.\n", encoding="utf-8")
    (tmp_path / "adir").mkdir()
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source, "--output", tmp_path / "adir"),
               "is a folder")
    (tmp_path / "afile").write_text("x")
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source, "--output",
                                     tmp_path / "afile" / "out.en"), "is a file, not a folder")
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source, "--output", source),
               "is the --input file")
    assert source.read_text(encoding="utf-8") == "Ein Hund.\n"


def test_run_output_dir_that_is_a_file_is_refused_before_work(tmp_path, train_cache):
    (tmp_path / "out").write_text("not a folder")
    with pytest.raises(CheckError, match="is a file, not a folder"):
        train_cli(tmp_path / "out", train_cache, "--max_steps", "1")


def test_cuda_on_a_cpu_only_torch_is_refused(model_folder, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    source = tmp_path / "in.de"
    source.write_text("Ein Hund.\n", encoding="utf-8")
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source, "--device", "cuda"),
               "built without CUDA", "--device cpu")
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source, "--device", "gpu0"),
               "not a device name")


# Validation in one place ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value", "message"), [
    ("normalize_before", "false", "normalize_before must be true or false"),
    ("tie_word_embeddings", 1, "tie_word_embeddings must be true or false"),
    ("layer_norm_eps", -100, "layer_norm_eps must be a small positive number"),
    ("layer_norm_eps", 0, "layer_norm_eps must be a small positive number"),
    ("dropout", True, r"dropout must be in \[0, 1\)"),
    ("pad_token_id", 100000, r"pad_token_id must be a token id in \[0, "),
    ("eos_token_id", -1, r"eos_token_id must be a token id"),
    ("d_model", 32.0, "d_model must be a positive integer"),
])
def test_a_bad_field_in_config_json_is_refused_naming_the_file(model_folder, tmp_path, field, value, message):
    config = json.loads((model_folder / "config.json").read_text())
    config[field] = value
    (model_folder / "config.json").write_text(json.dumps(config))
    where = re.escape(str(model_folder / "config.json"))
    with pytest.raises(ValueError, match=f"{where}: {message}"):
        VaswaniForConditionalGeneration.from_pretrained(model_folder)
    with pytest.raises(ValueError, match=f"{where}: {message}"):
        VaswaniConfig.from_pretrained(model_folder)
    source = tmp_path / "in.de"
    source.write_text("Ein Hund.\n", encoding="utf-8")
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source), f"{where}: {message}")


def test_constructing_a_config_checks_types_and_ranges():
    with pytest.raises(ValueError, match="normalize_before must be true or false"):
        VaswaniConfig(normalize_before="yes")
    with pytest.raises(ValueError, match="layer_norm_eps"):
        VaswaniConfig(layer_norm_eps=float("nan"))
    assert VaswaniConfig(layer_norm_eps=1.0).layer_norm_eps == 1.0  # transformers' common tests use 1.0
    with pytest.raises(ValueError, match=r"bos_token_id must be a token id in \[0, 10\)"):
        VaswaniConfig(vocab_size=10, bos_token_id=10)


def test_a_tokenizer_of_another_size_is_refused(model_folder, tmp_path):
    from vaswani_hf import train_joint_bpe

    other = train_joint_bpe([["Ein Hund.", "Eine Katze."], ["A dog.", "A cat."]], vocab_size=300, min_frequency=1)
    other.save_pretrained(model_folder)
    source = tmp_path / "in.de"
    source.write_text("Ein Hund.\n", encoding="utf-8")
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source),
               re.escape(str(model_folder / "tokenizer.json")), "does not belong to this model")


def _save_without_shared_embedding(folder, cls):
    """A saved tiny `cls` whose model.safetensors lacks the shared embedding; returns (path, weights, shared name)."""
    from safetensors.torch import load_file, save_file

    config = VaswaniConfig(vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=1, num_heads=2, d_ff=32)
    cls(config).save_pretrained(folder)
    path = folder / "model.safetensors"
    weights = load_file(path)
    shared = next(name for name in weights if name.endswith("shared.weight"))
    save_file({k: v for k, v in weights.items() if k != shared}, path, metadata={"format": "pt"})
    return path, weights, shared


@pytest.mark.parametrize("cls", [VaswaniForConditionalGeneration, VaswaniModel])
def test_missing_or_unexpected_weights_are_refused_naming_the_file(tmp_path, cls):
    from safetensors.torch import save_file

    path, weights, shared = _save_without_shared_embedding(tmp_path, cls)
    with pytest.raises(ValueError, match=re.escape(f"{path}: missing") + f".*{re.escape(shared)}"):
        cls.from_pretrained(tmp_path)
    save_file({**weights, "extra.weight": torch.zeros(3)}, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": 1 unexpected weight\(s\) \(extra.weight\)"):
        cls.from_pretrained(tmp_path)
    save_file(weights, path, metadata={"format": "pt"})
    assert isinstance(cls.from_pretrained(tmp_path), cls)


@pytest.mark.parametrize("cls", [VaswaniForConditionalGeneration, VaswaniModel])
def test_output_loading_info_reports_a_missing_shared_embedding_and_initializes_it(tmp_path, cls):
    """With `output_loading_info=True` the caller checks the missing names: the shared embedding (tied by sharing
    one module) is among them, and initialized as a new model's, not left on the meta device."""
    _, _, shared = _save_without_shared_embedding(tmp_path, cls)
    model, info = cls.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] and shared in set(info["missing_keys"])
    embedding = model.get_input_embeddings().weight
    assert embedding.device.type == "cpu" and bool(torch.isfinite(embedding).all())
    assert 0.5 < float(embedding.std()) * model.config.d_model**0.5 < 2  # N(0, d_model^-1/2), §3.4's scale
    tied = {n for n in model.state_dict() if "embed_tokens" in n or "lm_head" in n}
    assert set(info["missing_keys"]) - {shared} <= tied


def test_an_unexpected_safetensors_header_is_reported_not_a_crash(tmp_path):
    for header in ({"w": {"dtype": "F32", "shape": [1]}}, {"w": "nonsense"}, {"w": {"data_offsets": [4, 0]}}, [1, 2]):
        data = json.dumps(header).encode()
        path = tmp_path / "model.safetensors"
        path.write_bytes(struct.pack("<Q", len(data)) + data)
        assert "unreadable header" in safetensors_problem(path)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_a_truncated_json_file_of_a_model_folder_is_named(model_folder, tmp_path, name):
    path = model_folder / name
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(CheckError, match=re.escape(f"{path}: not valid JSON")):
        check_model_folder(model_folder)
    source = tmp_path / "in.de"
    source.write_text("Ein Hund.\n", encoding="utf-8")
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source), re.escape(f"{path}: not valid JSON"))


def test_truncated_metrics_and_trainer_state_are_named(tiny_run, tmp_path):
    from vaswani_training.export import main as export_main
    from vaswani_training.plot import plot_learning_curve

    source = copy_run(tiny_run, tmp_path)
    metrics = source / "metrics.json"
    metrics.write_text(metrics.read_text()[:20])
    exits_with(lambda: export_main(["--model_dir", str(source), "--output_dir", str(tmp_path / "e")]),
               re.escape(f"{metrics}: not valid JSON"))
    state = source / "checkpoint-3" / "trainer_state.json"
    state.write_text(state.read_text()[:30])
    with pytest.raises(CheckError, match=re.escape(f"{state}: not valid JSON")):
        plot_learning_curve(state, tmp_path / "curve.png")


def test_a_damaged_cached_tokenizer_is_trained_again(tmp_path):
    from vaswani_training.arguments import DataArguments, ModelArguments
    from vaswani_training.prepare import get_tokenizer

    data = {"translation": [{"de": "Ein Hund läuft.", "en": "A dog runs."}, {"de": "Eine Katze.", "en": "A cat."}]}
    model_args = ModelArguments(cache_dir=str(tmp_path))
    first = get_tokenizer(model_args, data, DataArguments(), 300)
    (cached,) = (tmp_path / "tokenizers").iterdir()
    (cached / "tokenizer.json").write_text('{"version": ')
    again = get_tokenizer(model_args, data, DataArguments(), 300)
    assert again.get_vocab() == first.get_vocab()
    assert read_json(cached / "tokenizer.json")["model"]["type"] == "BPE", "the cache entry is rebuilt"


def test_read_json_names_the_file(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"a": ')
    with pytest.raises(CheckError, match=re.escape(f"{path}: not valid JSON")):
        read_json(path)


# Clear errors from the model itself --------------------------------------------------------------------------------


def test_generate_refuses_an_empty_batch():
    model = tiny_model()
    for shape in ((0, 5), (2, 0)):
        with pytest.raises(ValueError, match="at least one sentence of at least one token"):
            model.generate(torch.zeros(shape, dtype=torch.long), max_new_tokens=3)


def test_a_label_outside_the_vocabulary_is_named_even_in_the_last_position():
    model = tiny_model()
    labels = torch.tensor([[5, 6, 7, 99]])  # the last label never becomes a decoder input
    with pytest.raises(ValueError, match="labels hold token id 99, outside this model's target vocabulary of 99"):
        model(input_ids=torch.tensor([[5, 6, 2]]), labels=labels)
    labels[0, -1] = -100
    assert torch.isfinite(model(input_ids=torch.tensor([[5, 6, 2]]), labels=labels).loss)


# Properties ----------------------------------------------------------------------------------------------------------

FIELDS = ["vocab_size", "target_vocab_size", "d_model", "encoder_layers", "decoder_layers", "num_heads", "d_ff",
          "dropout", "attention_dropout", "activation_dropout", "activation_function", "normalize_before",
          "position_embedding_type", "max_position_embeddings", "share_encoder_decoder_embeddings",
          "tie_word_embeddings", "scale_embedding", "label_smoothing", "layer_norm_eps", "use_cache", "pad_token_id",
          "bos_token_id", "eos_token_id", "decoder_start_token_id"]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from(["relu", "gelu", "learned", "sinusoidal", "true", "false", "no", "", "8"]),
                   st.lists(st.integers(0, 5), max_size=2))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=4))
def test_any_config_json_builds_a_working_model_or_is_refused_naming_config_json(tmp_path, changes):
    base = dict(vocab_size=20, d_model=8, encoder_layers=1, decoder_layers=1, num_heads=2, d_ff=8)
    folder = tmp_path / "cfg"
    folder.mkdir(exist_ok=True)
    config = {**VaswaniConfig(**base).to_dict(), **changes}
    (folder / "config.json").write_text(json.dumps(config))
    try:
        loaded = VaswaniConfig.from_pretrained(folder)
    except ValueError as error:
        assert str(error).startswith(f"{folder / 'config.json'}: "), str(error)
        event("refused")
        return
    event("built")
    model = VaswaniForConditionalGeneration(loaded).eval()
    ids = torch.tensor([[min(3, loaded.vocab_size - 1), loaded.eos_token_id if isinstance(loaded.eos_token_id, int)
                         else 0]])
    decoder_ids = torch.tensor([[loaded.decoder_start_token_id]])
    logits = model(input_ids=ids, decoder_input_ids=decoder_ids).logits
    assert logits.shape == (1, 1, loaded.decoder_vocab_size) and bool(torch.isfinite(logits).all())


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tiny_tokenizer):
    """A saved model folder and its translations of two sentences."""
    from vaswani_hf.inference import translate_sentences

    folder = tmp_path_factory.mktemp("pristine") / "model"
    model = tiny_model(vocab_size=len(tiny_tokenizer))
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    sentences = ["Ein Hund läuft.", "Zwei Kinder spielen im Park."]
    return folder, sentences, translate_sentences(model, tiny_tokenizer, sentences, num_beams=2, max_new_tokens=6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_file_of_a_model_folder_is_named_or_changes_nothing(pristine, tmp_path, data):
    """Each file of a model folder truncated at any length or overwritten with arbitrary bytes: the command's check and
    load either refuse it with an error naming that file, or translate exactly as before."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from vaswani_hf.inference import translate_sentences

    source, sentences, expected = pristine
    folder = tmp_path / "damaged"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(source, folder)
    name = data.draw(st.sampled_from(sorted(p.name for p in folder.iterdir() if p.is_file())), label="file")
    path = folder / name
    original = path.read_bytes()
    if data.draw(st.booleans(), label="truncate"):
        damaged = original[: data.draw(st.integers(0, len(original) - 1), label="keep")]
    else:
        damaged = data.draw(st.binary(max_size=64), label="bytes")
    path.write_bytes(damaged)
    try:
        check_model_folder(folder)
        model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as error:  # noqa: BLE001 - the property: whatever the error, it names the file
        assert name in str(error), f"{type(error).__name__} does not name {name}: {error}"
        event("refused, naming the file")
        return
    event("loaded: identical translations required")
    assert translate_sentences(model, tokenizer, sentences, num_beams=2, max_new_tokens=6) == expected
