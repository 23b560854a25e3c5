"""The synthetic corpus in the wmt14 format (`vaswani_training.synthetic`): what `datasets.load_dataset` and the
training command read from it, that every pair is 1-3 aligned Multi30k pairs of the right split, its lengths, that it
is deterministic, streamed in constant memory and written atomically, and its errors and command line."""

import json
import tracemalloc
from pathlib import Path

import pytest
from helpers import exits_with

from vaswani_hf.checks import CheckError
from vaswani_hf.data import multi30k_file, read_lines
from vaswani_training import synthetic
from vaswani_training.synthetic import write_synthetic_corpus


def records(path: Path) -> list[dict[str, str]]:
    return [json.loads(line)["translation"] for line in path.read_text(encoding="utf-8").splitlines()]


def aligned(split: str) -> dict[str, set[str]]:
    """Multi30k German sentence -> the English sentences aligned with it in `split`."""
    out: dict[str, set[str]] = {}
    for german, english in zip(read_lines(multi30k_file(split, "de")), read_lines(multi30k_file(split, "en"))):
        out.setdefault(german, set()).add(english)
    return out


def joined_pairs(german: str, english: str, table: dict[str, set[str]]) -> int | None:
    """The number (1-3) of aligned pairs of `table` whose German sentences joined by spaces give `german` and whose
    English ones, joined the same way, give `english`; None if there is no such split."""
    words_de, words_en = german.split(" "), english.split(" ")

    def splits(words: list[str], parts: int):
        if parts == 1:
            yield [" ".join(words)]
            return
        for cut in range(1, len(words)):
            for rest in splits(words[cut:], parts - 1):
                yield [" ".join(words[:cut]), *rest]

    for parts in (1, 2, 3):
        for pieces_de in splits(words_de, parts):
            if not all(piece in table for piece in pieces_de):
                continue
            for pieces_en in splits(words_en, parts):
                if all(en in table[de] for de, en in zip(pieces_de, pieces_en)):
                    return parts
    return None


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("synthetic")
    return write_synthetic_corpus(folder, 300, validation_pairs=40, test_pairs=50)


def test_load_dataset_reads_the_folder_as_the_three_splits_of_wmt14(corpus):
    import datasets

    loaded = datasets.load_dataset(str(corpus.folder))
    assert {split: len(loaded[split]) for split in loaded} == {"train": 300, "validation": 40, "test": 50}
    assert loaded["train"].column_names == ["translation"]
    first = loaded["test"][0]["translation"]
    assert set(first) == {"de", "en"} and first == records(corpus.folder / "test.jsonl")[0]
    assert sorted(p.name for p in corpus.folder.iterdir()) == ["test.jsonl", "train.jsonl", "validation.jsonl"]


def test_the_training_commands_read_it_as_a_dataset_name(corpus):
    from vaswani_training.lib.arguments import DataArguments
    from vaswani_training.lib.prepare import load_raw_datasets

    raw = load_raw_datasets(DataArguments(dataset_name=str(corpus.folder), source_lang="en", target_lang="de"))
    assert {split: len(raw[split]) for split in raw} == {"train": 300, "validation": 40, "test": 50}
    assert raw["validation"][3]["translation"] == records(corpus.folder / "validation.jsonl")[3]


@pytest.mark.parametrize("split, multi30k_split", [("train", "train"), ("validation", "validation"),
                                                    ("test", "test")])
def test_every_pair_joins_one_to_three_aligned_pairs_of_its_own_multi30k_split(corpus, split, multi30k_split):
    table = aligned(multi30k_split)
    counts = [joined_pairs(r["de"], r["en"], table) for r in records(corpus.folder / f"{split}.jsonl")]
    assert None not in counts, f"pair {counts.index(None)} of {split} is not joined aligned Multi30k pairs"
    if split == "train":
        assert {n: counts.count(n) for n in (1, 2, 3)} == pytest.approx({1: 100, 2: 100, 3: 100}, abs=35)
    if split == "test":  # no test sentence comes from the training data (test2016 shares none with train)
        train = aligned("train")
        assert not any(joined_pairs(r["de"], r["en"], train) for r in records(corpus.folder / "test.jsonl")[:20])


def test_sentences_average_about_23_words_as_wmt14_and_the_returned_means_are_the_files(corpus):
    train = records(corpus.folder / "train.jsonl")
    means = {lang: sum(len(r[lang].split()) for r in train) / len(train) for lang in ("de", "en")}
    assert corpus.mean_words["train"] == {lang: round(mean, 2) for lang, mean in means.items()}
    assert 20 < means["de"] < 26 and 21 < means["en"] < 27, means  # Multi30k alone: 11.1 and 11.9
    assert corpus.pairs == {"train": 300, "validation": 40, "test": 50}
    assert corpus.files["train"] == [corpus.folder / "train.jsonl"]


