"""Tests for vaswani_hf.data: loading parallel data with clear errors, tokenization, token-budget batching; the same
errors through `vaswani-train`, naming the file and line, before its first step.

Uses only the shipped copy under vaswani_hf/corpora/multi30k and tmp files (no network, never ../shared).
"""

import gzip
import hashlib
import logging
import re
from collections import Counter

import numpy as np
import pytest
import torch
from helpers import ENGLISH, ROOT, train_cli, write, write_parallel
from hypothesis import given, settings
from hypothesis import strategies as st

from vaswani_hf.checks import CheckError
from vaswani_hf.data import (
    TokenBudgetBatchSampler,
    example_lengths,
    load_multi30k,
    load_parallel_dataset,
    multi30k_dir,
    multi30k_file,
    padding_fraction,
    read_lines,
    read_parallel_jsonl,
    read_parallel_text,
    split_lines,
    tokenize_dataset,
)

M30K = ROOT / "vaswani_hf" / "corpora" / "multi30k"


# ----------------------------------------------------------------------------------------------- shipped data


def test_shipped_data_matches_readme_sha256():
    readme = (M30K / "README.md").read_text(encoding="utf-8")
    entries = re.findall(r"^\s+([0-9a-f]{64})  (\S+)$", readme, flags=re.M)
    assert len(entries) == 12
    for digest, name in entries:
        data = gzip.decompress((M30K / f"{name}.gz").read_bytes())
        assert hashlib.sha256(data).hexdigest() == digest, name
    assert "W16-3210" in readme and "non-commercial" in readme


def test_multi30k_dir_is_shipped_copy():
    assert multi30k_dir() == M30K
    assert multi30k_file("test", "en", tokenized_lowercased=True) == M30K / "tok" / "test_2016_flickr.lc.norm.tok.en.gz"


def test_multi30k_dir_env_override_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("VASWANI_MULTI30K_DIR", str(tmp_path / "nope"))
    with pytest.raises(CheckError, match="VASWANI_MULTI30K_DIR"):
        multi30k_dir()


def test_load_multi30k_default_de_en():
    dsd = load_multi30k()
    assert {k: len(v) for k, v in dsd.items()} == {"train": 29000, "validation": 1014, "test": 1000}
    ex = dsd["train"][0]["translation"]
    assert ex == {
        "de": "Zwei junge weiße Männer sind im Freien in der Nähe vieler Büsche.",
        "en": "Two young, White males are outside near many bushes.",
    }
    assert dsd["test"][999]["translation"]["en"] == read_lines(multi30k_file("test", "en"))[-1]


def test_load_multi30k_bad_language():
    with pytest.raises(CheckError, match="'de' and 'en'"):
        load_multi30k("fr", "en")


# ----------------------------------------------------------------------------------------------- text files


def test_parallel_text_plain_and_gz(tmp_path):
    write(tmp_path / "p.de", "a b\nc\n")
    write(tmp_path / "p.en.gz", "x y\nz", gz=True)  # no final newline: still 2 lines
    pt = read_parallel_text(tmp_path / "p", "de", "en")
    assert pt.source == ["a b", "c"] and pt.target == ["x y", "z"] and pt.skipped == 0
    ds = load_parallel_dataset(tmp_path / "p", "en", "de")  # reversed direction
    assert ds[1]["translation"] == {"en": "z", "de": "c"}


def test_mismatched_line_counts_names_both_files_and_counts(tmp_path):
    write(tmp_path / "p.de", "1\n2\n3\n")
    write(tmp_path / "p.en", "1\n2\n")
    with pytest.raises(CheckError) as e:
        read_parallel_text(tmp_path / "p", "de", "en")
    msg = str(e.value)
    assert str(tmp_path / "p.de") in msg and str(tmp_path / "p.en") in msg
    assert "3 lines" in msg and "2 lines" in msg


def test_unknown_language_lists_present_codes(tmp_path):
    write(tmp_path / "p.de", "a\n")
    write(tmp_path / "p.en.gz", "b\n", gz=True)
    with pytest.raises(CheckError, match=r"'fr'.*present for this prefix: de, en"):
        read_parallel_text(tmp_path / "p", "fr", "en")


