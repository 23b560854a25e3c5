"""The one check of parallel data (vaswani_hf/data/checking.py) at every door that reads it: the in-memory loaders,
the streams, and vaswani-train before any work, streaming or not.

Malformed data of every kind (records of another layout, other language codes, non-string sentences, no train split,
empty or blank files, invalid JSON, non-UTF-8 bytes) ends in a `CheckError` that names the file and line, or the
dataset, split and row, and the command writes nothing; a run that would train no step is refused before it starts;
metrics.json counts the pairs trained and those left out; a --streaming run resumed past its first pass continues
exactly as the uninterrupted one (docs/reliability.md).
"""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from helpers import ENGLISH, GERMAN, ROOT, train_cli, write, write_parallel
from hypothesis import given, settings
from hypothesis import strategies as st

from vaswani_hf.checks import CheckError
from vaswani_hf.data import (
    StreamingTokenBudgetBatches,
    check_parallel_data,
    load_parallel_dataset,
    read_parallel_jsonl,
    stream_parallel_pairs,
    translation_pair,
)

PAIRS = list(zip(GERMAN, ENGLISH))


def good(de: str, en: str) -> dict:
    return {"translation": {"de": de, "en": en}}


# Records of every other layout: (name, record made from a pair, what the message must say)
BAD_RECORDS = [
    ("flat", lambda de, en: {"de": de, "en": en}, r"expected an object with a 'translation' object.*keys: de, en"),
    ("text", lambda de, en: {"text": de}, r"expected an object with a 'translation' object.*keys: text"),
    ("other codes", lambda de, en: {"translation": {"fr": de, "en": en}},
     r"language 'de' not in .*codes present: en, fr"),
    ("target missing", lambda de, en: {"translation": {"de": de}}, r"language 'en' not in .*codes present: de"),
    ("number", lambda de, en: {"translation": {"de": 3, "en": en}}, r"translation\['de'\] must be a string, got int"),
    ("list", lambda de, en: {"translation": {"de": de, "en": [en]}}, r"translation\['en'\] must be a string, got list"),
    ("null", lambda de, en: {"translation": {"de": None, "en": en}}, r"language 'de' not in .*missing or null"),
    ("translation a string", lambda de, en: {"translation": de}, r"expected an object with a 'translation' object"),
]


def write_records(path: Path, records) -> Path:
    return write(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def hub_folder(folder: Path, train=None, validation=None, test=None) -> Path:
    """A folder in the Hub's layout; a split given as None gets good records, as False is left out."""
    for split, records, n in (("train", train, 20), ("validation", validation, 4), ("test", test, 3)):
        if records is False:
            continue
        if isinstance(records, (str, bytes)):
            write(folder / f"{split}.jsonl", records)
        else:
            write_records(folder / f"{split}.jsonl", records or [good(de, en) for de, en in PAIRS[:n]])
    return folder


def refused(call, *patterns: str) -> str:
    """`call()` raises a CheckError whose message matches every pattern; returns the message."""
    with pytest.raises(CheckError) as error:
        call()
    message = str(error.value)
    for pattern in patterns:
        assert re.search(pattern, message), (pattern, message)
    return message


# One record -----------------------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
                        ["translation", "de", "en", "fr", "text"]), inner, max_size=3), max_leaves=8))
def test_a_record_is_a_pair_of_strings_or_an_error_naming_where(record):
    """Any JSON value: the two stripped sentences where it is a 'translation' object with string 'de' and 'en', else
    a CheckError naming the record's place."""
    translation = record.get("translation") if isinstance(record, dict) else None
    fine = isinstance(translation, dict) and all(isinstance(translation.get(lang), str) for lang in ("de", "en"))
    if fine:
        assert translation_pair(record, "de", "en", "f.jsonl:7") == (translation["de"].strip(),
                                                                     translation["en"].strip())
    else:
        refused(lambda: translation_pair(record, "de", "en", "f.jsonl:7"), r"^f\.jsonl:7: ")


