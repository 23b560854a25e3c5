"""The length penalty and the checkpoints to average chosen on validation (§6.1; training/lib/choose.py,
vaswani_hf/decoding/search.py), and `generate()` under the paper's GNMT length penalty."""

from __future__ import annotations

import copy
import json

import pytest
import sacrebleu
import torch
from helpers import EOS, copy_sources, trained_copy_model, write_parallel
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, LogitsProcessorList

from vaswani_hf import VaswaniForConditionalGeneration
from vaswani_hf.decoding import (
    DEFAULT_ALPHAS,
    SourceLengthLimitLogitsProcessor,
    best_setting,
    length_penalty_search,
    max_output_lengths,
    paper_generate,
)


def copy_model_and_sources(batch: int = 12):
    """A tiny model trained briefly on the copy task (hypotheses of varied lengths that end in </s>) and sources."""
    return trained_copy_model(), *copy_sources(batch=batch)


def generate_with_limits(model, ids, mask, **kwargs) -> torch.Tensor:
    """`generate()` with the per-sentence limit of source length + 50 that `paper_generate` applies (§6.1)."""
    limits = max_output_lengths(mask, 1.0, 50)
    return model.generate(input_ids=ids, attention_mask=mask, num_beams=4, early_stopping=True,
                          max_new_tokens=int(limits.max()),
                          logits_processor=LogitsProcessorList([SourceLengthLimitLogitsProcessor(limits, EOS)]),
                          **kwargs)


def trimmed(rows: torch.Tensor) -> list[list[int]]:
    return [[t for t in row.tolist()[1:] if t != 0] for row in rows]


@pytest.fixture(scope="module")
def copy_setup():
    return copy_model_and_sources()


@pytest.mark.parametrize("alpha", [0.6, 1.5, 3.0])
def test_generate_gnmt_style_returns_the_paper_decodings_hypothesis(alpha, copy_setup):
    model, ids, mask = copy_setup
    paper = paper_generate(model, ids, mask, num_beams=4, alpha=alpha, length_penalty_style="gnmt")
    gnmt = generate_with_limits(model, ids, mask, length_penalty=alpha, length_penalty_style="gnmt")
    assert trimmed(gnmt) == trimmed(paper)
    hf = generate_with_limits(model, ids, mask, length_penalty=alpha)
    assert trimmed(hf) == trimmed(paper_generate(model, ids, mask, num_beams=4, alpha=alpha, length_penalty_style="hf"))


def test_the_two_styles_pick_differently_and_the_config_field_chooses(copy_setup):
    """The test above has power: at alpha 1.5 the forms disagree on most sentences; a generation config's field
    selects the form."""
    model, ids, mask = copy_setup
    hf = trimmed(generate_with_limits(model, ids, mask, length_penalty=1.5))
    gnmt = trimmed(generate_with_limits(model, ids, mask, length_penalty=1.5, length_penalty_style="gnmt"))
    assert sum(a != b for a, b in zip(hf, gnmt)) >= len(hf) // 2
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    try:
        model.generation_config.length_penalty = 1.5
        model.generation_config.length_penalty_style = "gnmt"
        assert trimmed(generate_with_limits(model, ids, mask)) == gnmt
        assert trimmed(generate_with_limits(model, ids, mask, length_penalty_style="hf")) == hf
    finally:
        model.generation_config = saved


def test_length_penalty_style_survives_save_and_load(tmp_path):
    model, ids, mask = copy_model_and_sources()
    model.generation_config.length_penalty_style = "gnmt"
    model.generation_config.length_penalty = 1.4
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["length_penalty_style"] == "gnmt" and saved["length_penalty"] == 1.4
    loaded = VaswaniForConditionalGeneration.from_pretrained(tmp_path)
    assert loaded.generation_config.length_penalty_style == "gnmt"
    assert trimmed(generate_with_limits(loaded, ids, mask)) == trimmed(
        generate_with_limits(model, ids, mask, length_penalty_style="gnmt"))


def test_generate_refuses_an_unknown_style_and_gnmt_without_early_stopping(copy_setup):
    model, ids, mask = copy_setup
    with pytest.raises(ValueError, match="length_penalty_style must be 'hf'.*got 'paper'"):
        model.generate(input_ids=ids, attention_mask=mask, length_penalty_style="paper", max_new_tokens=3)
    with pytest.raises(ValueError, match="length_penalty_style='gnmt' needs early_stopping=True"):
        model.generate(input_ids=ids, attention_mask=mask, length_penalty_style="gnmt", early_stopping=False,
                       max_new_tokens=3)


