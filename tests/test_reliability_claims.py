"""The points of docs/reliability.md (and the refusals of the other docs pages) that no other test module holds.

- Weights holding infinity are refused as NaN is, naming the folder; offload still refuses a foreign tensor.
- `--resume_from_checkpoint` given the run folder picks its newest complete checkpoint, with a warning for the newer
  incomplete one; resuming from another starting model is refused before training.
- Every command that takes a model folder refuses one that is not a whole `vaswani` model (another model type,
  another tokenizer, weights of another model or holding infinity), naming the file, and writes nothing.
- Bad input is a `ValueError`; the commands end with its message in one line, without a traceback.
- The run lock is released by the kernel when its holder is killed.
- SIGINT during validation cuts the pass after a decoding step and the run ends as usual; SIGTERM skips averaging and
  the upload; the loop without Trainer installs no signal handler.
- `vaswani-publish --push_to_hub` offline is refused before anything is written; the loop without Trainer refuses an
  FSDP setup; `--empty_lines keep` keeps empty sentences; a resumed run's earlier `test_metrics.json` is moved aside.
"""

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from helpers import (
    ROOT,
    copy_run,
    evaluate_cli,
    listing,
    tiny_model,
    train_cli,
    translate_cli,
    write,
)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSeq2SeqLM, BartConfig, BartForConditionalGeneration

from vaswani_hf import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani_hf.checks import CheckError

# Loading: infinity, offload ------------------------------------------------------------------------------------------


def _change_weights(folder, change) -> None:
    weights = load_file(folder / "model.safetensors")
    change(weights)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def _plant(value):
    def change(weights):
        name = next(n for n in sorted(weights) if n.endswith("fc2.bias"))
        weights[name] = torch.full_like(weights[name], value)
    return change


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_weights_holding_infinity_are_refused_naming_the_folder(tmp_path, value):
    tiny_model().save_pretrained(tmp_path)
    _change_weights(tmp_path, _plant(value))
    for load in (VaswaniForConditionalGeneration.from_pretrained, AutoModelForSeq2SeqLM.from_pretrained):
        with pytest.raises(ValueError, match=re.escape(f"{tmp_path}: weight ") + r"\S+fc2\.bias holds NaN or infinite"):
            load(tmp_path)


def test_offloading_still_refuses_a_foreign_tensor(tmp_path):
    tiny_model().save_pretrained(tmp_path / "model")
    _change_weights(tmp_path / "model", lambda w: w.update({"model.encoder.layers.7.fc1.weight": torch.zeros(2, 2)}))
    with pytest.raises(ValueError, match=r"1 unexpected weight\(s\) \(model\.encoder\.layers\.7\.fc1\.weight\)"):
        VaswaniForConditionalGeneration.from_pretrained(tmp_path / "model", device_map={"": "disk"},
                                                        offload_folder=tmp_path / "offload")



def test_layer_norm_eps_above_1_is_refused_naming_config_json(model_folder):
    with pytest.raises(ValueError, match=r"layer_norm_eps must be a small positive number \(0 < eps <= 1"):
        VaswaniConfig(layer_norm_eps=1.5)
    config = json.loads((model_folder / "config.json").read_text())
    config["layer_norm_eps"] = 1.5
    (model_folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(f"{model_folder / 'config.json'}: layer_norm_eps must be")):
        VaswaniForConditionalGeneration.from_pretrained(model_folder)


def test_a_damaged_cached_tokenizer_is_trained_again_with_a_warning(tmp_path, caplog):
    import datasets

    from vaswani_training.lib.arguments import DataArguments, ModelArguments
    from vaswani_training.lib.prepare import get_tokenizer

    data = datasets.Dataset.from_dict({"translation": [{"de": "Ein Hund läuft.", "en": "A dog runs."}]})
    model_args = ModelArguments(cache_dir=str(tmp_path))
    first = get_tokenizer(model_args, data, DataArguments(), 300)
    (cached,) = (tmp_path / "tokenizers").iterdir()
    (cached / "tokenizer.json").write_text('{"version": ')
    with caplog.at_level(logging.WARNING):
        again = get_tokenizer(model_args, data, DataArguments(), 300)
    assert again.get_vocab() == first.get_vocab()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(cached) in message and "again" in message for message in warned), warned

