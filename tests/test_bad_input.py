"""Bad input gets a clear error, naming the file, line or field and saying what to do, through every door: the library,
the train command (`training/train.py`, called in-process; each case fails before training starts) and the
translate/evaluate commands.

Covered elsewhere, and not repeated here: the data readers themselves (tests/test_data.py: different line counts,
missing and empty files, non-UTF-8 bytes with the line number, empty-line policies skip/error/keep, unknown language
codes, bad gzip, JSON-lines errors), config validation (tests/test_configuration.py), out-of-vocabulary ids and
learned positions in `forward` (tests/test_modeling.py), tokenizer training input (tests/test_tokenization.py).
"""

import json
import math
import re

import pytest
import torch
from helpers import (
    ENGLISH,
    GERMAN,
    evaluate_cli,
    exits_with,
    tiny_model,
    train_cli,
    translate_cli,
    write,
    write_parallel,
)
from transformers import AutoModelForSeq2SeqLM, BartConfig, BartForConditionalGeneration, MarianConfig, MarianMTModel

from vaswani_hf import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani_hf.data import DataError
from vaswani_hf.inference import translate_sentences


def train_on(tmp_path, *args):
    """One step of `vaswani-train` (`helpers.train_cli`) in `tmp_path`: the checks that refuse its input come first."""
    return train_cli(tmp_path / "out", tmp_path / "cache", "--max_steps", "1", *args)


# Parallel data through the train command ----------------------------------------------------------------------------


def test_train_cli_mismatched_line_counts_names_both_files(tmp_path):
    prefix = write_parallel(tmp_path / "data", english=ENGLISH[:-1])
    with pytest.raises(DataError) as error:
        train_on(tmp_path, "--train_file", prefix)
    message = str(error.value)
    assert f"{prefix}.de has 20 lines but {prefix}.en has 19 lines" in message
    assert "aligned line by line" in message


def test_train_cli_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match=r"no file for language 'de' at prefix .*nothing.* Check the prefix"):
        train_on(tmp_path, "--train_file", str(tmp_path / "nothing"))
    prefix = write_parallel(tmp_path / "data")
    write(tmp_path / "data" / "p.en", "")
    with pytest.raises(DataError, match=re.escape(f"{prefix}.en: file is empty (0 lines)")):
        train_on(tmp_path, "--train_file", prefix)
    with pytest.raises(DataError, match="without --train_file"):
        train_on(tmp_path, "--test_file", prefix)


def test_train_cli_non_utf8_names_file_and_line(tmp_path):
    prefix = write_parallel(tmp_path / "data")
    lines = (tmp_path / "data" / "p.de").read_bytes().split(b"\n")
    lines[6] = "Ein älterer Mann".encode("latin-1")
    write(tmp_path / "data" / "p.de", b"\n".join(lines))
    with pytest.raises(DataError, match=re.escape(f"{prefix}.de:7: not valid UTF-8 (byte b'\\xe4'") + ".*iconv"):
        train_on(tmp_path, "--train_file", prefix)


def test_train_cli_empty_lines_error_names_the_line_and_a_bad_policy_is_refused(tmp_path):
    english = list(ENGLISH)
    english[4] = "   "
    prefix = write_parallel(tmp_path / "data", english=english)
    with pytest.raises(DataError, match=re.escape(f"{prefix}.en:5: empty sentence") + ".*empty_lines='skip'"):
        train_on(tmp_path, "--train_file", prefix, "--empty_lines", "error")
    with pytest.raises(DataError, match=r"empty_lines='drop' is not one of \('skip', 'error', 'keep'\)"):
        train_on(tmp_path, "--train_file", prefix, "--empty_lines", "drop")


def test_train_cli_unknown_language_codes(tmp_path):
    with pytest.raises(DataError, match="Multi30k task 1 has languages 'de' and 'en', not 'fr'"):
        train_on(tmp_path, "--source_lang", "fr")
    prefix = write_parallel(tmp_path / "data")
    with pytest.raises(DataError, match=r"no file for language 'cs' .*Languages present for this prefix: de, en"):
        train_on(tmp_path, "--train_file", prefix, "--target_lang", "cs")
    with pytest.raises(DataError, match="source_lang and target_lang are both 'de'"):
        train_on(tmp_path, "--train_file", prefix, "--target_lang", "de")


