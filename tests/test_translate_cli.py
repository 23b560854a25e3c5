"""`vaswani-translate` and `vaswani-evaluate` (training/translate.py, training/evaluate_bleu.py), called in-process:
they check the model folder, every input line and their outputs before translating anything, refuse bad arguments
naming the flag, keep output lines aligned with input lines, and never overwrite a run's own files.
"""

import json
import os
import re
from pathlib import Path

import pytest
import torch
from helpers import (
    ENGLISH,
    GERMAN,
    copy_run,
    evaluate_cli,
    exits_with,
    save_model_folder,
    tiny_model,
    translate_cli,
    write,
    write_parallel,
)
from transformers import AutoModelForSeq2SeqLM

from vaswani_hf import VaswaniForConditionalGeneration
from vaswani_hf.decoding.translate import translate_sentences

# Outputs, devices and the model folder, checked before anything is translated -----------------------------------------


def test_translate_output_is_checked_before_translating(model_folder, tmp_path, monkeypatch):
    import vaswani_hf.decoding.translate

    def never(*args, **kwargs):
        raise AssertionError("translated before checking --output")

    monkeypatch.setattr(vaswani_hf.decoding.translate, "translate_sentences", never)
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
    if Path("/proc/self").is_dir():  # Linux: /proc takes no new folder, whatever os.access says of it
        words = "no folder can be created in /proc" if os.access("/proc", os.W_OK | os.X_OK) else "is not writable"
        exits_with(lambda: translate_cli("--model", model_folder, "--input", source, "--output",
                                         "/proc/vaswani-no-such-folder/out.en"), words)
    assert source.read_text(encoding="utf-8") == "Ein Hund.\n"


def test_cuda_on_a_cpu_only_torch_is_refused(model_folder, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    source = tmp_path / "in.de"
    source.write_text("Ein Hund.\n", encoding="utf-8")
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source, "--device", "cuda"),
               "built without CUDA", "--device cpu")
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source, "--device", "gpu0"),
               "not a device name")
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source, "--device", "meta"),
               "--device meta: a meta device cannot translate here", "use cpu")
    exits_with(lambda: evaluate_cli("--model", model_folder, "--device", "meta", "--max_test_samples", "1"),
               "--device meta: a meta device cannot translate here")


def test_a_tokenizer_of_another_size_is_refused(model_folder, tmp_path):
    from vaswani_hf import train_joint_bpe

    other = train_joint_bpe([["Ein Hund.", "Eine Katze."], ["A dog.", "A cat."]], vocab_size=300, min_frequency=1)
    other.save_pretrained(model_folder)
    source = tmp_path / "in.de"
    source.write_text("Ein Hund.\n", encoding="utf-8")
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source),
               re.escape(str(model_folder / "tokenizer.json")), "does not belong to this model")


def test_pickled_weights_and_missing_tokenizer_are_refused_by_the_commands(model_folder, tmp_path):
    source = write(tmp_path / "in.de", "Ein Hund.\n")
    (model_folder / "tokenizer.json").unlink()
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source), "no tokenizer.json beside the model")
    weights = model_folder / "model.safetensors"
    from safetensors.torch import load_file

    torch.save(load_file(weights), model_folder / "pytorch_model.bin")
    weights.unlink()
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source),
               "weights are only in pytorch_model.bin, a pickle", "reads weights from model.safetensors only")
    # The library refuses it too (use_safetensors defaults to True for this model), through either class.
    for load in (VaswaniForConditionalGeneration.from_pretrained, AutoModelForSeq2SeqLM.from_pretrained):
        with pytest.raises(OSError, match="no file named model.safetensors"):
            load(model_folder)


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
    files = sorted(path.name for path in source.iterdir())
    assert evaluate_main(["--model", str(source), "--max_test_samples", "2"]) == 0
    assert sorted(path.name for path in source.iterdir()) == files, "without --output nothing is written"
    assert evaluate_main(["--model", str(source), "--max_test_samples", "2", "--output",
                          str(source / "test_metrics.json")]) == 0
    scores = json.loads((source / "test_metrics.json").read_text())
    assert scores["weights_sha256"] == json.loads(before)["weights_sha256"], "the same weights, the same fingerprint"