def test_missing_prefix(tmp_path):
    with pytest.raises(CheckError, match="no file .* exists at all"):
        load_parallel_dataset(tmp_path / "nothing", "de", "en")


def test_empty_file(tmp_path):
    write(tmp_path / "p.de", "")
    write(tmp_path / "p.en", "a\n")
    with pytest.raises(CheckError, match=r"p\.de: file is empty"):
        read_parallel_text(tmp_path / "p", "de", "en")


def test_non_utf8_names_file_and_line(tmp_path):
    write(tmp_path / "p.de", b"eins\nzwei\n" + "drei Bäume\n".encode("latin-1"))
    write(tmp_path / "p.en", "one\ntwo\nthree\n")
    with pytest.raises(CheckError) as e:
        read_parallel_text(tmp_path / "p", "de", "en")
    assert f"{tmp_path / 'p.de'}:3:" in str(e.value) and "UTF-8" in str(e.value)


def test_bad_gzip(tmp_path):
    write(tmp_path / "p.de.gz", "not gzip\n")
    with pytest.raises(CheckError, match="cannot read"):
        read_lines(tmp_path / "p.de.gz")


def test_plain_and_gz_both_present_is_ambiguous(tmp_path):
    write(tmp_path / "p.de", "a\n")
    write(tmp_path / "p.de.gz", "a\n", gz=True)
    write(tmp_path / "p.en", "b\n")
    with pytest.raises(CheckError, match="remove one"):
        read_parallel_text(tmp_path / "p", "de", "en")


def test_empty_lines_skip_counts_and_logs(tmp_path, caplog):
    write(tmp_path / "p.de", "a\n\nc\nd\n  \n")
    write(tmp_path / "p.en", "A\nB\n\nD\nE\n")
    with caplog.at_level(logging.WARNING, logger="vaswani_hf.data"):
        pt = read_parallel_text(tmp_path / "p", "de", "en", empty_lines="skip")
    assert pt.source == ["a", "d"] and pt.target == ["A", "D"] and pt.skipped == 3
    assert "skipped 3 of 5" in caplog.text


def test_empty_lines_error_names_file_and_line(tmp_path):
    write(tmp_path / "p.de", "a\nb\nc\n")
    write(tmp_path / "p.en", "A\nB\n\n")
    with pytest.raises(CheckError, match=re.escape(f"{tmp_path / 'p.en'}:3: empty sentence")):
        read_parallel_text(tmp_path / "p", "de", "en", empty_lines="error")
    with pytest.raises(CheckError, match="empty_lines="):
        read_parallel_text(tmp_path / "p", "de", "en", empty_lines="drop")


def test_unicode_line_separator_does_not_split(tmp_path):
    write(tmp_path / "p.de", "a\u2028b\nc\r\n")
    write(tmp_path / "p.en", "x\ny\n")
    pt = read_parallel_text(tmp_path / "p", "de", "en")
    assert pt.source == ["a\u2028b", "c"]


def test_cr_only_line_ends_are_lines(tmp_path):
    """Files saved with old Mac line ends (a lone \\r) hold one sentence a line, as Python's text mode reads them."""
    write(tmp_path / "p.de", "Ein Hund.\rZwei Katzen.\rDrei Vögel.\r")
    write(tmp_path / "p.en", "A dog.\r\nTwo cats.\nThree birds.")
    pt = read_parallel_text(tmp_path / "p", "de", "en")
    assert pt.source == ["Ein Hund.", "Zwei Katzen.", "Drei Vögel."]
    assert pt.target == ["A dog.", "Two cats.", "Three birds."]
    assert split_lines("a\r\rb\r\nc\nU+2028 \u2028 stays\n".encode()) == [b"a", b"", b"b", b"c",
                                                                      "U+2028 \u2028 stays".encode()]


# ----------------------------------------------------------------------------------------------- JSON lines