# Resuming -------------------------------------------------------------------------------------------------------------


def test_resuming_the_run_folder_picks_its_newest_complete_checkpoint(tiny_run, tmp_path, caplog):
    from vaswani_training.lib.checkpoints import resolve_resume_checkpoint

    source = copy_run(tiny_run, tmp_path)
    killed = source / "checkpoint-4"  # a kill while Trainer saved it: its optimizer state cut short
    shutil.copytree(source / "checkpoint-3", killed)
    with open(killed / "optimizer.pt", "r+b") as handle:
        handle.truncate(handle.seek(0, os.SEEK_END) // 2)
    for value in (str(source), "last", True, "true"):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert resolve_resume_checkpoint(value, source) == str(source / "checkpoint-3"), value
        assert "Not resuming from checkpoint-4, which is incomplete" in caplog.text, value


def test_resuming_from_another_starting_model_is_refused_before_training(tiny_run, tmp_path, model_folder,
                                                                          train_cache):
    source = copy_run(tiny_run, tmp_path)
    before = listing(source)
    with pytest.raises(CheckError, match=re.escape("--model_name_or_path: the run has None, this command ")
                       + ".*pass the run's values"):
        train_cli(source, train_cache, "--max_steps", "5", "--resume_from_checkpoint", "last",
                  "--model_name_or_path", model_folder)
    assert listing(source) == before


def test_a_resumed_runs_earlier_test_metrics_are_moved_aside(tmp_path):
    from vaswani_training.lib.output_dir import retire_previous_results

    files = {"metrics.json": '{"train_steps": 3}', "test_translations.txt": "A dog.\n",
             "test_metrics.json": '{"test_bleu": 1.0}'}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    moved = retire_previous_results(types.SimpleNamespace(output_dir=tmp_path))
    assert sorted(p.name for p in moved) == ["metrics.step-3.json", "test_metrics.step-3.json",
                                             "test_translations.step-3.txt"]
    assert (tmp_path / "test_metrics.step-3.json").read_text() == files["test_metrics.json"]
    assert not any((tmp_path / name).exists() for name in files)


# The commands check the model folder --------------------------------------------------------------------------------


def _foreign(folder):
    """The folder's model replaced by a BART of the same vocabulary (its tokenizer kept): transformers would load it."""
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    for path in folder.glob("*.json"):
        if not path.name.startswith("tokenizer") and path.name != "special_tokens_map.json":
            path.unlink()
    BartForConditionalGeneration(BartConfig(
        vocab_size=vocab, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)).save_pretrained(folder)
    return r"config\.json"


def _other_special_ids(folder):
    for name in ("config.json", "generation_config.json"):  # the model's pad id 3; the tokenizer's is 0
        settings = json.loads((folder / name).read_text())
        settings["pad_token_id"] = 3
        (folder / name).write_text(json.dumps(settings))
    return r"tokenizer(_config)?\.json"


def _foreign_tensor(folder):
    _change_weights(folder, lambda w: w.update({"model.decoder.layers.5.fc1.weight": torch.zeros(2, 2)}))
    return r"model\.safetensors"


def _missing_tensor(folder):
    _change_weights(folder, lambda w: w.pop(next(n for n in sorted(w) if n.endswith("k_proj.bias"))))
    return r"model\.safetensors"


def _infinite(folder):
    _change_weights(folder, _plant(float("inf")))
    return r"NaN or infinite"


FAULTS = {"another model type": _foreign, "other special ids": _other_special_ids,
          "a foreign tensor": _foreign_tensor, "a missing tensor": _missing_tensor, "infinite weights": _infinite}


def _command(name, folder, output, tmp_path):
    from vaswani_training.convert_ct2 import main as convert_ct2
    from vaswani_training.publish import main as publish

    source = write(tmp_path / "in.de", "Ein Hund.\n")
    return {
        "vaswani-translate": lambda: translate_cli("--model", folder, "--input", source, "--output", output),
        "vaswani-evaluate": lambda: evaluate_cli("--model", folder, "--max_test_samples", "1", "--output", output),
        "vaswani-publish": lambda: publish(["--model_dir", str(folder), "--output_dir", str(output)]),
        "vaswani-convert-ct2": lambda: convert_ct2(["--model_dir", str(folder), "--output_dir", str(output)]),
        "vaswani-train --model_name_or_path": lambda: train_cli(output, tmp_path / "cache", "--max_steps", "1",
                                                               "--model_name_or_path", folder),
    }[name]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("command", ["vaswani-translate", "vaswani-evaluate", "vaswani-publish",
                                     "vaswani-convert-ct2", "vaswani-train --model_name_or_path"])
def test_the_commands_refuse_a_folder_that_is_not_a_whole_vaswani_model(model_folder, tmp_path, fault, command):
    if command == "vaswani-convert-ct2":
        pytest.importorskip("ctranslate2")
    named = FAULTS[fault](model_folder)  # a pattern of the file (or the fault) the message names
    before = listing(model_folder)
    output = tmp_path / "out"
    # the commands exit with one line; vaswani-train's main raises the CheckError that its console entry prints so
    with pytest.raises(CheckError if command.startswith("vaswani-train") else SystemExit) as refused:
        _command(command, model_folder, output, tmp_path)()
    message = str(refused.value.code if isinstance(refused.value, SystemExit) else refused.value)
    assert re.search(named, message) and str(model_folder) in message, message
    assert listing(model_folder) == before
    written = [p.name for p in output.rglob("*") if p.name != ".vaswani.lock"] if output.is_dir() else []
    assert not output.is_file() and written == [], written


# One error type; the commands print one line -------------------------------------------------------------------------


def test_bad_input_is_a_value_error_naming_what_is_wrong():
    assert issubclass(CheckError, ValueError)
    with pytest.raises(ValueError, match=r"d_model must be a positive integer"):
        VaswaniConfig(d_model=0)
    with pytest.raises(ValueError, match="outside this model's vocabulary of 99"):
        tiny_model()(input_ids=torch.tensor([[5, 120]]), decoder_input_ids=torch.tensor([[1]]))


def _console_entry(name: str):
    import importlib

    import tomllib

    module, function = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"][name].split(":")
    return getattr(importlib.import_module(module), function)


@pytest.mark.parametrize(("command", "argv", "named"), [
    ("vaswani-train", ["--preset", "tiny", "--lr_factor", "0", "--max_steps", "1"], "--lr_factor"),
    ("vaswani-train-no-trainer", ["--preset", "tiny", "--gradient_accumulation_steps", "0"],
     "--gradient_accumulation_steps"),
    ("vaswani-translate", ["--model", "{missing}"], "{missing}"),
    ("vaswani-evaluate", ["--model", "{missing}"], "{missing}"),
    ("vaswani-average", ["--checkpoint_dir", "{missing}", "--last", "2"], "{missing}"),
    ("vaswani-publish", ["--model_dir", "{missing}"], "{missing}"),
    ("vaswani-plot", ["positions", "--model_dir", "{missing}", "--positions", "8"], "{missing}"),
    ("vaswani-convert-ct2", ["--model_dir", "{missing}"], "{missing}"),
    ("vaswani-demo", ["--model", "{missing}"], "{missing}"),
    ("vaswani-ablate", ["--rows", "Z"], "Z"),
])
def test_each_command_ends_a_refusal_with_its_message_in_one_line(tmp_path, monkeypatch, command, argv, named):
    missing = str(tmp_path / "missing")
    argv = [a.replace("{missing}", missing) for a in argv]
    if command.startswith("vaswani-train"):
        argv += ["--output_dir", str(tmp_path / "out"), "--cache_dir", str(tmp_path / "cache")]
    elif command in ("vaswani-average", "vaswani-publish", "vaswani-convert-ct2", "vaswani-ablate"):
        argv += ["--output_dir", str(tmp_path / "out")]
    elif command == "vaswani-plot":
        argv += ["--output", str(tmp_path / "out.png")]
    monkeypatch.setattr(sys, "argv", [command, *argv])
    entry = _console_entry(command)
    with pytest.raises(SystemExit) as ended:
        entry() if command.startswith("vaswani-train") else entry(argv)
    message = ended.value.code
    assert isinstance(message, str) and "\n" not in message.strip(), repr(message)  # printed to stderr, status 1
    assert named.replace("{missing}", missing) in message, message
    assert ended.value.__cause__ is None
    assert not (tmp_path / "out").exists() or [p.name for p in (tmp_path / "out").iterdir()] == []


def test_a_refused_command_prints_one_line_and_no_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-m", "vaswani_training.translate", "--model", str(tmp_path / "missing"),
                           "--input", str(tmp_path / "in.de")], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "Traceback" not in done.stderr and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{tmp_path / 'missing'} is not a saved model folder"), lines