# The search: every (style, alpha) from one beam search -----------------------------------------------------------


class WordTokenizer:
    """Ids <-> space-separated words 'w<id>' (enough for `length_penalty_search`, which pads and decodes)."""

    pad_token_id = 0

    def __call__(self, texts):
        return {"input_ids": [[int(w[1:]) for w in text.split()] + [2] for text in texts]}

    def pad(self, encoded, return_tensors="pt"):
        rows = encoded["input_ids"]
        width = max(map(len, rows))
        ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
        return {"input_ids": ids, "attention_mask": ids.ne(0).long()}

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(f"w{t}" for t in row.tolist() if t > 3) for row in rows]


def test_each_searched_row_is_the_bleu_of_decoding_with_that_setting(copy_setup):
    (model, ids, mask), tokenizer = copy_setup, WordTokenizer()
    sources = [" ".join(f"w{t}" for t in row[m.bool()].tolist() if t > 3) for row, m in zip(ids, mask)]
    references = sources  # the copy task's references
    rows = length_penalty_search(model, tokenizer, sources, references, alphas=(0.0, 0.6, 2.0, 5.0),
                                 batch_size=3)
    assert [(r["length_penalty_style"], r["length_penalty"]) for r in rows] == [
        (s, a) for s in ("hf", "gnmt") for a in (0.0, 0.6, 2.0, 5.0)]
    encoded = tokenizer.pad(tokenizer(sources))
    ratios = set()
    for row in rows:
        out = paper_generate(model, encoded["input_ids"], encoded["attention_mask"], num_beams=4,
                             alpha=row["length_penalty"], length_penalty_style=row["length_penalty_style"])
        hyps = tokenizer.batch_decode(out)
        score = sacrebleu.corpus_bleu(hyps, [references])
        assert row["bleu"] == round(score.score, 2)
        assert row["length_ratio"] == round(score.sys_len / score.ref_len, 3)
        ratios.add(row["length_ratio"])
    assert len(ratios) > 1, "the alphas chose hypotheses of different lengths"
    assert best_setting(rows)["bleu"] == max(r["bleu"] for r in rows)


def test_search_refuses_bad_arguments(copy_setup):
    model, tokenizer = copy_setup[0], WordTokenizer()
    with pytest.raises(ValueError, match="as many references as sources"):
        length_penalty_search(model, tokenizer, ["w5"], [])
    with pytest.raises(ValueError, match="num_beams must be an integer >= 2"):
        length_penalty_search(model, tokenizer, ["w5"], ["w5"], num_beams=1)
    with pytest.raises(ValueError, match="alphas must be >= 0"):
        length_penalty_search(model, tokenizer, ["w5"], ["w5"], alphas=(-1.0,))
    with pytest.raises(ValueError, match="styles must be among"):
        length_penalty_search(model, tokenizer, ["w5"], ["w5"], styles=("fairseq",))
    with pytest.raises(ValueError, match="no rows"):
        best_setting([])


def test_best_setting_with_a_length_floor_takes_the_best_long_enough_setting():
    rows = [{"bleu": 41.0, "length_ratio": 0.984, "length_penalty": 1.2}, {"bleu": 40.8, "length_ratio": 1.0,
            "length_penalty": 2.0}, {"bleu": 40.9, "length_ratio": 0.999, "length_penalty": 1.8},
            {"bleu": 40.3, "length_ratio": 1.011, "length_penalty": 2.5}]
    assert best_setting(rows)["length_penalty"] == 1.2
    assert best_setting(rows, 1.0)["length_penalty"] == 2.0
    short = [dict(row, length_ratio=row["length_ratio"] - 0.1) for row in rows]
    assert best_setting(short, 1.0)["length_penalty"] == 1.2  # none reaches the floor: the best of all


def test_best_setting_keeps_the_first_of_equal_scores():
    rows = [{"bleu": 30.0, "length_penalty": 0.6, "length_ratio": 0.95}, {"bleu": 31.0, "length_penalty": 1.0,
            "length_ratio": 0.98}, {"bleu": 31.0, "length_penalty": 1.4, "length_ratio": 0.99}]
    assert best_setting(rows)["length_penalty"] == 1.0