def test_jsonl_and_mixed_splits(tmp_path):
    write(tmp_path / "t.jsonl",
          '{"translation": {"de": "a", "en": "A", "fr": "x"}}\n\n{"translation": {"de": "b", "en": "B"}}\n')
    write(tmp_path / "v.de", "c\n")
    write(tmp_path / "v.en", "C\n")
    dsd = load_parallel_dataset({"train": tmp_path / "t.jsonl", "validation": tmp_path / "v"}, "de", "en")
    assert [r["translation"] for r in dsd["train"]] == [{"de": "a", "en": "A"}, {"de": "b", "en": "B"}]
    assert dsd["validation"][0]["translation"] == {"de": "c", "en": "C"}


def test_jsonl_errors(tmp_path):
    p = write(tmp_path / "t.jsonl.gz",
              '{"translation": {"de": "a", "en": "A"}}\n{"translation": {"de": "b", "cs": "B"}}\n', gz=True)
    with pytest.raises(CheckError, match=r"t\.jsonl\.gz:2: language 'en' .* codes present: cs, de"):
        read_parallel_jsonl(p, "de", "en")
    p = write(tmp_path / "bad.jsonl", '{"translation": {"de": "a", "en": "A"}}\n{"translation": \n')
    with pytest.raises(CheckError, match=r"bad\.jsonl:2: invalid JSON"):
        read_parallel_jsonl(p, "de", "en")
    p = write(tmp_path / "nt.jsonl", '{"de": "a", "en": "A"}\n')
    with pytest.raises(CheckError, match=r"nt\.jsonl:1: expected an object with a 'translation'"):
        read_parallel_jsonl(p, "de", "en")
    p = write(tmp_path / "e.jsonl",
              '{"translation": {"de": "a", "en": "A"}}\n\n{"translation": {"de": "", "en": "B"}}\n')
    with pytest.raises(CheckError, match=r"e\.jsonl:3 \(translation\['de'\]\): empty sentence"):
        read_parallel_jsonl(p, "de", "en", empty_lines="error")
    assert read_parallel_jsonl(p, "de", "en").skipped == 1


def test_sources_xor_hub():
    with pytest.raises(CheckError, match="exactly one"):
        load_parallel_dataset(None)


# ----------------------------------------------------------------------------------------------- tokenization


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for w in "a b c d e f A B C D".split():
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_tokenize_dataset_and_lengths(tmp_path, tiny_tokenizer):
    write(tmp_path / "p.de", "a b c\nd e f a b c d\nq\n")
    write(tmp_path / "p.en", "A B\nC\nD D D D D D D D\n")
    dsd = load_parallel_dataset({"train": tmp_path / "p"}, "de", "en")
    tok = tokenize_dataset(dsd, tiny_tokenizer, "de", "en", max_length=5)
    tr = tok["train"]
    assert tr.column_names == ["input_ids", "attention_mask", "labels"]
    assert tr[0]["input_ids"] == [4, 5, 6, 2] and tr[0]["labels"] == [10, 11, 2]
    assert tr[2]["input_ids"] == [3, 2]  # unknown word -> <unk>
    assert len(tr[1]["input_ids"]) == 5 and len(tr[2]["labels"]) == 5  # truncated to max_length
    src, tgt = example_lengths(tr)
    assert src.tolist() == [4, 5, 2] and tgt.tolist() == [3, 2, 5]
    tok2 = tokenize_dataset(dsd["train"], tiny_tokenizer, "de", "en", max_length=None, keep_translation=True)
    assert len(tok2[1]["input_ids"]) == 8 and "translation" in tok2.column_names
    with pytest.raises(CheckError, match="codes present: de, en"):
        tokenize_dataset(dsd, tiny_tokenizer, "de", "fr")
    with pytest.raises(CheckError, match="tokenize first"):
        example_lengths(dsd["train"])


# ----------------------------------------------------------------------------------------------- sampler