def test_train_cli_zero_samples_is_refused_not_read_as_all(tmp_path):
    prefix = write_parallel(tmp_path / "data")
    for flag in ("--max_train_samples", "--max_test_samples", "--max_tokens", "--max_source_length"):
        with pytest.raises(DataError, match=f"{flag} must be >= 1 \\(leave the flag out for the default\\), got 0"):
            train_on(tmp_path, "--train_file", prefix, "--test_file", prefix, flag, "0")
    from vaswani_training.prepare import select

    with pytest.raises(DataError, match=r"take a number of examples >= 1 .*got 0"):  # the library function too
        select(list(range(3)), 0)


# Model and tokenizer that do not fit each other ---------------------------------------------------------------------


def test_train_cli_tokenizer_of_another_size_than_the_model(tmp_path, model_folder, tiny_tokenizer):
    small = tmp_path / "small"
    tiny_model().save_pretrained(small)  # vocabulary of 99, the tokenizer has 420
    prefix = write_parallel(tmp_path / "data")
    with pytest.raises(ValueError, match=f"tokenizer has {len(tiny_tokenizer)} entries but the model's vocabulary "
                                         f"has 99; pass the tokenizer saved with the model"):
        train_on(tmp_path, "--train_file", prefix, "--model_name_or_path", str(small),
              "--tokenizer_name", str(model_folder))


def test_translating_with_a_tokenizer_bigger_than_the_model(tiny_tokenizer):
    model = tiny_model()  # 99 entries; the tokenizer's ids go up to 419
    with pytest.raises(ValueError, match=r"input_ids holds token id \d+, outside this model's vocabulary of 99 "
                                         r"entries.*load the tokenizer saved with the model"):
        translate_sentences(model, tiny_tokenizer, GERMAN[:3], num_beams=1, max_new_tokens=3)


def test_train_cli_impossible_config_sizes(tmp_path):
    prefix = write_parallel(tmp_path / "data")
    with pytest.raises(ValueError, match=r"d_model \(30\) must be divisible by num_heads \(4\).*num_heads=3"):
        train_on(tmp_path, "--train_file", prefix, "--config_overrides", "d_model=30,num_heads=4")
    with pytest.raises(ValueError, match="d_ff must be a positive integer, got 0"):
        train_on(tmp_path, "--train_file", prefix, "--config_overrides", "d_ff=0")
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.5"):
        train_on(tmp_path, "--train_file", prefix, "--config_overrides", "dropout=1.5")