# The run lock ---------------------------------------------------------------------------------------------------------

HOLD_LOCK = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from vaswani_training.lib.output_dir import RunLock

    lock = RunLock(sys.argv[1]).acquire()  # held while the process lives
    print("held", flush=True)
    time.sleep(600)
    """
)


def test_the_run_lock_is_released_by_the_kernel_when_its_holder_is_killed(tmp_path):
    from vaswani_training.lib.output_dir import RunLock

    folder = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder), str(ROOT)], stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckError, match=rf"another run is writing this folder \(pid {holder.pid}"):
            RunLock(folder).acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    finally:
        if holder.poll() is None:
            holder.kill()
    assert (folder / ".vaswani.lock").is_file(), "the lock file stays behind"
    lock = RunLock(folder).acquire()  # and does not block the next run
    lock.release()


# Signals --------------------------------------------------------------------------------------------------------------


def test_sigint_during_validation_cuts_the_pass_and_the_run_ends_as_usual(tmp_path, train_cache, monkeypatch):
    """SIGINT while the validation set is translated: the batch ends at its next token, the step's checkpoint is
    saved, and the run ends as usual: model, test translations and metrics.json, no `stopped_by`."""
    from transformers import Seq2SeqTrainer

    from vaswani_training.lib.checkpoints import checkpoint_problems

    original = Seq2SeqTrainer.prediction_step
    lengths = []

    def first_batch_then_sigint(self, *args, **kwargs):
        if not lengths:
            os.kill(os.getpid(), signal.SIGINT)
        output = original(self, *args, **kwargs)
        lengths.append(int(output[1].ne(self.model.config.pad_token_id).sum(-1).max()))
        return output

    monkeypatch.setattr(Seq2SeqTrainer, "prediction_step", first_batch_then_sigint)
    out = tmp_path / "out"
    metrics = train_cli(out, train_cache, "--max_steps", "6", "--save_steps", "100", "--eval_strategy", "steps",
                        "--eval_steps", "2", "--max_eval_samples", "40", "--per_device_eval_batch_size", "4",
                        "--generation_max_length", "128", "--skip_test", "false")
    assert len(lengths) == 1 and lengths[0] <= 3, lengths  # 1 of 10 batches, cut after its first token
    assert metrics["train_steps"] == 2 and "stopped_by" not in metrics and "test_bleu" in metrics
    assert json.loads((out / "metrics.json").read_text())["train_steps"] == 2
    assert len((out / "test_translations.txt").read_text(encoding="utf-8").splitlines()) == 2
    assert (out / "model.safetensors").is_file() and checkpoint_problems(out / "checkpoint-2") == []


def test_sigterm_skips_averaging_and_the_upload(tmp_path, train_cache, monkeypatch):
    import huggingface_hub.constants
    from hub_standin import StandInHub

    from vaswani_training.lib.checkpoints import checkpoint_problems
    from vaswani_training.train import PaperTrainer

    original = PaperTrainer.training_step
    steps = []

    def sigterm_in_step_2(self, *args, **kwargs):
        steps.append(1)
        if len(steps) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, *args, **kwargs)

    hub = StandInHub()
    try:
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        monkeypatch.setattr(PaperTrainer, "training_step", sigterm_in_step_2)
        out = tmp_path / "out"
        metrics = train_cli(out, train_cache, "--max_steps", "6", "--save_steps", "1", "--average_last", "2",
                            "--push_to_hub", "--hub_model_id", "someone/stopped", "--hub_token", "hf_x",
                            "--hub_endpoint", hub.url)
    finally:
        hub.close()
    assert metrics["train_steps"] == 2 and metrics["stopped_by"] == "SIGTERM"
    assert json.loads((out / "metrics.json").read_text())["stopped_by"] == "SIGTERM"
    assert not (out / "averaged_from.json").exists(), "no averaging after SIGTERM"
    assert not (out / "test_translations.txt").exists() and "test_bleu" not in metrics
    assert not (out / "hub").exists() and not [c for c in hub.commits if c["repo_id"] == "someone/stopped"]
    assert checkpoint_problems(out / "checkpoint-2") == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_the_loop_without_trainer_installs_no_signal_handler(tmp_path, monkeypatch):
    """SIGTERM ends the loop without Trainer at once (its checkpoints are written under a temporary name and renamed
    when complete: tests/test_distributed.py)."""
    import vaswani_training.train_no_trainer as no_trainer

    seen = []
    original = no_trainer.save_checkpoint
    # the handlers the process started with (a job started in the background has SIGINT ignored, not Python's default)
    before = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT))

    def record(*args, **kwargs):
        seen.append((signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)))
        return original(*args, **kwargs)

    monkeypatch.setattr(no_trainer, "save_checkpoint", record)
    no_trainer.main(["--preset", "tiny", "--output_dir", str(tmp_path / "out"), "--cache_dir", str(tmp_path / "cache"),
                     "--max_steps", "1", "--max_train_samples", "40", "--max_test_samples", "1", "--num_samples", "0",
                     "--cpu_bf16", "no", "--checkpointing_steps", "1"])
    assert seen and all(handlers == before for handlers in seen), (before, seen)


# Refusals of usage.md, gpu.md and data.md ----------------------------------------------------------------------------


def test_publishing_offline_is_refused_before_anything_is_written(model_folder, tmp_path, monkeypatch):
    import huggingface_hub.constants

    from vaswani_training.publish import main as publish

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    before = listing(model_folder)
    with pytest.raises(SystemExit, match="--push_to_hub: HF_HUB_OFFLINE is set, so nothing could be uploaded"):
        publish(["--model_dir", str(model_folder), "--output_dir", str(tmp_path / "hub"), "--push_to_hub",
                 "--hub_model_id", "someone/offline"])
    assert not (tmp_path / "hub").exists() and listing(model_folder) == before


def test_the_loop_without_trainer_refuses_fsdp_and_deepspeed(tmp_path, monkeypatch):
    from accelerate import DistributedType

    import vaswani_training.train_no_trainer as no_trainer

    for kind in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        monkeypatch.setattr(no_trainer, "_accelerator", lambda job, loop, kind=kind: types.SimpleNamespace(
            num_processes=1, distributed_type=kind))
        out = tmp_path / kind.value
        with pytest.raises(CheckError, match=rf"runs data parallel only, not {kind}.*use train.py"):
            no_trainer.main(["--preset", "tiny", "--output_dir", str(out), "--cache_dir", str(tmp_path / "cache"),
                             "--max_steps", "1"])
        assert not list(out.glob("*checkpoint-*"))


def test_empty_lines_keep_keeps_the_pairs(tmp_path):
    from vaswani_hf.data import read_parallel_text

    write(tmp_path / "p.de", "a\n\nc\n")
    write(tmp_path / "p.en", "A\nB\n\n")
    kept = read_parallel_text(tmp_path / "p", "de", "en", empty_lines="keep")
    assert kept.source == ["a", "", "c"] and kept.target == ["A", "B", ""] and kept.skipped == 0