@pytest.fixture(scope="module")
def m30k_lengths():
    """Approximate subword lengths of Multi30k train: whitespace words x 1.3, + 1 for </s>."""
    de = read_lines(multi30k_file("train", "de"))
    en = read_lines(multi30k_file("train", "en"))
    src = np.array([round(len(s.split()) * 1.3) + 1 for s in de])
    tgt = np.array([round(len(s.split()) * 1.3) + 1 for s in en])
    return src, tgt


def test_sampler_full_multi30k_covers_once_low_padding(m30k_lengths):
    src, tgt = m30k_lengths
    s = TokenBudgetBatchSampler(src, tgt, max_tokens=4096, seed=3)
    batches = list(s)
    assert len(batches) == len(s)
    flat = [i for b in batches for i in b]
    assert len(flat) == 29000 and sorted(flat) == list(range(29000))
    budget = [max(max(src[i], tgt[i]) for i in b) * len(b) for b in batches]
    assert max(budget) <= 4096
    assert np.mean(budget) > 0.9 * 4096  # batches are actually full
    pf = padding_fraction(batches, src, tgt)
    assert 0 < pf < 0.10


def test_sampler_deterministic_and_epoch_dependent(m30k_lengths):
    src, tgt = m30k_lengths
    a = TokenBudgetBatchSampler(src, tgt, max_tokens=2048, seed=7)
    b = TokenBudgetBatchSampler(src, tgt, max_tokens=2048, seed=7)
    e0 = list(a)
    assert e0 == list(b) == list(a)  # same seed+epoch -> same batches, and iterating twice is stable
    a.set_epoch(1)
    e1 = list(a)
    assert e1 != e0 and len(e1) == len(e0)
    assert sorted(i for x in e1 for i in x) == list(range(29000))
    # contents change too (tie-break), not just the order of batches
    assert {tuple(sorted(x)) for x in e1} != {tuple(sorted(x)) for x in e0}
    c = TokenBudgetBatchSampler(src, tgt, max_tokens=2048, seed=8)
    assert list(c) != e0


def test_sampler_no_shuffle_is_length_sorted(m30k_lengths):
    src, tgt = m30k_lengths
    s = TokenBudgetBatchSampler(src, tgt, max_tokens=1024, shuffle=False)
    batches = list(s)
    firsts = [src[b[0]] for b in batches]
    assert firsts == sorted(firsts)
    s.set_epoch(5)
    assert list(s) == batches


@pytest.mark.parametrize("replicas", [2, 3])
def test_sampler_distributed_split_covers_all(m30k_lengths, replicas):
    src, tgt = m30k_lengths
    samplers = [TokenBudgetBatchSampler(src, tgt, 4096, seed=1, num_replicas=replicas, rank=r) for r in range(replicas)]
    for s in samplers:
        s.set_epoch(2)
    per_rank = [list(s) for s in samplers]
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) == len(samplers[0])
    counts = Counter(i for p in per_rank for b in p for i in b)
    assert set(counts) == set(range(29000)) and set(counts.values()) == {1}  # each example once, on one rank
    assert replicas * len(samplers[0]) == len(samplers[0].global_batches(2))  # batches split, none repeated
    single = TokenBudgetBatchSampler(src, tgt, 4096, seed=1)
    assert len(samplers[0].global_batches(2)) - len(single.global_batches(2)) < replicas  # fewer than R splits


def test_sampler_splits_the_largest_batches_for_equal_counts():
    # budget 8, all lengths 2: batches of 4, 4, 2 -> 3 batches; 2 ranks need 4: the first batch of 4 is halved
    s = TokenBudgetBatchSampler([2] * 10, None, max_tokens=8, shuffle=False, num_replicas=2, rank=0)
    assert s.global_batches() == [[0, 1], [2, 3], [4, 5, 6, 7], [8, 9]]
    assert list(s) == [[0, 1], [4, 5, 6, 7]] and len(s) == 2
    # for accelerate's own sharding: one process' sampler, batch count a multiple of the processes
    assert len(TokenBudgetBatchSampler([2] * 10, None, max_tokens=8, num_batches_multiple=4)) == 4
    # one example cannot be split: the batches of 1 are repeated for the other ranks, as before
    one = [list(TokenBudgetBatchSampler([3], None, max_tokens=8, num_replicas=3, rank=r)) for r in range(3)]
    assert one == [[[0]], [[0]], [[0]]]
    with pytest.raises(CheckError, match="num_batches_multiple"):
        TokenBudgetBatchSampler([1], num_batches_multiple=0)