def test_spread_over_cooldown_leaves_out_a_checkpoint_a_few_steps_from_a_newer_one(tmp_path):
    from vaswani_training.lib.choose import spread_over_cooldown

    steps = [2545, 2696, 2847, 2998, 3000, 3149]  # the planner's every 151 steps, and --save_steps 500's 3000
    folders = [tmp_path / f"checkpoint-{step}" for step in steps]
    kept = [int(f.name.split("-")[1]) for f in spread_over_cooldown(folders, 151)]
    assert kept == [2545, 2696, 2847, 3000, 3149]  # 2998 and 3000 hold nearly the same weights: one stays
    assert [int(f.name.split("-")[1]) for f in spread_over_cooldown(folders, 151)[-4:]] == [2696, 2847, 3000, 3149]
    assert spread_over_cooldown(folders, None) == folders and spread_over_cooldown(folders, 1) == folders
    assert spread_over_cooldown([], 151) == []


# The training run's end -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """Multi30k slices as parallel files: 300 training pairs, 16 validation, 4 test."""
    from vaswani_hf.data import load_multi30k

    root = tmp_path_factory.mktemp("data")
    splits = load_multi30k("de", "en")
    prefixes = {}
    for name, count in (("train", 300), ("validation", 16), ("test", 4)):
        records = splits[name]["translation"][:count]
        prefixes[name] = write_parallel(root, [r["de"] for r in records], [r["en"] for r in records], name=name)
    return root, prefixes


def budget_run(small_data, out, *extra) -> dict:
    """`vaswani-train` on the cpu preset's recipe at a tiny width, with a time budget (so with the planner's
    cooldown and its checkpoints), on the small files."""
    from vaswani_training.train import main

    root, files = small_data
    return main(["--preset", "cpu", "--config_overrides",
                 "d_model=16,encoder_layers=1,decoder_layers=1,num_heads=2,d_ff=32", "--vocab_size", "300",
                 "--train_file", files["train"], "--validation_file", files["validation"], "--test_file",
                 files["test"], "--max_steps", "24", "--time_budget_minutes", "20", "--warmup_steps", "4",
                 "--eval_strategy", "no", "--num_samples", "0", "--cpu_bf16", "no", "--disable_tqdm", "true",
                 "--report_to", "none", "--cache_dir", str(root / "cache"), "--output_dir", str(out),
                 "--logging_steps", "50", *map(str, extra)])


@pytest.fixture(scope="module")
def chosen_run(small_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("chosen")
    return out, budget_run(small_data, out)


def test_the_run_averages_the_cooldown_checkpoints_and_searches_the_penalty(chosen_run):
    out, metrics = chosen_run
    choice = metrics["chosen_on_validation"]
    cooldown_from = metrics["plan"]["planned_steps"] - metrics["plan"]["cooldown_steps"]
    kept = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    candidates = [step for step in kept if step > cooldown_from][-4:]  # the planner saved 4 or more over the cooldown
    assert len(candidates) == 4 and candidates[-1] == metrics["train_steps"]
    tried = choice["tried"]
    assert len(tried) == len(candidates) * 2 * len(DEFAULT_ALPHAS)
    assert {r["average_last"] for r in tried} == set(range(1, len(candidates) + 1))
    assert all(r["sentences"] == 16 and r["num_beams"] == 4 for r in tried)
    long_enough = [r for r in tried if r["length_ratio"] >= 1.0] or tried  # the floor of training/lib/choose.py
    best = max(long_enough, key=lambda r: r["bleu"])
    assert (choice["chosen"]["bleu"], choice["chosen"]["length_ratio"]) == (best["bleu"], best["length_ratio"])
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["length_penalty"], generation["length_penalty_style"], generation["num_beams"]) == (
        choice["chosen"]["length_penalty"], choice["chosen"]["length_penalty_style"], 4)
    # the search's own settings stay out of the folder's decoding (one output per sentence, plain sequences)
    assert generation.get("num_return_sequences", 1) == 1 and generation.get("max_new_tokens") is None
    assert not generation.get("output_scores") and not generation.get("return_dict_in_generate")
    assert (metrics["length_penalty"], metrics["length_penalty_style"]) == (
        generation["length_penalty"], generation["length_penalty_style"])  # the test set decoded once, as chosen
    assert metrics["averaged_checkpoints"] == choice["chosen"]["average_last"]
    assert isinstance(metrics["test_length_ratio"], float)  # hypothesis / reference tokens, printed beside the BLEU
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["chosen_on_validation"]["chosen"] == choice["chosen"]


