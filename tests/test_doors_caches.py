"""Damaged cache entries are named, removed and rebuilt, never loaded (`vaswani_hf.data.caches`):

- the Arrow copy of local files (`load_parallel_dataset`, `Dataset.from_generator`'s builder folder), of a folder in
  the Hub's layout (`datasets.load_dataset`'s builder folder) and the `Dataset.map` cache files (the cleaned Hub rows,
  the tokenized splits): cut at any byte, emptied, deleted, with a garbled schema or end-of-stream marker, offsets
  pointing outside the file, or a `dataset_info.json` that does not parse or disagrees with the files;
- the joint BPE cache of `get_tokenizer`: an entry without tokenizer.json, with a file cut short, garbled, emptied or
  of wrong JSON, without its manifest;
- a process killed before its rename leaves no entry a later run loads (both caches).

Each mutation is followed by the next load: it warns naming the entry, and gives exactly what an intact cache gives.
"""

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import datasets
import pyarrow as pa
import pytest
from helpers import ENGLISH, GERMAN, ROOT, write_jsonl, write_parallel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vaswani_hf import train_joint_bpe
from vaswani_hf.data import load_parallel_dataset, tokenize_dataset
from vaswani_hf.data.caches import MANIFEST_NAME, arrow_file_problem, builder_entry_problem, manifest_problem

FEW = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
PAIRS = [(f"{g} ({i})", f"{e} ({i})") for i in range(60) for g, e in zip(GERMAN, ENGLISH)]  # 1,200 pairs, 2 batches


@pytest.fixture(autouse=True)
def own_datasets_cache(tmp_path, monkeypatch):
    """Each test's own `datasets` cache, so that its mutations touch no other test's entries."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    datasets.disable_progress_bars()


def damage_warnings(caplog) -> list[str]:
    messages = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    caplog.clear()
    return messages


def messages(data: bytes) -> list[tuple[str, int, int, int]]:
    """The IPC stream's messages: (type, start, end of header, end of body)."""
    source = pa.BufferReader(data)
    reader, found, start = pa.ipc.MessageReader.open_stream(source), [], 0
    while True:
        try:
            message = reader.read_next_message()
        except StopIteration:
            return found
        end = source.tell()
        found.append((message.type, start, end - message.body.size, end))
        start = end


def cut(at):
    return lambda data: data[:at(data)]


def garble(at, value=0x5A):
    def mutate(data):
        position = at(data)
        return data[:position] + bytes([data[position] ^ value or 1]) + data[position + 1:]
    return mutate


def offset_out_of_range(data: bytes) -> bytes:
    """The first record batch's last string offset (in its body) set far past the file's end."""
    _, _, header_end, body_end = messages(data)[1]
    body = bytearray(data[header_end:body_end])
    # the body's first int32 buffer that counts up from 0 is the first string column's offsets
    for start in range(0, len(body) - 8, 8):
        if body[start:start + 8] == (0).to_bytes(4, "little") + body[start + 4:start + 8] and \
                0 < int.from_bytes(body[start + 4:start + 8], "little") < 200:
            body[start + 4:start + 8] = (0x7FFFFFF0).to_bytes(4, "little")
            return data[:header_end] + bytes(body) + data[body_end:]
    raise AssertionError("no offsets buffer found")


# Mutations of one Arrow file, each one the checks must catch (the file is written again, or the load refused).
ARROW_MUTATIONS = {
    "emptied": lambda data: b"",
    "cut after the schema": cut(lambda data: messages(data)[0][3]),
    "cut between record batches": cut(lambda data: messages(data)[1][3]),
    "cut in a record batch's body": cut(lambda data: messages(data)[1][3] - 100),
    "cut in a record batch's header": cut(lambda data: messages(data)[1][1] + 20),
    "end-of-stream marker cut": cut(lambda data: len(data) - 8),
    "last byte cut": cut(lambda data: len(data) - 1),
    "end-of-stream marker garbled": garble(lambda data: len(data) - 5),
    "schema's metadata length garbled": garble(lambda data: 5, 0x40),
    "offsets point past the file": offset_out_of_range,
}