def test_sampler_oversize_error_and_skip():
    src = [3, 10, 4, 2]
    tgt = [3, 2, 12, 2]
    with pytest.raises(CheckError) as e:
        TokenBudgetBatchSampler(src, tgt, max_tokens=8)
    assert "2 example(s) longer than max_tokens=8" in str(e.value) and "#2 (12 tokens)" in str(e.value)
    assert "at least 12" in str(e.value)
    s = TokenBudgetBatchSampler(src, tgt, max_tokens=8, skip_oversize=True)
    assert s.num_skipped == 2 and sorted(i for b in s for i in b) == [0, 3]


def test_sampler_max_sentences_and_validation():
    s = TokenBudgetBatchSampler([1] * 10, None, max_tokens=100, max_sentences=3, shuffle=False)
    assert [len(b) for b in s] == [3, 3, 3, 1]
    with pytest.raises(CheckError, match="10 entries but tgt_lengths has 9"):
        TokenBudgetBatchSampler([1] * 10, [1] * 9)
    with pytest.raises(CheckError, match="max_tokens must be a positive int"):
        TokenBudgetBatchSampler([1], max_tokens=0)
    with pytest.raises(CheckError, match="rank must be in"):
        TokenBudgetBatchSampler([1], num_replicas=2, rank=2)
    with pytest.raises(CheckError, match=r"src_lengths\[1\] = -1"):
        TokenBudgetBatchSampler([1, -1])


def test_sampler_with_dataloader(tiny_tokenizer, tmp_path):
    from torch.utils.data import DataLoader
    from transformers import DataCollatorForSeq2Seq

    write(tmp_path / "p.de", "a b c\nd e\na\nb c d e f\n")
    write(tmp_path / "p.en", "A\nB C\nD\nA B C D\n")
    tok = tokenize_dataset(load_parallel_dataset(tmp_path / "p"), tiny_tokenizer, "de", "en")
    src, tgt = example_lengths(tok)
    sampler = TokenBudgetBatchSampler(src, tgt, max_tokens=8, seed=0)
    dl = DataLoader(tok, batch_sampler=sampler, collate_fn=DataCollatorForSeq2Seq(tiny_tokenizer))
    seen = 0
    for batch in dl:
        assert batch["input_ids"].numel() <= 8 and batch["labels"].shape[0] == batch["input_ids"].shape[0]
        seen += batch["input_ids"].shape[0]
    assert seen == 4


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 30)), min_size=1, max_size=200),
    max_tokens=st.integers(30, 300),
    replicas=st.integers(1, 4),
    seed=st.integers(0, 2**31),
)
def test_sampler_property(lengths, max_tokens, replicas, seed):
    src = [a for a, _ in lengths]
    tgt = [b for _, b in lengths]
    seen = Counter()
    for r in range(replicas):
        s = TokenBudgetBatchSampler(src, tgt, max_tokens, seed=seed, num_replicas=replicas, rank=r)
        batches = list(s)
        assert len(batches) == len(s)
        for b in batches:
            assert b and max(max(src[i], tgt[i], 1) for i in b) * len(b) <= max_tokens
            seen.update(b)
    assert set(seen) == set(range(len(lengths)))
    if replicas == 1:
        assert all(c == 1 for c in seen.values())


def test_padding_fraction_by_hand():
    # batch [0,1]: src 2,4 -> slots 8, real 6; tgt 1,3 -> slots 6, real 4. batch [2]: src 5 / tgt 5, no pad.
    assert padding_fraction([[0, 1], [2]], [2, 4, 5], [1, 3, 5]) == pytest.approx(1 - 20 / 24)
    assert padding_fraction([[0, 1], [2]], [2, 4, 5]) == pytest.approx(1 - 11 / 13)


