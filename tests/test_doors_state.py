"""The files a command reads are the files it names, and what a user reads is what runs: averaging across tokenizers,
dataset folders whose splits would join several sets, `vaswani-ablate`'s row files and its child process,
`vaswani-plot`'s state file, the renamed commands, the model card's decoding and greedy search without the folder's
length penalty."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time

import pytest
from helpers import ENGLISH, GERMAN, padded_batch, save_model_folder, tiny_model

from vaswani_hf.checks import CheckError

# Averaging ------------------------------------------------------------------------------------------------------------


def test_averaging_refuses_checkpoints_of_different_tokenizers_of_one_size(tmp_path, tiny_tokenizer):
    from vaswani_hf.averaging import average_checkpoints
    from vaswani_hf.tokenization_vaswani import train_joint_bpe

    size = len(tiny_tokenizer)
    other = train_joint_bpe([list(reversed(GERMAN)), [s.upper() for s in ENGLISH]], vocab_size=size, min_frequency=1)
    assert len(other) == size and other.get_vocab() != tiny_tokenizer.get_vocab()
    a = save_model_folder(tmp_path / "checkpoint-1", tiny_tokenizer)
    b = save_model_folder(tmp_path / "checkpoint-2", other, seed=1)
    with pytest.raises(ValueError, match="tokenizer.json files hold different vocabularies") as error:
        average_checkpoints([a, b])
    assert str(a) in str(error.value) and str(b) in str(error.value)
    c = save_model_folder(tmp_path / "checkpoint-3", tiny_tokenizer, seed=2)  # control: one tokenizer averages
    averaged = average_checkpoints([a, c])
    assert "model.shared.weight" in averaged and len(averaged) > 20


# Dataset folders ------------------------------------------------------------------------------------------------------


def _jsonl(path, pairs=3):
    path.write_text("".join(json.dumps({"translation": {"de": f"Satz {i}.", "en": f"Sentence {i}."}}) + "\n"
                            for i in range(pairs)))


@pytest.mark.parametrize("extra", ["test2017.jsonl", "dev.jsonl", "validation_extra.jsonl"])
def test_a_dataset_folder_whose_split_would_join_two_sets_is_refused_naming_them(tmp_path, extra):
    from vaswani_hf.data import check_parallel_data

    for name in ("train.jsonl", "validation.jsonl", "test.jsonl", extra):
        _jsonl(tmp_path / name)
    with pytest.raises(CheckError, match=f"would join 2 files.*{extra.split('.')[0]}") as error:
        check_parallel_data(hub_dataset=str(tmp_path), source_lang="de", target_lang="en")
    assert str(tmp_path) in str(error.value)


def test_a_dataset_folder_of_one_file_or_shards_per_split_reads(tmp_path):
    from vaswani_hf.data import check_parallel_data

    for name in ("train-00000-of-00002.jsonl", "train-00001-of-00002.jsonl", "validation.jsonl", "test.jsonl"):
        _jsonl(tmp_path / name)
    assert check_parallel_data(hub_dataset=str(tmp_path), source_lang="de", target_lang="en") == \
        ["train", "validation", "test"]


# vaswani-ablate -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["", '{"row": "base", "group": "ba', "[1, 2]", '{"row": "base"}'])
def test_a_damaged_row_file_of_vaswani_ablate_is_run_again_not_a_traceback(tmp_path, content, monkeypatch, capsys):
    import vaswani_training.ablate as ablate

    (tmp_path / "base").mkdir()
    (tmp_path / "base" / ablate.ROW_FILE).write_text(content)
    ran = []
    row = {"row": "base", "group": "base", "change": "the cpu preset", "parameters": 10, "train_steps": 3,
           "validation_ppl": 9.0, "validation_bleu": 1.0, "validation_length_ratio": 1.0, "command": "vaswani-train"}
    monkeypatch.setattr(ablate, "run_row", lambda name, *args: ran.append(name) or row)
    monkeypatch.setattr(ablate, "plot_rows", lambda rows, path: path)
    assert ablate.main(["--output_dir", str(tmp_path), "--rows", "base"]) == 0
    assert ran == ["base"] and "is damaged" in capsys.readouterr().out
    (tmp_path / "base" / ablate.ROW_FILE).write_text(json.dumps(row))  # control: a whole row file is done
    assert ablate.main(["--output_dir", str(tmp_path), "--rows", "base"]) == 0 and ran == ["base"]


def test_sigterm_to_vaswani_ablate_stops_the_rows_training_too(tmp_path):
    from vaswani_training.ablate import _run_child

    marker = tmp_path / "child.pid"
    child = [sys.executable, "-c", "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
             "time.sleep(120)", str(marker)]

    before = signal.getsignal(signal.SIGTERM)

    def sigterm_when_started():  # once the child runs and _run_child's handler is in place (never the default's)
        for _ in range(400):
            if marker.is_file() and marker.read_text() and signal.getsignal(signal.SIGTERM) is not before:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    threading.Thread(target=sigterm_when_started, daemon=True).start()
    started = time.monotonic()
    with open(tmp_path / "log", "w") as log, pytest.raises(KeyboardInterrupt, match="signal 15"):
        _run_child(child, log)
    assert time.monotonic() - started < 60
    pid = int(marker.read_text())
    with pytest.raises(ProcessLookupError):  # the child is gone (waited for), not left running
        os.kill(pid, 0)
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the one it found


# vaswani-plot ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["[]", '{"log_history": {"step": 1}}', '"text"'])
def test_vaswani_plot_curve_on_a_state_file_of_another_shape_names_it(tmp_path, content):
    from vaswani_training.plot import main

    state = tmp_path / "trainer_state.json"
    state.write_text(content)
    with pytest.raises(SystemExit, match=f"error: {state}: expected the JSON object the Trainer writes"):
        main(["curve", "--trainer_state", str(state), "--output", str(tmp_path / "c.png")])
    assert not (tmp_path / "c.png").exists()


# Renamed commands -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("old, new, module", [("vaswani-export", "vaswani-publish", "publish"),
                                              ("vaswani-export-ct2", "vaswani-convert-ct2", "convert_ct2")])
def test_the_previous_releases_command_names_run_the_new_commands_and_say_so(old, new, module, monkeypatch, capsys):
    import importlib

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    from helpers import ROOT

    import vaswani_training.renamed as renamed

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    target = scripts[old]
    assert target.startswith("vaswani_training.renamed:")
    command = importlib.import_module(f"vaswani_training.{module}")
    calls = []
    monkeypatch.setattr(command, "main", lambda argv=None: calls.append(argv) or 0)
    assert getattr(renamed, target.split(":")[1])(["--help-me"]) == 0
    assert calls == [["--help-me"]] and f"{old} is now {new}" in capsys.readouterr().err


# What a user reads is what runs ---------------------------------------------------------------------------------------


def test_the_model_cards_usage_line_names_the_folders_decoding(tiny_tokenizer):
    from vaswani_training.lib.publishing import describe_decoding, render_model_card

    model = tiny_model(vocab_size=len(tiny_tokenizer))
    model.generation_config.length_penalty, model.generation_config.length_penalty_style = 1.8, "gnmt"
    card = render_model_card(model, {"source_lang": "de", "target_lang": "en"}, repo_id="you/model")
    usage = next(line for line in card.splitlines() if "model.generate(" in line)
    assert usage.endswith("# beam 4, length penalty 1.8 in the paper's GNMT form, ((5 + |Y|) / 6)^alpha")
    assert "0.6" not in usage
    model.generation_config.num_beams = 1
    assert describe_decoding(model.generation_config) == "greedy"


def test_greedy_search_of_a_folder_that_chose_a_length_penalty_warns_of_no_ignored_flag(caplog):
    """The README's streamer line: `generate(num_beams=1, streamer=...)` on a model whose generation config holds the
    alpha chosen for its beam search (transformers would warn that `length_penalty` is ignored)."""
    from transformers import TextStreamer
    from transformers.utils import logging as hf_logging

    model = tiny_model()
    model.generation_config.length_penalty = 1.6
    ids, mask = padded_batch(batch=1, length=9)

    class Tokens:  # what TextStreamer needs of a tokenizer
        def decode(self, ids, **kwargs):
            return " ".join(map(str, ids))

    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            greedy = model.generate(input_ids=ids, attention_mask=mask, num_beams=1, max_new_tokens=5,
                                    streamer=TextStreamer(Tokens()))
            beam = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5)
    finally:
        hf_logging.disable_propagation()
    assert not [r for r in caplog.records if "length_penalty" in r.getMessage()], [r.getMessage() for r in
                                                                                   caplog.records]
    plain = tiny_model()
    plain.generation_config.length_penalty = 1.6
    plain.use_cpu_packed_linears = False
    assert greedy.shape[1] == 6 and beam.shape[1] >= 2
    assert greedy.tolist() == plain.generate(
        input_ids=ids, attention_mask=mask, num_beams=1, max_new_tokens=5).tolist()


def test_vaswani_evaluate_refuses_references_bleu_cannot_score_before_translating(model_folder, tmp_path,
                                                                                  monkeypatch):
    import re

    from helpers import evaluate_cli, exits_with, write_parallel

    import vaswani_hf.decoding.translate

    def never(*args, **kwargs):
        raise AssertionError("translated before the references were checked")

    monkeypatch.setattr(vaswani_hf.decoding.translate, "translate_sentences", never)
    test = write_parallel(tmp_path / "short", german=GERMAN[:3], english=["A dog.", "Two cats.", "Snow."])
    exits_with(lambda: evaluate_cli("--model", model_folder, "--test_file", test),
               re.escape(f"{test}: the references cannot be scored"), "no reference has 4 tokens")