# Every door, every bad record -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,make,pattern", BAD_RECORDS, ids=[case[0] for case in BAD_RECORDS])
def test_a_bad_record_is_refused_by_every_reader_naming_file_and_line_or_split_and_row(tmp_path, name, make,
                                                                                      pattern):
    """The bad record third in a JSON-lines file and in a dataset folder's train split: the in-memory loaders, the
    streams and the up-front check all refuse it, naming the file and line 3 (or the split and row 2)."""
    records = [good(*PAIRS[0]), good(*PAIRS[1]), make(*PAIRS[2]), good(*PAIRS[3])]
    path = write_records(tmp_path / "t.jsonl", records)
    at_line = re.escape(f"{path}:3: ")
    refused(lambda: read_parallel_jsonl(path, "de", "en"), at_line, pattern)
    refused(lambda: load_parallel_dataset(path), at_line, pattern)
    refused(lambda: list(stream_parallel_pairs(path)()), at_line, pattern)
    # a bad first record is found by the up-front check, which reads no further
    write_records(tmp_path / "first.jsonl", records[2:])
    refused(lambda: check_parallel_data({"train": tmp_path / "first.jsonl"}), re.escape("first.jsonl:1: "), pattern)

    folder = hub_folder(tmp_path / "hub", train=records)
    at_row = re.escape(f"Hub dataset '{folder}' split 'train' row 2: ")
    refused(lambda: list(stream_parallel_pairs(hub_dataset=str(folder))()), at_row, pattern)
    first = hub_folder(tmp_path / "hubfirst", train=records[2:])
    at_first = re.escape(f"Hub dataset '{first}' split 'train' row 0: ")
    refused(lambda: check_parallel_data(hub_dataset=str(first)), at_first, pattern)
    refused(lambda: load_parallel_dataset(hub_dataset=str(first), hub_kwargs={"cache_dir": str(tmp_path / "c")}),
            at_first, pattern)


EMPTY_DATA = {
    "empty file": ("", r"file is empty"),
    "blank lines": ("\n\n  \n", r"no sentence pair with both sides non-empty|only blank lines"),
    "empty sentences": ("".join(json.dumps(good("", en)) + "\n" for en in ENGLISH[:3]),
                        r"no sentence pair with both sides non-empty"),
}


@pytest.mark.parametrize("kind", list(EMPTY_DATA))
@pytest.mark.parametrize("split", ["train", "validation", "test"])
def test_empty_data_is_refused_before_datasets_sees_it(tmp_path, kind, split):
    """A split with no usable pair (an empty file, blank lines, every pair with an empty side) is refused by the
    project's own check, naming the split's file, never datasets' 'Instruction ... corresponds to no data'."""
    text, pattern = EMPTY_DATA[kind]
    files = {s: write_records(tmp_path / f"{s}.jsonl", [good(*pair) for pair in PAIRS[:4]]) for s in
             ("train", "validation", "test")}
    write(files[split], text)
    for call in (lambda: check_parallel_data(files), lambda: load_parallel_dataset(files),
                 lambda: load_parallel_dataset(files[split])):
        message = refused(call, pattern)
        assert str(files[split]) in message and "Instruction" not in message
    folder = hub_folder(tmp_path / "hub", **{split: text})
    for call in (lambda: check_parallel_data(hub_dataset=str(folder)),
                 lambda: load_parallel_dataset(hub_dataset=str(folder), hub_kwargs={"cache_dir": str(tmp_path / "c")})):
        message = refused(call, f"{split}|{re.escape(str(folder))}")
        assert "Instruction" not in message and "StopIteration" not in message


@pytest.mark.parametrize("streaming", [False, True])
def test_a_dataset_folder_without_a_train_split_is_refused_by_name(tmp_path, streaming):
    folder = hub_folder(tmp_path / "hub", train=False)
    refused(lambda: check_parallel_data(hub_dataset=str(folder)), r"has no 'train' split \(splits: validation, test\)")
    out = tmp_path / "out"
    refused(lambda: train_cli(out, tmp_path / "cache", "--dataset_name", folder, "--max_steps", "1",
                              *(["--streaming"] if streaming else [])), r"has no 'train' split")
    assert not out.exists()