def test_hub_path_with_packaged_json_builder(tmp_path):
    """The `hub_dataset` branch, exercised offline through datasets' packaged "json" builder."""
    p = write(tmp_path / "d.jsonl",
              '{"translation": {"de": "a", "en": "A"}}\n{"translation": {"de": " ", "en": "B"}}\n')
    dsd = load_parallel_dataset(hub_dataset="json", hub_kwargs={"data_files": {"train": str(p)},
                                                                "cache_dir": str(tmp_path / "cache")})
    assert len(dsd["train"]) == 1 and dsd["train"][0]["translation"] == {"de": "a", "en": "A"}
    with pytest.raises(CheckError, match=r"split 'train' row 1 \(de\): empty sentence"):
        load_parallel_dataset(hub_dataset="json", empty_lines="error",
                              hub_kwargs={"data_files": {"train": str(p)}, "cache_dir": str(tmp_path / "cache")})
    with pytest.raises(CheckError, match="codes present: de, en"):
        load_parallel_dataset(hub_dataset="json", source_lang="fr",
                              hub_kwargs={"data_files": {"train": str(p)}, "cache_dir": str(tmp_path / "cache")})


# Parallel data through the train command ------------------------------------------------------------------------------


def train_on(tmp_path, *args):
    """One step of `vaswani-train` (`helpers.train_cli`) in `tmp_path`: the checks that refuse its input come first."""
    return train_cli(tmp_path / "out", tmp_path / "cache", "--max_steps", "1", *args)


def test_train_cli_mismatched_line_counts_names_both_files(tmp_path):
    prefix = write_parallel(tmp_path / "data", english=ENGLISH[:-1])
    with pytest.raises(CheckError) as error:
        train_on(tmp_path, "--train_file", prefix)
    message = str(error.value)
    assert f"{prefix}.de has 20 lines but {prefix}.en has 19 lines" in message
    assert "aligned line by line" in message


def test_train_cli_missing_and_empty_files(tmp_path):
    with pytest.raises(CheckError, match=r"no file for language 'de' at prefix .*nothing.* Check the prefix"):
        train_on(tmp_path, "--train_file", str(tmp_path / "nothing"))
    prefix = write_parallel(tmp_path / "data")
    write(tmp_path / "data" / "p.en", "")
    with pytest.raises(CheckError, match=re.escape(f"{prefix}.en: file is empty (0 lines)")):
        train_on(tmp_path, "--train_file", prefix)
    with pytest.raises(CheckError, match="without --train_file"):
        train_on(tmp_path, "--test_file", prefix)


def test_train_cli_non_utf8_names_file_and_line(tmp_path):
    prefix = write_parallel(tmp_path / "data")
    lines = (tmp_path / "data" / "p.de").read_bytes().split(b"\n")
    lines[6] = "Ein älterer Mann".encode("latin-1")
    write(tmp_path / "data" / "p.de", b"\n".join(lines))
    with pytest.raises(CheckError, match=re.escape(f"{prefix}.de:7: not valid UTF-8 (byte b'\\xe4'") + ".*iconv"):
        train_on(tmp_path, "--train_file", prefix)


def test_train_cli_empty_lines_error_names_the_line_and_a_bad_policy_is_refused(tmp_path):
    english = list(ENGLISH)
    english[4] = "   "
    prefix = write_parallel(tmp_path / "data", english=english)
    with pytest.raises(CheckError, match=re.escape(f"{prefix}.en:5: empty sentence") + ".*empty_lines='skip'"):
        train_on(tmp_path, "--train_file", prefix, "--empty_lines", "error")
    with pytest.raises(CheckError, match=r"empty_lines='drop' is not one of \('skip', 'error', 'keep'\)"):
        train_on(tmp_path, "--train_file", prefix, "--empty_lines", "drop")