def test_a_saved_config_edited_to_impossible_sizes_is_refused_on_load(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_heads"] = 0
    (tmp_path / "config.json").write_text(json.dumps(config))
    for load in (VaswaniConfig.from_pretrained, VaswaniForConditionalGeneration.from_pretrained,
                 AutoModelForSeq2SeqLM.from_pretrained):
        with pytest.raises(ValueError, match="num_heads must be a positive integer, got 0"):
            load(tmp_path)


# Sentences longer than the model's positions ------------------------------------------------------------------------


def test_sinusoidal_positions_extrapolate_past_the_table(tiny_tokenizer):
    # The table holds 8 positions; the source has 30+ tokens and the output 12. The encodings are computed on the
    # fly, exactly as a model with a bigger table (the same weights: the table is not a parameter) has them.
    short = tiny_model(seed=3, vocab_size=len(tiny_tokenizer), max_position_embeddings=8)
    long = tiny_model(seed=3, vocab_size=len(tiny_tokenizer), max_position_embeddings=128)
    sentence = " ".join(GERMAN[:4])
    batch = tiny_tokenizer([sentence], return_tensors="pt")
    assert batch["input_ids"].shape[1] > 8 * 3
    with torch.no_grad():
        logits = short(**batch, decoder_input_ids=batch["input_ids"][:, :20]).logits
        reference = long(**batch, decoder_input_ids=batch["input_ids"][:, :20]).logits
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
    kwargs = dict(num_beams=2, max_new_tokens=12)
    out = translate_sentences(short, tiny_tokenizer, [sentence, GERMAN[5]], **kwargs)
    assert out == translate_sentences(long, tiny_tokenizer, [sentence, GERMAN[5]], **kwargs)


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
        train_on(tmp_path, "--train_file", prefix, "--config_overrides",
              "position_embedding_type=learned,max_position_embeddings=16")
    # The loop without Trainer runs the same check, with the same message.
    from vaswani_training.train_no_trainer import main as train_no_trainer

    with pytest.raises(ValueError, match=r"learned positions for 16 tokens \(max_position_embeddings\), fewer than "
                                         r"--max_source_length 256, --max_target_length 256.*sinusoidal"):
        train_no_trainer(["--preset", "tiny", "--output_dir", str(tmp_path / "nt"), "--cache_dir",
                          str(tmp_path / "cache"), "--max_steps", "1", "--cpu_bf16", "no", "--train_file", prefix,
                          "--config_overrides", "position_embedding_type=learned,max_position_embeddings=16"])
    assert not list((tmp_path / "nt").glob("*checkpoint-*"))


@pytest.fixture
def learned_folder(tmp_path, tiny_tokenizer):
    """A saved tiny model with learned positions for 32 tokens (each of GERMAN is at most 29), and its tokenizer."""
    folder = tmp_path / "learned"
    tiny_model(vocab_size=len(tiny_tokenizer), position_embedding_type="learned",
               max_position_embeddings=32).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def test_the_commands_check_every_length_before_translating(learned_folder, tmp_path, tiny_tokenizer, monkeypatch):
    """A line too long for the learned positions near the end of the input is refused, naming its line, before the
    first batch is translated (nothing translated and thrown away)."""
    import vaswani_hf.inference

    long_line = " ".join(GERMAN[:3])
    assert len(tiny_tokenizer(long_line)["input_ids"]) > 32
    source = write(tmp_path / "in.de", f"{GERMAN[0]}\n\n{GERMAN[1]}\n{long_line}\n")

    def never(*args, **kwargs):
        raise AssertionError("translated before every length was checked")

    monkeypatch.setattr(vaswani_hf.inference, "translate_sentences", never)
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
    from vaswani_hf.decoding import paper_generate

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


@pytest.mark.parametrize("command", ["translate", "evaluate"])
def test_a_non_integer_batch_size_names_the_flag(model_folder, tmp_path, capsys, command):
    run = translate_cli if command == "translate" else evaluate_cli
    with pytest.raises(SystemExit) as error:
        run("--model", model_folder, "--batch_size", "2.5")
    assert error.value.code == 2 and "argument --batch_size: invalid int value: '2.5'" in capsys.readouterr().err


# Generation arguments -----------------------------------------------------------------------------------------------


def test_generate_rejects_out_of_range_arguments():
    model = tiny_model()
    ids = torch.tensor([[5, 6, 7, 2]])
    # transformers itself fails on these with a ZeroDivisionError / a negative tensor dimension; ours says what is
    # wrong.
    for name, value in (("num_beams", 0), ("num_beams", -1), ("num_beams", 2.5), ("num_return_sequences", 0)):
        with pytest.raises(ValueError, match=rf"generate\(\): {name} must be an integer >= 1, got {value}"):
            model.generate(input_ids=ids, **{name: value})
    # These transformers refuses clearly already.
    with pytest.raises(ValueError, match="`max_new_tokens` must be greater than 0, but is -1"):
        model.generate(input_ids=ids, max_new_tokens=-1)
    with pytest.raises(ValueError, match=r"`num_return_sequences` \(3\) has to be smaller or equal to `num_beams` "
                                         r"\(2\)"):
        model.generate(input_ids=ids, num_beams=2, num_return_sequences=3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_beams=0), "num_beams must be an integer >= 1, got 0"),
        (dict(batch_size=0), "batch_size must be >= 1, got 0"),
        (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 1 or None, got -1"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1 or None, got 0"),
        (dict(max_source_length=0), "max_source_length must be an integer >= 1 or None, got 0"),
        (dict(length_penalty=math.nan), "length_penalty must be a finite number, got nan"),
    ],
)
def test_translate_sentences_rejects_out_of_range_arguments(tiny_tokenizer, kwargs, message):
    model = tiny_model(vocab_size=len(tiny_tokenizer))
    with pytest.raises(ValueError, match=re.escape(f"translate_sentences: {message}")):
        translate_sentences(model, tiny_tokenizer, GERMAN[:2], **kwargs)


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