def local_split(tmp_path):
    prefix = write_parallel(tmp_path / "data", [g for g, _ in PAIRS], [e for _, e in PAIRS])
    return lambda: load_parallel_dataset(prefix, "de", "en")


def intact(load):
    dataset = load()
    return dataset, dataset.to_list(), Path(dataset.cache_files[0]["filename"])


# The Arrow copy of local files ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mutation", sorted(ARROW_MUTATIONS))
def test_a_damaged_arrow_copy_of_local_files_is_named_removed_and_written_again(tmp_path, caplog, mutation):
    load = local_split(tmp_path)
    _, expected, arrow = intact(load)
    assert arrow_file_problem(arrow) is None and len(expected) == len(PAIRS)
    arrow.write_bytes(ARROW_MUTATIONS[mutation](arrow.read_bytes()))
    assert arrow_file_problem(arrow), f"{mutation}: not found damaged"
    with caplog.at_level(logging.WARNING):
        again = load()
    (warning,) = damage_warnings(caplog)
    assert str(arrow.parent) in warning and arrow.name in warning
    assert again.to_list() == expected
    assert builder_entry_problem(arrow.parent) is None, "the entry is whole again"


@pytest.mark.parametrize("mutation", ["deleted", "not JSON", "a JSON list", "truncated", "one row too many",
                                      "features of other languages"])
def test_a_damaged_or_missing_part_of_the_builder_folder_is_named_and_written_again(tmp_path, caplog, mutation):
    load = local_split(tmp_path)
    _, expected, arrow = intact(load)
    info_path = arrow.parent / "dataset_info.json"
    info = json.loads(info_path.read_text())
    if mutation == "deleted":
        arrow.unlink()  # a file dataset_info.json lists
    elif mutation == "not JSON":
        info_path.write_text("{")
    elif mutation == "a JSON list":
        info_path.write_text("[]")
    elif mutation == "truncated":
        info_path.write_text(info_path.read_text()[:40])
    elif mutation == "one row too many":
        info["splits"]["train"]["num_examples"] += 1
        info_path.write_text(json.dumps(info))
    else:
        info["features"]["translation"]["languages"] = ["fr", "en"]
        info_path.write_text(json.dumps(info))
    with caplog.at_level(logging.WARNING):
        again = load()
    (warning,) = damage_warnings(caplog)
    assert str(arrow.parent) in warning
    assert again.to_list() == expected


@FEW
@given(data=st.data())
def test_the_arrow_copy_cut_at_any_byte_is_written_again(tmp_path, caplog, data):
    load = local_split(tmp_path)
    _, expected, arrow = intact(load)
    whole = arrow.read_bytes()
    arrow.write_bytes(whole[:data.draw(st.integers(0, len(whole) - 1), label="keep")])
    with caplog.at_level(logging.WARNING):
        again = load()
    assert str(arrow.parent) in " ".join(damage_warnings(caplog))
    assert again.to_list() == expected and arrow.read_bytes() == whole


@FEW
@given(data=st.data())
def test_a_garbled_schema_or_end_marker_never_reads_other_data(tmp_path, caplog, data):
    # Bytes of the schema message and the end-of-stream marker: the load warns and writes the file again, or the byte
    # changed nothing that is read (padding). Bytes inside the data are not checked (docs/reliability.md).
    load = local_split(tmp_path)
    _, expected, arrow = intact(load)
    whole = arrow.read_bytes()
    schema_end = messages(whole)[0][3]
    position = data.draw(st.one_of(st.integers(0, schema_end - 1), st.integers(len(whole) - 8, len(whole) - 1)),
                         label="position")
    value = data.draw(st.integers(0, 255).filter(lambda v: v != whole[position]), label="value")
    arrow.write_bytes(whole[:position] + bytes([value]) + whole[position + 1:])
    with caplog.at_level(logging.WARNING):
        again = load()
    warnings = damage_warnings(caplog)
    assert again.to_list() == expected
    assert all(str(arrow.parent) in warning for warning in warnings)