# Input lines: every length checked first, output lines aligned with input lines ---------------------------------------


@pytest.fixture
def learned_folder(tmp_path, tiny_tokenizer):
    """A saved tiny model with learned positions for 32 tokens (each of GERMAN is at most 29), and its tokenizer."""
    return save_model_folder(tmp_path / "learned", tiny_tokenizer, position_embedding_type="learned",
                             max_position_embeddings=32)


def test_the_commands_check_every_length_before_translating(learned_folder, tmp_path, tiny_tokenizer, monkeypatch):
    """A line too long for the learned positions near the end of the input is refused, naming its line, before the
    first batch is translated (nothing translated and thrown away)."""
    import vaswani_hf.decoding.translate

    long_line = " ".join(GERMAN[:3])
    assert len(tiny_tokenizer(long_line)["input_ids"]) > 32
    source = write(tmp_path / "in.de", f"{GERMAN[0]}\n\n{GERMAN[1]}\n{long_line}\n")

    def never(*args, **kwargs):
        raise AssertionError("translated before every length was checked")

    monkeypatch.setattr(vaswani_hf.decoding.translate, "translate_sentences", never)
    for style in ("hf", "gnmt"):
        exits_with(lambda: translate_cli("--model", learned_folder, "--input", source, "--output", tmp_path / "out",
                                         "--length_penalty_style", style),
                   re.escape(f"{source}:4: the sentence is"), "more than the 32 positions this model takes")
    assert not (tmp_path / "out").exists()
    test = write_parallel(tmp_path / "test", german=[GERMAN[0], long_line], english=ENGLISH[:2])
    exits_with(lambda: evaluate_cli("--model", learned_folder, "--test_file", test),
               re.escape(f"{test}, pair 2: the sentence is"))


def test_paper_decoding_stops_where_learned_positions_end(learned_folder, tmp_path, tiny_tokenizer):
    """§6.1's input length + 50 would run past a 32-position table: the output stops at its end instead."""
    from vaswani_hf.decoding.paper import paper_generate

    model = VaswaniForConditionalGeneration.from_pretrained(learned_folder).eval()
    batch = tiny_tokenizer(GERMAN[:2], return_tensors="pt", padding=True)
    for beams in (1, 2):
        ids = paper_generate(model, batch["input_ids"], batch["attention_mask"], num_beams=beams)
        assert ids.shape[1] <= 32  # the start token and at most 31 generated
    source = write(tmp_path / "in.de", "\n".join(GERMAN[:4]) + "\n")
    out = tmp_path / "out.en"
    assert translate_cli("--model", learned_folder, "--input", source, "--output", out, "--length_penalty_style",
                         "gnmt", "--num_beams", "2", "--device", "cpu") == 0
    assert len(out.read_text(encoding="utf-8").splitlines()) == 4


def test_cr_only_input_is_translated_line_by_line(model_folder, tmp_path):
    source = write(tmp_path / "in.de", f"{GERMAN[0]}\r{GERMAN[1]}\r\r{GERMAN[2]}\r".encode())
    out = tmp_path / "out.en"
    assert translate_cli("--model", model_folder, "--input", source, "--output", out, "--num_beams", "1",
                         "--max_new_tokens", "3") == 0
    lines = out.read_text(encoding="utf-8").split("\n")
    assert len(lines) == 5 and lines[2] == "" and lines[4] == "", lines  # 4 lines, the empty one kept