def test_deterministic_given_the_seed_and_each_split_independent_of_the_others(tmp_path, corpus):
    again = write_synthetic_corpus(tmp_path / "again", 300, validation_pairs=40, test_pairs=50)
    other_seed = write_synthetic_corpus(tmp_path / "seed1", 300, validation_pairs=40, test_pairs=50, seed=1)
    more = write_synthetic_corpus(tmp_path / "more", 500, validation_pairs=40, test_pairs=50)
    for split in ("train", "validation", "test"):
        name = f"{split}.jsonl"
        assert (again.folder / name).read_bytes() == (corpus.folder / name).read_bytes()
        assert (other_seed.folder / name).read_bytes() != (corpus.folder / name).read_bytes()
    assert (more.folder / "test.jsonl").read_bytes() == (corpus.folder / "test.jsonl").read_bytes()
    assert records(more.folder / "train.jsonl")[:300] == records(corpus.folder / "train.jsonl")


def test_text_format_holds_the_same_pairs_and_language_codes_follow_the_arguments(tmp_path, corpus):
    text = write_synthetic_corpus(tmp_path / "text", 300, validation_pairs=40, test_pairs=50, format="text")
    assert sorted(p.name for p in text.folder.iterdir()) == [
        "test.de", "test.en", "train.de", "train.en", "validation.de", "validation.en"]
    german = (text.folder / "train.de").read_text(encoding="utf-8").splitlines()
    english = (text.folder / "train.en").read_text(encoding="utf-8").splitlines()
    assert list(zip(german, english)) == [(r["de"], r["en"]) for r in records(corpus.folder / "train.jsonl")]

    swapped = write_synthetic_corpus(tmp_path / "en-de", 300, validation_pairs=40, test_pairs=50,
                                     source_lang="en", target_lang="de")
    assert records(swapped.folder / "train.jsonl") == records(corpus.folder / "train.jsonl")
    assert list(json.loads((swapped.folder / "train.jsonl").open().readline())["translation"]) == ["en", "de"]
    french = write_synthetic_corpus(tmp_path / "fr-en", 5, validation_pairs=1, test_pairs=1, source_lang="fr")
    first = records(french.folder / "train.jsonl")[0]
    assert (first["fr"], first["en"]) == (records(corpus.folder / "train.jsonl")[0]["de"],
                                          records(corpus.folder / "train.jsonl")[0]["en"])


def test_memory_does_not_grow_with_the_number_of_pairs(tmp_path):
    def peak(pairs: int) -> int:
        tracemalloc.start()
        try:
            write_synthetic_corpus(tmp_path / str(pairs), pairs, validation_pairs=1, test_pairs=1)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, large = peak(2_000), peak(60_000)
    size = (tmp_path / "60000" / "train.jsonl").stat().st_size
    assert size > 15_000_000  # holding the pairs would cost more than the file's size
    assert large < small + 2_000_000, (small, large)


def test_an_interrupted_write_leaves_the_previous_file_and_no_temporary_file(tmp_path, monkeypatch):
    corpus = write_synthetic_corpus(tmp_path, 20, validation_pairs=2, test_pairs=2)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    draws = synthetic._draws

    def failing(split, num_pairs, seed, size):
        for n, picks in enumerate(draws(split, num_pairs, seed, size)):
            if n == 10:
                raise OSError("disk full")
            yield picks

    monkeypatch.setattr(synthetic, "_draws", failing)
    with pytest.raises(OSError, match="disk full"):
        write_synthetic_corpus(tmp_path, 50, validation_pairs=2, test_pairs=2, seed=7)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    with pytest.raises(OSError, match="disk full"):
        write_synthetic_corpus(tmp_path, 50, validation_pairs=2, test_pairs=2, seed=7, format="text")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert corpus.pairs["train"] == 20


@pytest.mark.parametrize("kwargs, message", [
    ({"num_pairs": 0}, "num_pairs must be a whole number >= 1, got 0"),
    ({"test_pairs": 2.5}, "test_pairs must be a whole number >= 1, got 2.5"),
    ({"source_lang": "en"}, "two different language codes, got 'en' and 'en'"),
    ({"format": "csv"}, "format must be 'jsonl' or 'text', got 'csv'"),
])
def test_bad_arguments_are_refused_before_anything_is_written(tmp_path, kwargs, message):
    arguments = {"num_pairs": 3, **kwargs}
    with pytest.raises(CheckError, match=message):
        write_synthetic_corpus(tmp_path / "out", **arguments)
    assert not (tmp_path / "out").exists()


def test_command_line(tmp_path, capsys):
    assert synthetic.main([str(tmp_path / "c"), "--pairs", "30", "--validation_pairs", "3", "--test_pairs", "4",
                           "--source_lang", "en", "--target_lang", "de"]) == 0
    printed = capsys.readouterr().out
    assert "train: 30 pairs, mean words a sentence en " in printed and "test: 4 pairs" in printed
    assert len(records(tmp_path / "c" / "train.jsonl")) == 30
    exits_with(lambda: synthetic.main([str(tmp_path / "d"), "--pairs", "0"]),
               "error: num_pairs must be a whole number >= 1, got 0")