def test_a_reader_error_is_not_taken_for_a_damaged_cache(tmp_path, caplog):
    prefix = write_parallel(tmp_path / "data", ["a", "b"], ["A"])
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match=r"p\.(de|en)"):
        load_parallel_dataset(prefix, "de", "en")
    assert not damage_warnings(caplog)


# Dataset.map's cache files: the tokenized splits ------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_bpe():
    return train_joint_bpe([[g for g, _ in PAIRS], [e for _, e in PAIRS]], vocab_size=300)


@pytest.mark.parametrize("mutation", sorted(ARROW_MUTATIONS) + ["deleted"])
def test_a_damaged_tokenized_cache_file_is_named_removed_and_computed_again(tmp_path, caplog, small_bpe, mutation):
    raw = local_split(tmp_path)()
    first = tokenize_dataset(raw, small_bpe, "de", "en", max_length=40)
    expected = first.to_dict()
    cache = Path(first.cache_files[0]["filename"])
    assert cache.name.startswith("cache-") and arrow_file_problem(cache) is None
    if mutation == "deleted":
        cache.unlink()  # a cache miss, not damage: computed again without a warning
    else:
        cache.write_bytes(ARROW_MUTATIONS[mutation](cache.read_bytes()))
    with caplog.at_level(logging.WARNING):
        again = tokenize_dataset(raw, small_bpe, "de", "en", max_length=40)
    warnings = damage_warnings(caplog)
    if mutation == "deleted":
        assert not warnings
    else:
        (warning,) = warnings
        assert str(cache) in warning
    assert again.to_dict() == expected and arrow_file_problem(cache) is None


@FEW
@given(data=st.data())
def test_a_tokenized_cache_file_cut_at_any_byte_is_computed_again(tmp_path, caplog, small_bpe, data):
    raw = local_split(tmp_path)()
    first = tokenize_dataset(raw, small_bpe, "de", "en")
    expected, cache = first.to_dict(), Path(first.cache_files[0]["filename"])
    whole = cache.read_bytes()
    cache.write_bytes(whole[:data.draw(st.integers(0, len(whole) - 1), label="keep")])
    with caplog.at_level(logging.WARNING):
        again = tokenize_dataset(raw, small_bpe, "de", "en")
    assert str(cache) in " ".join(damage_warnings(caplog))
    assert again.to_dict() == expected


# A folder in the Hub's layout: load_dataset's builder folder and the cleaned rows' map cache ----------------------


@pytest.mark.parametrize("part", ["builder", "cleaned"])
@pytest.mark.parametrize("mutation", ["cut in a record batch's body", "cut between record batches", "emptied"])
def test_a_damaged_cache_of_a_hub_layout_folder_is_named_removed_and_written_again(tmp_path, caplog, part,
                                                                                  mutation):
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", PAIRS)
    write_jsonl(folder / "validation.jsonl", PAIRS[:3])
    load = lambda: load_parallel_dataset(hub_dataset=str(folder), hub_kwargs={"cache_dir": str(tmp_path / "hub")})  # noqa: E731
    first = load()
    expected = {split: first[split].to_list() for split in first}
    cleaned = Path(first["train"].cache_files[0]["filename"])
    builder_file = next(cleaned.parent.glob("*-train.arrow"))
    target = builder_file if part == "builder" else cleaned
    target.write_bytes(ARROW_MUTATIONS[mutation](target.read_bytes()))
    with caplog.at_level(logging.WARNING):
        again = load()
    (warning,) = damage_warnings(caplog)
    assert str(target if part == "cleaned" else target.parent) in warning
    assert {split: again[split].to_list() for split in again} == expected


# The joint BPE cache --------------------------------------------------------------------------------------------


def get_tokenizer_in(cache_dir: Path):
    from vaswani_training.lib.arguments import DataArguments, ModelArguments
    from vaswani_training.lib.prepare import get_tokenizer

    data = datasets.Dataset.from_dict({"translation": [{"de": g, "en": e} for g, e in PAIRS[:40]]})
    return get_tokenizer(ModelArguments(cache_dir=str(cache_dir)), data, DataArguments(), 300)