def test_empty_input_for_translation(model_folder, tmp_path, tiny_tokenizer, monkeypatch):
    model = tiny_model(vocab_size=len(tiny_tokenizer))
    with pytest.raises(ValueError, match="the input list is empty; there is nothing to translate"):
        translate_sentences(model, tiny_tokenizer, [])
    with pytest.raises(ValueError, match="pass a list of sentences, not a single string"):
        translate_sentences(model, tiny_tokenizer, "Ein Hund.")
    with pytest.raises(ValueError, match="item 1 is NoneType, not str"):
        translate_sentences(model, tiny_tokenizer, ["Ein Hund.", None])
    for content in ("", "\n\n  \n"):
        source = write(tmp_path / "in.de", content)
        exits_with(lambda: translate_cli("--model", model_folder, "--input", source),
                   re.escape(f"No input sentences: {source} is empty"))
    import io

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"")))
    exits_with(lambda: translate_cli("--model", model_folder), "No input sentences: stdin is empty")
    exits_with(lambda: translate_cli("--model", model_folder, "--input", tmp_path / "missing.de"),
               "--input .*missing.de: no such file")


def test_translate_command_names_the_non_utf8_line_and_keeps_lines_aligned(model_folder, tmp_path, monkeypatch):
    source = write(tmp_path / "in.de", b"Ein Hund.\n" + "Zwei Bäume.\n".encode("latin-1"))
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source),
               re.escape(f"{source}:2: not valid UTF-8 (byte b'\\xe4' at byte offset 6 of the line)"), "iconv")
    import io

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"ok\n\xff\n")))
    exits_with(lambda: translate_cli("--model", model_folder), re.escape("stdin:2: not valid UTF-8"))
    # A line separator inside a sentence is not a line end: three input lines, three output lines.
    source = write(tmp_path / "in2.de", "Ein Hund\u2028läuft.\r\n\nZwei Männer.\n")
    output = tmp_path / "out.en"
    assert translate_cli("--model", model_folder, "--input", source, "--output", output, "--num_beams", 1,
                         "--max_new_tokens", 3) == 0
    lines = output.read_text(encoding="utf-8").split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == ""


# Decoding flags -------------------------------------------------------------------------------------------------------


def test_gnmt_decoding_honours_max_new_tokens(model_folder, tmp_path):
    source = tmp_path / "in.de"
    source.write_text("Ein Hund läuft über die Wiese.\nZwei Kinder spielen.\n", encoding="utf-8")
    out = tmp_path / "out.en"
    translate_cli("--model", model_folder, "--input", source, "--output", out, "--length_penalty_style", "gnmt",
                  "--max_new_tokens", "2", "--device", "cpu")
    lines = out.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2
    for line in lines:  # two tokens are at most two words; an untrained model would go on to input length + 50
        assert len(line.split()) <= 2, line


@pytest.mark.parametrize("command", ["translate", "evaluate"])
def test_a_non_integer_batch_size_names_the_flag(model_folder, tmp_path, capsys, command):
    run = translate_cli if command == "translate" else evaluate_cli
    with pytest.raises(SystemExit) as error:
        run("--model", model_folder, "--batch_size", "2.5")
    assert error.value.code == 2 and "argument --batch_size: invalid int value: '2.5'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--num_beams", 0, "--num_beams must be >= 1, got 0"),
        ("--max_new_tokens", -1, "--max_new_tokens must be >= 1, got -1"),
        ("--batch_size", 0, "--batch_size must be >= 1, got 0"),
        ("--length_penalty", "nan", "--length_penalty must be a finite number, got nan"),
    ],
)
def test_translate_and_evaluate_commands_reject_out_of_range_arguments(model_folder, tmp_path, flag, value, message):
    source = write(tmp_path / "in.de", "Ein Hund.\n")
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source, flag, value), re.escape(message))
    if flag != "--max_new_tokens":  # evaluate has no --max_new_tokens
        exits_with(lambda: evaluate_cli("--model", model_folder, flag, value), re.escape(message))