def test_the_folder_holds_the_chosen_weights_and_decodes_to_the_recorded_score(chosen_run, small_data):
    from vaswani_hf.averaging import average_checkpoints

    out, metrics = chosen_run
    choice = metrics["chosen_on_validation"]
    n = choice["chosen"]["average_last"]
    assert len(choice["averaged_from"]) == n
    model = AutoModelForSeq2SeqLM.from_pretrained(out)
    expected = average_checkpoints([out / name for name in choice["averaged_from"]])
    state = model.state_dict()
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)
    if n > 1:
        assert json.loads((out / "averaged_from.json").read_text())["averaged_checkpoints"] == [
            str(out / name) for name in choice["averaged_from"]]
    from vaswani_hf.data import load_parallel_dataset

    _, files = small_data
    records = load_parallel_dataset(files["validation"], "de", "en")["translation"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    again = length_penalty_search(model, tokenizer, [r["de"] for r in records], [r["en"] for r in records],
                                  alphas=(model.generation_config.length_penalty,),
                                  styles=(model.generation_config.length_penalty_style,))
    assert again[0]["bleu"] == choice["chosen"]["bleu"]


def test_the_model_card_says_what_was_chosen_and_how_generate_decodes(chosen_run):
    from vaswani_training.lib.publishing import render_model_card

    out, metrics = chosen_run
    chosen = metrics["chosen_on_validation"]["chosen"]
    card = render_model_card(AutoModelForSeq2SeqLM.from_pretrained(out), metrics, repo_id="someone/model")
    assert f"were chosen on the validation set (16 sentences, BLEU {chosen['bleu']} there)" in card
    assert f"length penalty {chosen['length_penalty']}" in card or f"alpha\n{chosen['length_penalty']}" in card
    averaged = f"average of the last {chosen['average_last']} checkpoints" in card
    assert averaged == (chosen["average_last"] > 1)


def test_a_given_length_penalty_wins_and_a_given_average_is_kept(small_data, tmp_path):
    metrics = budget_run(small_data, tmp_path / "given", "--length_penalty", "0.9", "--length_penalty_style",
                         "gnmt")
    tried = metrics["chosen_on_validation"]["tried"]
    assert {(r["length_penalty_style"], r["length_penalty"]) for r in tried} == {("gnmt", 0.9)}
    assert len(tried) >= 2  # the averaging is still chosen
    generation = json.loads((tmp_path / "given" / "generation_config.json").read_text())
    assert (generation["length_penalty"], generation["length_penalty_style"]) == (0.9, "gnmt")

    metrics = budget_run(small_data, tmp_path / "fixed", "--length_penalty", "0.8", "--average_last", "0")
    assert "chosen_on_validation" not in metrics and metrics["averaged_checkpoints"] == 0
    generation = json.loads((tmp_path / "fixed" / "generation_config.json").read_text())
    assert (generation["length_penalty"], generation["length_penalty_style"]) == (0.8, "hf")
    assert metrics["length_penalty"] == 0.8
    assert not (tmp_path / "fixed" / "averaged_from.json").exists()


def test_a_save_steps_checkpoint_beside_a_cooldown_one_is_not_averaged_twice(small_data, tmp_path):
    # 80 planned steps: a cooldown of 16 with checkpoints every 4 (68, 72, 76, 80); --save_steps 79 adds step 79
    metrics = budget_run(small_data, tmp_path / "run", "--max_steps", "80", "--save_steps", "79")
    plan = metrics["plan"]
    assert (plan["planned_steps"], plan["cooldown_steps"]) == (80, 16)
    assert (tmp_path / "run" / "checkpoint-79").is_dir()  # kept on disk for resuming, left out of the average
    tried = metrics["chosen_on_validation"]["tried"]
    assert {r["average_last"] for r in tried} == {1, 2, 3, 4}
    assert metrics["chosen_on_validation"]["candidates"] == [f"checkpoint-{step}" for step in (68, 72, 76, 80)]
    averaged = metrics["chosen_on_validation"]["averaged_from"]
    n = metrics["chosen_on_validation"]["chosen"]["average_last"]
    assert averaged == ["checkpoint-68", "checkpoint-72", "checkpoint-76", "checkpoint-80"][4 - n:]


@pytest.mark.parametrize("flags, message", [
    (["--length_penalty", "-1"], "--length_penalty must be a number >= 0"),
    (["--length_penalty", "nan"], "--length_penalty must be a number >= 0"),
    (["--length_penalty_style", "paper"], "--length_penalty_style must be hf"),
    (["--average_last", "-2"], "--average_last must be >= 0"),
])
def test_bad_decoding_flags_are_refused_when_parsed(flags, message, tmp_path):
    from vaswani_hf.checks import CheckError
    from vaswani_training.train import main

    with pytest.raises(CheckError, match=message):
        main(["--preset", "tiny", "--output_dir", str(tmp_path / "x"), *flags])
    assert not (tmp_path / "x").exists()