def test_train_cli_unknown_language_codes(tmp_path):
    with pytest.raises(CheckError, match="Multi30k task 1 has languages 'de' and 'en', not 'fr'"):
        train_on(tmp_path, "--source_lang", "fr")
    prefix = write_parallel(tmp_path / "data")
    with pytest.raises(CheckError, match=r"no file for language 'cs' .*Languages present for this prefix: de, en"):
        train_on(tmp_path, "--train_file", prefix, "--target_lang", "cs")
    with pytest.raises(CheckError, match="source_lang and target_lang are both 'de'"):
        train_on(tmp_path, "--train_file", prefix, "--target_lang", "de")


def test_train_cli_zero_samples_is_refused_not_read_as_all(tmp_path):
    prefix = write_parallel(tmp_path / "data")
    for flag in ("--max_train_samples", "--max_test_samples", "--max_tokens", "--max_source_length"):
        with pytest.raises(CheckError, match=f"{flag} must be >= 1 \\(leave the flag out for the default\\), got 0"):
            train_on(tmp_path, "--train_file", prefix, "--test_file", prefix, flag, "0")
    from vaswani_training.lib.prepare import select

    with pytest.raises(CheckError, match=r"take a number of examples >= 1 .*got 0"):  # the library function too
        select(list(range(3)), 0)


# ----------------------------------------------------------------------------------------------- data at scale


def test_two_ranks_get_disjoint_batches_covering_the_corpus_and_resume_sees_the_rest(m30k_lengths):
    """What DDP needs at an epoch's end (equal batch counts, so no rank waits for a collective the other never joins),
    and what a resumed run needs (the same remaining batches as an uninterrupted one), through accelerate's own
    sharding of our sampler as both training loops use it."""
    from accelerate.data_loader import prepare_data_loader, skip_first_batches
    from torch.utils.data import DataLoader

    src, tgt = m30k_lengths
    per_rank = []
    for rank in range(2):
        sampler = TokenBudgetBatchSampler(src, tgt, 4096, seed=3, num_batches_multiple=2)
        loader = DataLoader(np.arange(len(src)), batch_sampler=sampler)
        loader = prepare_data_loader(loader, num_processes=2, process_index=rank, put_on_device=False)
        loader.set_epoch(1)
        sampler.set_epoch(1)
        per_rank.append([batch.tolist() for batch in loader])
        # resumed after 7 batches of this epoch: exactly the batches an uninterrupted run has left
        resumed = skip_first_batches(loader, 7)
        resumed.set_epoch(1)
        assert [batch.tolist() for batch in resumed] == per_rank[-1][7:]
    assert len(per_rank[0]) == len(per_rank[1]) > 10
    seen = Counter(i for batches in per_rank for batch in batches for i in batch)
    assert set(seen) == set(range(len(src))) and set(seen.values()) == {1}


def test_streaming_batches_cover_the_stream_once_with_equal_counts_per_rank(tmp_path, tiny_tokenizer):
    from vaswani_hf.data import StreamingTokenBudgetBatches, stream_parallel_pairs

    rng = np.random.default_rng(0)
    words = "a b c d e f".split()
    german = [" ".join(rng.choice(words, rng.integers(1, 12))) for _ in range(500)]
    english = [" ".join(rng.choice(["A", "B", "C", "D"], rng.integers(1, 12))) for _ in range(500)]
    german[7] = " ".join(["a"] * 40)  # over --max_source_length 20: left out and counted
    write(tmp_path / "p.de", "\n".join(german) + "\n")
    write(tmp_path / "p.en", "\n".join(english) + "\n")
    pairs = stream_parallel_pairs(tmp_path / "p", "de", "en")
    ranks = [StreamingTokenBudgetBatches(pairs, tiny_tokenizer, max_tokens=64, max_source_length=20, pool_pairs=120,
                                         seed=1, num_replicas=2, rank=r) for r in range(2)]
    batches = [list(stream) for stream in ranks]
    assert len(batches[0]) == len(batches[1])  # each of the 5 pools dealt evenly
    seen = Counter((" ".join(map(str, f["input_ids"])), " ".join(map(str, f["labels"])))
                   for rank in batches for batch in rank for f in batch)
    assert sum(seen.values()) == 499 and ranks[0].num_dropped == 1
    for rank in batches:
        for batch in rank:
            assert max(max(len(f["input_ids"]), len(f["labels"])) for f in batch) * len(batch) <= 64
    expected = tiny_tokenizer(german[:7] + german[8:])["input_ids"]
    assert sorted(" ".join(map(str, ids)) for ids in expected) == sorted(k[0] for k in seen.elements())
    ranks[0].set_epoch(1)
    assert list(ranks[0]) != batches[0]  # a new order each epoch
    with pytest.raises(CheckError, match="callable"):
        StreamingTokenBudgetBatches(german, tiny_tokenizer, max_tokens=64)