# The command: refused before any work, nothing written ----------------------------------------------------------------

MUTATIONS = {  # a train split's bytes, made from good records
    "flat records": lambda lines: [json.dumps({"de": de, "en": en}) for de, en in PAIRS],
    "text records": lambda lines: [json.dumps({"text": de}) for de, _ in PAIRS],
    "other codes": lambda lines: [json.dumps({"translation": {"fr": de, "en": en}}) for de, en in PAIRS],
    "truncated": lambda lines: [lines[0][: len(lines[0]) // 2]],
    "non-UTF-8": lambda lines: [lines[0].replace("ä", "\udce4")],
    "a bad row later": lambda lines: lines[:5] + [json.dumps({"translation": {"de": 1, "en": "x"}})] + lines[5:],
}


def _mutated(lines, mutation: str) -> bytes:
    return "".join(line + "\n" for line in MUTATIONS[mutation](lines)).encode("utf-8", "surrogateescape")


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("layout", ["file", "folder"])
def test_vaswani_train_refuses_bad_training_data_naming_it_and_writes_nothing(tmp_path, mutation, streaming, layout):
    """--train_file FILE.jsonl or --dataset_name FOLDER, with and without --streaming: each mutation of the training
    split exits with a message naming the file (or split) and the line (or row), and --output_dir is not created."""
    lines = [json.dumps(good(de, en), ensure_ascii=False) for de, en in PAIRS]
    flags = ["--max_steps", "1", *(["--streaming"] if streaming else [])]
    if layout == "file":
        train = write(tmp_path / "train.jsonl", _mutated(lines, mutation))
        flags += ["--train_file", train]
        named = re.escape(str(train)) + r":\d+"
    else:
        folder = hub_folder(tmp_path / "hub", train=_mutated(lines, mutation))
        flags += ["--dataset_name", folder]
        named = re.escape(f"'{folder}'") + r".*(split 'train' row \d+|train\.jsonl)|" + re.escape(str(folder))
    out = tmp_path / "out"
    refused(lambda: train_cli(out, tmp_path / "cache", *flags), named)
    assert not out.exists()


def test_command_exits_1_with_one_line_and_creates_no_output_dir(tmp_path, monkeypatch):
    from vaswani_training.train import cli

    folder = hub_folder(tmp_path / "hub", train=[{"de": de, "en": en} for de, en in PAIRS])
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["vaswani-train", "--preset", "tiny", "--streaming", "--max_steps", "1",
                                      "--dataset_name", str(folder), "--output_dir", str(out),
                                      "--cache_dir", str(tmp_path / "cache")])
    with pytest.raises(SystemExit) as exit_:
        cli()
    assert str(exit_.value.code).startswith("error: Hub dataset") and "\n" not in str(exit_.value.code)
    assert "KeyError" not in str(exit_.value.code) and not out.exists()


# A run that would train no step ---------------------------------------------------------------------------------------


def test_a_stream_that_yields_no_batch_is_refused_before_anything_is_written(tmp_path):
    """Every pair over the length limits: --streaming used to train 0 steps, exit 0 and write a random model, its
    metrics and translations; it is refused, and --output_dir is not created."""
    prefix = write_parallel(tmp_path / "data")
    out = tmp_path / "out"
    refused(lambda: train_cli(out, tmp_path / "cache", "--train_file", prefix, "--streaming", "--max_steps", "2",
                              "--max_source_length", "2", "--max_target_length", "2"),
            r"yields no batch: all 20 of its 20 pairs are longer than the limits", "--max_source_length")
    assert not out.exists()


def test_streaming_batches_refuse_a_pass_without_a_batch(tiny_tokenizer):
    stream = StreamingTokenBudgetBatches(lambda: iter(PAIRS), tiny_tokenizer, max_tokens=64, max_source_length=1)
    refused(stream.check_first_batch, "all 20 of its 20 pairs")
    refused(lambda: list(stream), "all 20 of its 20 pairs")
    empty = StreamingTokenBudgetBatches(lambda: iter([]), tiny_tokenizer, max_tokens=64)
    refused(lambda: list(empty), "holds no sentence pairs")
    fine = StreamingTokenBudgetBatches(lambda: iter(PAIRS), tiny_tokenizer, max_tokens=200, max_source_length=64)
    fine.check_first_batch()
    assert fine.num_dropped == 0 and sum(len(batch) for batch in fine) + fine.num_dropped == 20


# --drop_long_pairs: what metrics.json counts --------------------------------------------------------------------------


def test_metrics_count_the_pairs_trained_and_those_left_out(tmp_path):
    german = list(GERMAN[:12]) + [" ".join(GERMAN * 2)]
    english = list(ENGLISH[:12]) + [" ".join(ENGLISH * 2)]
    prefix = write_parallel(tmp_path / "data", german, english)
    metrics = train_cli(tmp_path / "out", tmp_path / "cache", "--train_file", prefix, "--validation_file", prefix,
                        "--test_file", prefix, "--max_steps", "1", "--skip_test", "--vocab_size", "300",
                        "--max_source_length", "64", "--max_target_length", "64", "--drop_long_pairs")
    assert (metrics["train_pairs"], metrics["train_pairs_left_out"]) == (12, 1)
    on_disk = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert (on_disk["train_pairs"], on_disk["train_pairs_left_out"]) == (12, 1)


# --streaming resumed past its first pass ------------------------------------------------------------------------------


def _losses(folder: Path) -> dict[int, float]:
    state = json.loads((folder / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


def test_a_streaming_run_resumed_past_its_first_pass_continues_exactly(tmp_path):
    """docs/reliability.md: a --streaming run resumed with --resume_from_checkpoint has the same per-step losses as
    the uninterrupted run, past the first pass over the stream too (20 pairs make 6 batches a pass here; the run is
    resumed at step 8, in its second pass, whose batch order differs from the first's)."""
    prefix = write_parallel(tmp_path / "data")
    flags = ["--train_file", prefix, "--streaming", "--max_steps", "11", "--save_steps", "4", "--logging_steps", "1",
             "--max_tokens", "80", "--skip_test", "--seed", "5"]
    full = tmp_path / "full"
    train_cli(full, tmp_path / "cache", *flags)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-8", resumed / "checkpoint-8")
    train_cli(resumed, tmp_path / "cache", *flags, "--resume_from_checkpoint", "last")
    expected, got = _losses(full / "checkpoint-11"), _losses(resumed / "checkpoint-11")
    assert len(expected) == 11 and [got[step] for step in (9, 10, 11)] == pytest.approx(
        [expected[step] for step in (9, 10, 11)], rel=1e-5)
    assert "resumed past its first pass" in (ROOT / "docs" / "reliability.md").read_text()


@pytest.mark.parametrize("damage", ["missing", "empty", "other lengths", "not UTF-8"])
def test_vaswani_evaluate_refuses_a_bad_test_file_in_one_line_naming_it(model_folder, tmp_path, damage):
    from helpers import evaluate_cli

    prefix = tmp_path / "data" / "test"
    if damage != "missing":
        write_parallel(prefix.parent, GERMAN[:3], ENGLISH[:3], name="test")
        Path(f"{prefix}.en").write_bytes({"empty": b"", "other lengths": "\n".join(ENGLISH[:2]).encode() + b"\n",
                          "not UTF-8": b"A dog \xe4.\n" * 3}[damage])
    with pytest.raises(SystemExit) as refused:
        evaluate_cli("--model", model_folder, "--test_file", prefix, "--source_lang", "de", "--target_lang", "en",
                     "--output", tmp_path / "scores.json")
    message = str(refused.value.code)
    assert str(prefix) in message and "\n" not in message, message
    assert not (tmp_path / "scores.json").exists()