def tokenizer_mutations(entry: Path) -> dict:
    def rewrite(name, change):
        return lambda: (entry / name).write_bytes(change((entry / name).read_bytes()))

    def swap_two_ids(data):  # still valid JSON that loads: another tokenizer
        settings = json.loads(data)
        vocab = settings["model"]["vocab"]
        a, b = list(vocab)[-2:]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        return json.dumps(settings, ensure_ascii=False).encode()

    return {
        "no tokenizer.json": lambda: (entry / "tokenizer.json").unlink(),
        "tokenizer.json cut at 10": rewrite("tokenizer.json", lambda d: d[:10]),
        "tokenizer.json cut at half": rewrite("tokenizer.json", lambda d: d[:len(d) // 2]),
        "tokenizer.json cut by a byte": rewrite("tokenizer.json", lambda d: d[:-1]),
        "tokenizer.json emptied": rewrite("tokenizer.json", lambda d: b""),
        "tokenizer.json garbled": rewrite("tokenizer.json", lambda d: d[:100] + b"\xff\xfe" + d[102:]),
        "tokenizer.json two ids swapped": rewrite("tokenizer.json", swap_two_ids),
        "tokenizer_config.json wrong JSON": rewrite("tokenizer_config.json", lambda d: b"[1, 2]"),
        "tokenizer_config.json not JSON": rewrite("tokenizer_config.json", lambda d: d[:-2]),
        "no tokenizer_config.json": lambda: (entry / "tokenizer_config.json").unlink(),
        "no manifest": lambda: (entry / MANIFEST_NAME).unlink(),
        "manifest not JSON": rewrite(MANIFEST_NAME, lambda d: d[:5]),
        "manifest lists nothing": rewrite(MANIFEST_NAME, lambda d: b'{"sha256": {}}'),
    }


@pytest.fixture(scope="module")
def intact_tokenizer(tmp_path_factory):
    return get_tokenizer_in(tmp_path_factory.mktemp("bpe_cache"))


@pytest.mark.parametrize("mutation", sorted(tokenizer_mutations(Path())))
def test_a_damaged_joint_bpe_entry_is_named_removed_and_trained_again(tmp_path, caplog, intact_tokenizer,
                                                                    mutation):
    first = get_tokenizer_in(tmp_path)
    (entry,) = (tmp_path / "tokenizers").iterdir()
    assert manifest_problem(entry) is None and first.get_vocab() == intact_tokenizer.get_vocab()
    tokenizer_mutations(entry)[mutation]()
    assert manifest_problem(entry), f"{mutation}: not found damaged"
    with caplog.at_level(logging.WARNING):
        again = get_tokenizer_in(tmp_path)
    (warning,) = damage_warnings(caplog)
    assert str(entry) in warning
    assert again.get_vocab() == intact_tokenizer.get_vocab()
    sentences = [g for g, _ in PAIRS[:5]]
    assert again(sentences)["input_ids"] == intact_tokenizer(sentences)["input_ids"]
    assert manifest_problem(entry) is None and [p.name for p in (tmp_path / "tokenizers").iterdir()] == [entry.name]


@FEW
@given(data=st.data())
def test_any_cache_file_of_the_joint_bpe_cut_or_overwritten_is_trained_again(tmp_path, caplog, intact_tokenizer,
                                                                           data):
    get_tokenizer_in(tmp_path)
    (entry,) = (tmp_path / "tokenizers").iterdir()
    path = entry / data.draw(st.sampled_from(sorted(p.name for p in entry.iterdir())), label="file")
    whole = path.read_bytes()
    if data.draw(st.booleans(), label="cut"):
        path.write_bytes(whole[:data.draw(st.integers(0, len(whole) - 1), label="keep")])
    else:
        path.write_bytes(data.draw(st.binary(min_size=0, max_size=64).filter(lambda b: b != whole), label="bytes"))
    with caplog.at_level(logging.WARNING):
        again = get_tokenizer_in(tmp_path)
    assert str(entry) in " ".join(damage_warnings(caplog))
    assert again.get_vocab() == intact_tokenizer.get_vocab() and manifest_problem(entry) is None


def test_an_entry_that_is_a_file_is_replaced(tmp_path, caplog, intact_tokenizer):
    get_tokenizer_in(tmp_path)
    (entry,) = (tmp_path / "tokenizers").iterdir()
    for child in entry.iterdir():
        child.unlink()
    entry.rmdir()
    entry.write_text("not a folder")
    with caplog.at_level(logging.WARNING):
        again = get_tokenizer_in(tmp_path)
    assert str(entry) in " ".join(damage_warnings(caplog))
    assert entry.is_dir() and again.get_vocab() == intact_tokenizer.get_vocab()


# A process killed before its rename leaves no entry a later run loads ---------------------------------------------

KILLED_AT_RENAME = textwrap.dedent("""
    import os, shutil, sys
    sys.path.insert(0, {tests!r})
    import datasets
    datasets.config.HF_DATASETS_CACHE = {hf!r}
    datasets.disable_progress_bars()

    def killed(*args, **kwargs):  # the rename that makes the entry visible never happens
        os._exit(9)

    shutil.move = killed  # datasets renames its staged folders and files with shutil.move
    import test_doors_caches as t
    {body}
""")


def killed_before_rename(tmp_path, *bodies: str) -> None:
    """Run each of `bodies` in its own process (at once) with the renames patched to kill it; each must be killed."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    script = KILLED_AT_RENAME.replace("{tests!r}", repr(str(ROOT / "tests"))).replace(
        "{hf!r}", repr(str(tmp_path / "hf_datasets")))
    processes = [subprocess.Popen([sys.executable, "-c", script.replace("{body}", body)], cwd=tmp_path, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for body in bodies]
    for process in processes:
        _, stderr = process.communicate(timeout=240)
        assert process.returncode == 9, stderr[-2000:]


def test_a_kill_before_the_rename_leaves_no_entry_a_later_run_loads(tmp_path, caplog, intact_tokenizer, small_bpe):
    # Killed at the rename that would make each entry visible: the joint BPE (staged in a hidden folder beside its
    # entry), the Arrow copy of local files (datasets' `.incomplete` folder) and the tokenized split (datasets' tmp
    # file beside the Arrow copy). A later run finds no entry, warns of none, and builds each whole.
    raw = local_split(tmp_path / "b")()  # its Arrow copy exists; the kill comes at its tokenized file's rename
    expected_ids = tokenize_dataset(raw, small_bpe, "de", "en").to_dict()
    folder = Path(raw.cache_files[0]["filename"]).parent
    for file in folder.glob("cache-*.arrow"):
        file.unlink()
    small_bpe.save_pretrained(tmp_path / "bpe")
    killed_before_rename(
        tmp_path,
        f"import vaswani_training.lib.prepare as p; p.swap_in_folder = killed; t.get_tokenizer_in({str(tmp_path)!r})",
        f"t.local_split(__import__('pathlib').Path({str(tmp_path / 'a')!r}))()",
        f"from transformers import AutoTokenizer; raw = t.local_split(__import__('pathlib').Path("
        f"{str(tmp_path / 'b')!r}))(); t.tokenize_dataset(raw, AutoTokenizer.from_pretrained({str(tmp_path / 'bpe')!r}"
        f"), 'de', 'en')")
    staged = list((tmp_path / "tokenizers").iterdir())
    assert staged and all(p.name.startswith(".") for p in staged), staged
    assert list((tmp_path / "hf_datasets").rglob("*.incomplete")), "killed while the Arrow copy was staged"
    assert len(list((tmp_path / "hf_datasets").rglob("dataset_info.json"))) == 1, "only b's, written before"
    assert not list(folder.glob("cache-*.arrow")) and list(folder.glob("tmp*")), "killed with the ids staged"
    with caplog.at_level(logging.WARNING):
        tokenizer = get_tokenizer_in(tmp_path)
        dataset = local_split(tmp_path / "a")()
        ids = tokenize_dataset(raw, small_bpe, "de", "en")
    assert not damage_warnings(caplog)
    assert tokenizer.get_vocab() == intact_tokenizer.get_vocab()
    assert dataset.to_list() == [{"translation": {"de": g, "en": e}} for g, e in PAIRS]
    assert ids.to_dict() == expected_ids


# vaswani-train on damaged caches ----------------------------------------------------------------------------------


def test_train_cli_runs_on_damaged_caches_as_on_intact_ones(tmp_path, caplog):
    from helpers import train_cli

    prefix = write_parallel(tmp_path / "data", [g for g, _ in PAIRS], [e for _, e in PAIRS])
    args = ("--max_steps", "1", "--train_file", prefix)
    first = train_cli(tmp_path / "out1", tmp_path / "cache", *args)
    (entry,) = (tmp_path / "cache" / "tokenizers").iterdir()
    (entry / "tokenizer.json").unlink()  # the entry without its tokenizer.json
    arrows = sorted((tmp_path / "hf_datasets").rglob("generator-train.arrow"))
    assert arrows
    for arrow in arrows:
        arrow.write_bytes(arrow.read_bytes()[:-8])
    with caplog.at_level(logging.WARNING):
        second = train_cli(tmp_path / "out2", tmp_path / "cache", *args)
    warned = " ".join(damage_warnings(caplog))
    assert str(entry) in warned and all(str(arrow.parent) in warned for arrow in arrows)
    assert (tmp_path / "out1" / "tokenizer.json").read_bytes() == (tmp_path / "out2" / "tokenizer.json").read_bytes()
    assert second["train_pairs"] == first["train_pairs"] == 120
    assert second["weights_sha256"] == first["weights_sha256"], "the same data and BPE train the same weights"


def test_changed_text_inside_an_intact_arrow_file_is_read_as_it_is(tmp_path, caplog):
    # The limit docs/reliability.md states: no digest of the data, so a changed letter of a sentence is not found.
    load = local_split(tmp_path)
    _, expected, arrow = intact(load)
    whole = arrow.read_bytes()
    position = whole.index(PAIRS[0][0].encode()) + 1  # the second letter of the first German sentence
    arrow.write_bytes(whole[:position] + b"X" + whole[position + 1:])
    with caplog.at_level(logging.WARNING):
        again = load()
    assert not damage_warnings(caplog)
    assert again[0]["translation"]["de"] == PAIRS[0][0][0] + "X" + PAIRS[0][0][2:] != expected[0]["translation"]["de"]
    assert again.to_list()[1:] == expected[1:]


# evaluate's cached copy of the sacreBLEU module ----------------------------------------------------------------------

BLEU_COPY_DAMAGED = textwrap.dedent("""
    import importlib, json, logging, sys
    from pathlib import Path
    import evaluate
    from vaswani_hf.bleu.scores import SACREBLEU_LOCAL_PATH, load_bleu_metric
    warnings = []
    logging.getLogger("vaswani_hf").addHandler(type("H", (logging.Handler,), {"emit": lambda s, r: warnings.append(
        r.getMessage())})())
    load_bleu_metric()
    copies = Path(evaluate.config.HF_MODULES_CACHE) / "evaluate_modules" / "metrics" / "sacrebleu_local"
    (copy,) = copies.glob("*/sacrebleu_local.py")
    copy.write_bytes(copy.read_bytes()[:KEEP])  # cut short, as a crash while evaluate copied it would leave it
    for name in [n for n in sys.modules if n.startswith("evaluate_modules.metrics.")]:  # as in a new process
        del sys.modules[name]
    importlib.invalidate_caches()
    score = load_bleu_metric().compute(predictions=["a b c d"], references=[["a b c d"]])["score"]
    print(json.dumps({"score": score, "warnings": warnings, "copies": str(copies),
                      "whole": copy.read_bytes() == (SACREBLEU_LOCAL_PATH / "sacrebleu_local.py").read_bytes()}))
""")


@pytest.mark.parametrize("keep", [0, 300])
def test_a_damaged_copy_of_the_bleu_module_is_named_and_copied_again(tmp_path, keep):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("HF_")}, "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", BLEU_COPY_DAMAGED.replace("KEEP", str(keep))], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = json.loads(result.stdout.strip().splitlines()[-1])
    assert printed["score"] == pytest.approx(100.0) and printed["whole"]
    (warning,) = [w for w in printed["warnings"] if "is damaged" in w]
    assert printed["copies"] in warning