def test_local_files_are_read_once_then_from_the_cache_keyed_by_content(tmp_path):
    write(tmp_path / "p.de", "a b\nc\n")
    write(tmp_path / "p.en", "A B\nC\n")
    first = load_parallel_dataset(tmp_path / "p", "de", "en")
    again = load_parallel_dataset(tmp_path / "p", "de", "en")
    assert again.cache_files == first.cache_files and again._fingerprint == first._fingerprint
    write(tmp_path / "p.en", "A B\nD\n")  # same size, new content: read again
    changed = load_parallel_dataset(tmp_path / "p", "de", "en")
    assert changed.cache_files != first.cache_files and changed[1]["translation"]["en"] == "D"


@pytest.mark.parametrize("max_length", [None, 12, 3, 1])
def test_the_fast_encoder_gives_the_tokenizers_own_ids(max_length):
    from helpers import multi30k_tokenizer

    from vaswani_hf.data import Encoder

    tokenizer = multi30k_tokenizer()
    texts = read_lines(multi30k_file("validation", "de"))[:300] + [
        "a <s> b </s> <pad> <unk> c", "", "  x  ", "ünïcødé 😀 ▁", "Straßen-Café am Rhein-Ufer"]
    expected = tokenizer(texts, truncation=max_length is not None, max_length=max_length)["input_ids"]
    before = tokenizer.backend_tokenizer.truncation
    encoder = Encoder(tokenizer, max_length + 1 if max_length else 7)
    assert tokenizer.backend_tokenizer.truncation == before  # the tokenizer itself is left as it was
    encoder = Encoder(tokenizer, max_length)
    assert encoder.backend is not None and encoder(texts) == expected
    target = Encoder(tokenizer, max_length, target=True)
    assert target(texts) == tokenizer(text_target=texts, truncation=max_length is not None,
                                      max_length=max_length)["input_ids"]


def test_padded_batches_are_the_collators_tensors(tmp_path):
    from helpers import multi30k_tokenizer
    from torch.utils.data import DataLoader
    from transformers import DataCollatorForSeq2Seq

    from vaswani_hf.data import PaddedBatches

    tokenizer = multi30k_tokenizer()
    tokenized = tokenize_dataset(load_multi30k(splits=("validation",))["validation"], tokenizer, "de", "en")
    sampler = TokenBudgetBatchSampler(*example_lengths(tokenized), max_tokens=600, seed=2)
    batches = PaddedBatches(tokenized, tokenizer.pad_token_id)
    ours = list(DataLoader(batches, batch_sampler=sampler, collate_fn=batches.collate))
    theirs = list(DataLoader(tokenized, batch_sampler=sampler,
                             collate_fn=DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)))
    assert len(ours) == len(theirs) > 20
    for mine, expected in zip(ours, theirs):
        assert mine.keys() == expected.keys()
        for key in mine:
            assert mine[key].dtype == expected[key].dtype and torch.equal(mine[key], expected[key]), key
    assert (ours[0]["labels"] == -100).any() or (ours[1]["labels"] == -100).any()  # padding happened
    assert torch.equal(batches.collate([batches[3], batches[5]])["input_ids"][1, :len(tokenized[5]["input_ids"])],
                       torch.tensor(tokenized[5]["input_ids"]))
    with pytest.raises(CheckError, match="tokenize first"):
        PaddedBatches(load_multi30k(splits=("validation",))["validation"], 0)