# Empty input --------------------------------------------------------------------------------------------------------


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


# Folders that are not ours, or damaged --------------------------------------------------------------------------------


@pytest.fixture
def foreign_folders(tmp_path, tiny_tokenizer):
    """A tiny BART and a tiny Marian model, built locally, saved with a tokenizer."""
    sizes = dict(vocab_size=len(tiny_tokenizer), d_model=16, encoder_layers=1, decoder_layers=1,
                 encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                 max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 decoder_start_token_id=1)
    folders = {"bart": tmp_path / "bart", "marian": tmp_path / "marian"}
    BartForConditionalGeneration(BartConfig(**sizes)).save_pretrained(folders["bart"])
    MarianMTModel(MarianConfig(**sizes)).save_pretrained(folders["marian"])
    for folder in folders.values():
        tiny_tokenizer.save_pretrained(folder)
    return folders


@pytest.mark.parametrize(("model_type", "architecture"), [("bart", "BartForConditionalGeneration"),
                                                          ("marian", "MarianMTModel")])
def test_a_folder_of_another_model_type_is_refused(foreign_folders, tmp_path, model_type, architecture):
    folder = foreign_folders[model_type]
    # transformers alone only warns, then fails deep inside (Marian) or loads none of the weights (BART).
    for load in (VaswaniForConditionalGeneration.from_pretrained, VaswaniConfig.from_pretrained):
        with pytest.raises(ValueError, match=re.escape(f"{folder / 'config.json'}: model_type is "
                                                       f"'{model_type}' ({architecture}), not 'vaswani'")):
            load(folder)
    # The commands would otherwise load it with AutoModelForSeq2SeqLM and translate as a different model.
    expected = re.escape(f"{folder / 'config.json'}: model_type is '{model_type}' ({architecture}), not 'vaswani'")
    source = write(tmp_path / "in.de", "Ein Hund.\n")
    exits_with(lambda: translate_cli("--model", folder, "--input", source), expected)
    exits_with(lambda: evaluate_cli("--model", folder, "--max_test_samples", 2), expected)
    exits_with(lambda: translate_cli("--model", tmp_path / "nowhere", "--input", source),
               "is not a saved model folder \\(no config.json\\)")


@pytest.mark.parametrize("keep", [0, 4, 20, "half", "minus_one"])
def test_a_truncated_weights_file_is_refused(model_folder, tmp_path, keep):
    weights = model_folder / "model.safetensors"
    size = weights.stat().st_size
    keep = {"half": size // 2, "minus_one": size - 1}.get(keep, keep)
    with open(weights, "r+b") as handle:
        handle.truncate(keep)
    for load in (VaswaniForConditionalGeneration.from_pretrained, AutoModelForSeq2SeqLM.from_pretrained):
        with pytest.raises(OSError, match=re.escape(f"{model_folder}: the weights file (model.safetensors) cannot be "
                                                    f"read") + ".*truncated or corrupted"):
            load(model_folder)
    source = write(tmp_path / "in.de", "Ein Hund.\n")
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source),
               re.escape(f"{model_folder}: the weights cannot be used (model.safetensors is truncated"),
               "copy it again or use another checkpoint")


def test_weights_with_nan_bytes_are_refused(model_folder):
    # safetensors has no checksum: bytes overwritten in place (same length) load without complaint in transformers.
    weights = model_folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = b"\xff" * 64  # float32 0xffffffff is NaN
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=re.escape(f"{model_folder}: weight ") + r".* holds NaN or infinite values"):
        VaswaniForConditionalGeneration.from_pretrained(model_folder)


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
