"""Model inputs at the entry points (forward, generate(), translate_sentences, the pipeline), flags that cannot apply,
and BLEU scores that cannot be right: malformed inputs drawn at random end in a ValueError naming the argument, or give
what the well-formed equivalent gives; never a torch error deep inside."""

import pytest
import torch
from helpers import ENGLISH, GERMAN, evaluate_cli, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vaswani_hf.bleu import bleu_tokenizer, compute_bleu, paper_bleu
from vaswani_hf.checks import CheckError
from vaswani_hf.decoding import translate_sentences

PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
MASK_DTYPES = [torch.long, torch.int32, torch.int8, torch.uint8, torch.bool, torch.float32, torch.float16]
ID_DTYPES = [torch.long, torch.int32, torch.int16, torch.bool, torch.float32]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def source(batch: int, length: int, seed: int = 0):
    """Well-formed ids `(batch, length)` ending in </s>, with right padding of up to length - 1 positions."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 99, (batch, length), generator=generator)
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    ids[torch.arange(batch), lengths - 1] = 2
    return ids.masked_fill(mask == 0, 0), mask


MUTATIONS = ["rows+", "rows-", "width+", "width-", "3-D", "1-D", "dtype", "value", "zero row"]


@st.composite
def masks(draw, batch: int, length: int):
    """A well-formed padding mask (batch, length) with up to two random mutations: a row or column more or less, another
    rank, another dtype, a value other than 0/1, a row of zeros."""
    mask = source(batch, length, seed=draw(st.integers(0, 9)))[1]
    for mutation in draw(st.lists(st.sampled_from(MUTATIONS), max_size=2)):
        if mutation == "rows+":
            mask = torch.cat([mask, mask[:1]])
        elif mutation == "rows-":
            mask = mask[1:]
        elif mutation == "width+":
            mask = torch.cat([mask, mask[..., :1]], dim=-1)
        elif mutation == "width-":
            mask = mask[..., 1:]
        elif mutation == "3-D":
            mask = mask[None] if mask.ndim == 1 else mask[:, None]
        elif mutation == "1-D":
            mask = mask.reshape(-1)
        elif mutation == "dtype":
            mask = mask.to(draw(st.sampled_from(MASK_DTYPES)))
        elif mask.numel():
            flat = mask.reshape(-1).clone()
            if mutation == "value":
                flat[draw(st.integers(0, flat.numel() - 1))] = draw(st.sampled_from([-1, 2, 7]))
            else:
                row = draw(st.integers(0, mask.shape[0] - 1))
                flat.view(mask.shape)[row] = 0
            mask = flat.view(mask.shape)
    return mask


def well_formed(mask: torch.Tensor, rows: int, width: int) -> bool:
    """What a padding mask must be, said independently of the checks: (rows, width), 0/1 integers or booleans,
    a 1 in every row."""
    return (mask.ndim == 2 and tuple(mask.shape) == (rows, width) and not mask.dtype.is_floating_point
            and bool(((mask == 0) | (mask == 1)).all()) and bool((mask != 0).any(dim=1).all()))


def refused_naming(call, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        call()


# forward and generate(): random masks, ids and labels ----------------------------------------------------------------


@PROPERTY
@given(batch=st.integers(1, 3), length=st.integers(2, 6), data=st.data())
def test_forward_with_a_random_attention_mask_gives_the_well_formed_result_or_names_it(model, batch, length, data):
    ids, _ = source(batch, length)
    mask = data.draw(masks(batch, length))
    labels = ids.clone()
    if well_formed(mask, batch, length):
        with torch.no_grad():
            got = model(input_ids=ids, attention_mask=mask, labels=labels)
            want = model(input_ids=ids, attention_mask=mask.long(), labels=labels)
        torch.testing.assert_close(got.logits, want.logits)
        assert torch.isfinite(got.loss)
    else:
        refused_naming(lambda: model(input_ids=ids, attention_mask=mask, labels=labels), "attention_mask")


@PROPERTY
@given(batch=st.integers(1, 3), length=st.integers(2, 5), data=st.data())
def test_forward_with_a_random_decoder_attention_mask_gives_the_well_formed_result_or_names_it(model, batch, length,
                                                                                                 data):
    ids, mask = source(batch, 4, seed=1)
    decoder_ids, _ = source(batch, length, seed=2)
    decoder_mask = data.draw(masks(batch, length))
    call = lambda m: model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids,  # noqa: E731
                           decoder_attention_mask=m)
    if well_formed(decoder_mask, batch, length):
        with torch.no_grad():
            torch.testing.assert_close(call(decoder_mask).logits, call(decoder_mask.long()).logits)
    else:
        refused_naming(lambda: call(decoder_mask), "decoder_attention_mask")


@PROPERTY
@given(shape=st.sampled_from([(2, 5), (1, 1), (3, 2), (0, 4), (2, 0), (5,), (2, 3, 1), ()]),
       dtype=st.sampled_from(ID_DTYPES), generating=st.booleans())
def test_random_input_ids_give_the_well_formed_result_or_are_refused_by_name(model, shape, dtype, generating):
    ids = torch.randint(4, 99, shape) if shape else torch.tensor(7)
    ids = ids.to(dtype)
    good = ids.ndim == 2 and 0 not in ids.shape and dtype in (torch.long, torch.int32)
    if generating:
        call = lambda i: model.generate(input_ids=i, num_beams=2, max_new_tokens=3)  # noqa: E731
    else:
        call = lambda i: model(input_ids=i, decoder_input_ids=torch.ones(  # noqa: E731
            i.shape[0] if i.ndim else 1, 2, dtype=torch.long)).logits
    if good:
        with torch.no_grad():
            torch.testing.assert_close(call(ids), call(ids.long()))
    else:
        refused_naming(lambda: call(ids), "input_ids")


@PROPERTY
@given(rows=st.integers(0, 4), width=st.integers(0, 6), dtype=st.sampled_from(ID_DTYPES),
       with_decoder_ids=st.booleans())
def test_random_labels_give_the_well_formed_loss_or_are_refused_by_name(model, rows, width, dtype, with_decoder_ids):
    ids, mask = source(2, 5)
    labels = torch.randint(4, 99, (rows, width)).to(dtype)
    decoder_ids = torch.ones(2, 4, dtype=torch.long) if with_decoder_ids else None
    expected_shape = (2, 4) if with_decoder_ids else (2, width)
    good = tuple(labels.shape) == expected_shape and width > 0 and dtype == torch.long  # what the loss takes
    call = lambda y: model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, labels=y)  # noqa: E731
    if good:
        with torch.no_grad():
            torch.testing.assert_close(call(labels).loss, call(labels.long()).loss)
    else:
        refused_naming(lambda: call(labels), "labels")


@PROPERTY
@given(batch=st.integers(1, 3), length=st.integers(2, 5), data=st.data())
def test_generate_with_a_random_attention_mask_gives_the_well_formed_output_or_names_it(model, batch, length, data):
    ids, _ = source(batch, length, seed=4)
    mask = data.draw(masks(batch, length))
    call = lambda m: model.generate(input_ids=ids, attention_mask=m, num_beams=2, max_new_tokens=4)  # noqa: E731
    if well_formed(mask, batch, length):
        assert torch.equal(call(mask), call(mask.long()))
    else:
        refused_naming(lambda: call(mask), "attention_mask")


def test_the_cases_of_the_report_are_refused_by_name(model):
    ids, mask = source(3, 6)
    cases = {
        "attention_mask row 0 is all 0": dict(input_ids=ids, attention_mask=torch.zeros_like(mask), labels=ids),
        "attention_mask has 5 positions but input_ids has 6":
            dict(input_ids=ids, attention_mask=mask[:, :5], labels=ids),
        "attention_mask has 2 rows but input_ids has 3": dict(input_ids=ids, attention_mask=mask[:2], labels=ids),
        "attention_mask holds 2": dict(input_ids=ids, attention_mask=mask * 2, labels=ids),
        "attention_mask must hold 1 .token. and 0 .padding. as integers or booleans, got torch.float32":
            dict(input_ids=ids, attention_mask=mask.float(), labels=ids),
        "decoder_attention_mask row 1 is all 0": dict(input_ids=ids, labels=ids, decoder_attention_mask=torch.tensor(
            [[1] * 6, [0] * 6, [1] * 6])),
        r"input_ids must be a \(batch, length\) tensor .* got shape \(3, 0\)": dict(input_ids=ids[:, :0], labels=ids),
        r"input_ids must be a \(batch, length\) tensor .* got shape \(6,\)":
            dict(input_ids=ids[0], decoder_input_ids=ids),
        "input_ids must hold integer token ids": dict(input_ids=ids.float(), labels=ids),
        "labels have 2 rows but input_ids has 3": dict(input_ids=ids, attention_mask=mask, labels=ids[:2]),
        r"labels have shape \(3, 4\) but decoder_input_ids has \(3, 6\)":
            dict(input_ids=ids, decoder_input_ids=ids, labels=ids[:, :4]),
    }
    for message, kwargs in cases.items():
        with pytest.raises(ValueError, match=message):
            model(**kwargs)


def test_a_decoder_mask_with_a_cache_covers_the_cached_positions(model):
    ids, mask = source(2, 5)
    start = torch.ones(2, 1, dtype=torch.long)
    with torch.no_grad():
        first = model(input_ids=ids, attention_mask=mask, decoder_input_ids=start, use_cache=True)
        cache = first.cache if hasattr(first, "cache") else first.past_key_values
        with pytest.raises(ValueError, match="decoder_attention_mask has 1 positions but decoder_input_ids has 2"):
            model(encoder_outputs=(first.encoder_last_hidden_state,), attention_mask=mask, decoder_input_ids=start,
                  decoder_attention_mask=torch.ones(2, 1, dtype=torch.long), cache=cache, use_cache=True)
        step = model(encoder_outputs=(first.encoder_last_hidden_state,), attention_mask=mask, decoder_input_ids=start,
                     decoder_attention_mask=torch.ones(2, 2, dtype=torch.long), cache=cache, use_cache=True)
    assert step.logits.shape == (2, 1, 99)


# Empty sentences: "" without a model call -----------------------------------------------------------------------------


class CountingGenerate:
    def __init__(self, model):
        self.model, self.rows = model, []

    def __call__(self, model, **kwargs):
        self.rows.append(kwargs["input_ids"].shape[0])
        return model.generate(**kwargs)


def test_translate_sentences_translates_empty_sentences_to_empty_ones_in_their_place(tiny_tokenizer):
    model = tiny_model(vocab_size=len(tiny_tokenizer))
    counting = CountingGenerate(model)
    sentences = ["", GERMAN[0], "   ", GERMAN[1], "\t"]
    got = translate_sentences(model, tiny_tokenizer, sentences, batch_size=8, num_beams=2, max_new_tokens=5,
                              generate_fn=counting)
    alone = [translate_sentences(model, tiny_tokenizer, [s], num_beams=2, max_new_tokens=5)[0] for s in GERMAN[:2]]
    assert got == ["", alone[0], "", alone[1], ""]
    assert counting.rows == [2]  # the two non-empty sentences only
    counting.rows.clear()
    assert translate_sentences(model, tiny_tokenizer, ["", " "], generate_fn=counting) == ["", ""]
    assert counting.rows == []


@pytest.fixture(scope="module")
def translator(tmp_path_factory, tiny_tokenizer):
    from helpers import save_model_folder
    from transformers import pipeline

    folder = save_model_folder(tmp_path_factory.mktemp("pipe") / "model", tiny_tokenizer)
    return pipeline("translation", model=str(folder), num_beams=2, max_new_tokens=5)


def test_the_pipeline_translates_empty_strings_to_empty_ones_without_the_model(translator, monkeypatch):
    rows = []
    generate = translator.model.generate

    def counted(**kwargs):
        rows.append(kwargs["input_ids"].shape[0])
        return generate(**kwargs)

    monkeypatch.setattr(translator.model, "generate", counted)
    assert translator("") == [{"translation_text": ""}]
    assert rows == []
    alone = [translator(s)[0]["translation_text"] for s in GERMAN[:2]]
    rows.clear()
    for batch_size in (1, 3):
        got = translator(["", GERMAN[0], " ", GERMAN[1]], batch_size=batch_size)
        assert [item["translation_text"] for item in got] == ["", alone[0], "", alone[1]]
    assert sum(rows) == 4  # two sentences, twice


# Flags that cannot apply --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -3])
def test_ct2_max_positions_below_one_is_refused_by_name(model_folder, tmp_path, value):
    pytest.importorskip("ctranslate2")
    from vaswani_training.convert_ct2 import main

    output = tmp_path / "ct2"
    with pytest.raises(SystemExit) as exit_info:
        main(["--model_dir", str(model_folder), "--output_dir", str(output), "--max_positions", str(value)])
    assert "--max_positions" in str(exit_info.value.code) and "positive integer" in str(exit_info.value.code)
    assert not output.exists()


def test_ct2_max_positions_is_refused_for_learned_positions(tmp_path, tiny_tokenizer):
    pytest.importorskip("ctranslate2")
    from helpers import save_model_folder

    from vaswani_hf.decoding import build_ct2_spec
    from vaswani_training.convert_ct2 import main

    folder = save_model_folder(tmp_path / "learned", tiny_tokenizer, position_embedding_type="learned")
    output = tmp_path / "ct2"
    with pytest.raises(SystemExit) as exit_info:
        main(["--model_dir", str(folder), "--output_dir", str(output), "--max_positions", "32"])
    assert "--max_positions" in str(exit_info.value.code) and "learned" in str(exit_info.value.code)
    assert not output.exists()
    sinusoidal = tiny_model()
    words = [f"w{i}" for i in range(99)]
    assert build_ct2_spec(sinusoidal, words, max_positions=32).encoder.position_encodings.encodings.shape[0] == 32


def test_evaluate_refuses_a_length_penalty_without_a_beam_search(model_folder, tmp_path):
    output = tmp_path / "scores.json"
    with pytest.raises(SystemExit) as exit_info:
        evaluate_cli("--model", model_folder, "--num_beams", "1", "--length_penalty", "0.6", "--output", output)
    assert "--length_penalty" in str(exit_info.value.code) and "--num_beams 1" in str(exit_info.value.code)
    assert not output.exists()


# BLEU that cannot be right --------------------------------------------------------------------------------------------

CHINESE = ["一个男人骑着自行车穿过城市。", "两只狗在雪地里玩耍。", "一个女人在公园里看书。"]


def test_the_validation_bleu_during_training_splits_chinese_as_the_test_score_does():
    from transformers import EvalPrediction

    from vaswani_hf.tokenization_vaswani import train_joint_bpe
    from vaswani_training.train import validation_bleu

    tokenizer = train_joint_bpe([CHINESE * 4, ["a man rides a bike ."] * 4], vocab_size=300, min_frequency=1)
    labels = tokenizer(text_target=CHINESE, padding=True)["input_ids"]
    labels = [[t if t != tokenizer.pad_token_id else -100 for t in row] for row in labels]
    identical = EvalPrediction(predictions=[[t for t in row if t != -100] for row in labels], label_ids=labels)
    assert validation_bleu(tokenizer, "zh")(identical)["bleu"] == pytest.approx(100)
    # 13a sees each unspaced sentence as one word: identical output scores 0, as the final score would refuse to
    assert validation_bleu(tokenizer, "en")(identical)["bleu"] < 1
    with pytest.raises(ValueError, match="Thai"):
        validation_bleu(tokenizer, "th")


def test_chinese_output_identical_to_its_references_scores_100_with_the_zh_tokenizer():
    scores = compute_bleu(CHINESE, CHINESE, target_lang="zh")
    assert scores["bleu"] == pytest.approx(100) and scores["paper_bleu"] == pytest.approx(100)
    assert "tok:zh" in scores["signature"] and scores["paper_signature"].startswith("tok:zh in place of moses-tok(zh)")
    assert paper_bleu(CHINESE, CHINESE, target_lang="zh-Hans")["bleu"] == pytest.approx(100)
    assert compute_bleu(CHINESE[:2], CHINESE[1:], target_lang="zh")["bleu"] < 50


@pytest.mark.parametrize("lang, name, advice", [("th", "Thai", "chrF"), ("my", "Burmese", "chrF"),
                                                 ("ja", "Japanese", "sacrebleu\\[ja\\]")])
def test_bleu_of_an_unsplittable_language_is_refused_by_name(lang, name, advice):
    if lang == "ja":
        try:
            import MeCab  # noqa: F401
        except ImportError:
            pass
        else:  # where MeCab is installed Japanese is scored, with ja-mecab, instead of refused
            assert bleu_tokenizer("ja") == "ja-mecab"
            assert compute_bleu(["猫が座った。"], ["猫が座った。"], target_lang="ja")["bleu"] == pytest.approx(100)
            return
    for call in (lambda: compute_bleu(CHINESE, CHINESE, target_lang=lang),
                 lambda: paper_bleu(CHINESE, CHINESE, target_lang=lang), lambda: bleu_tokenizer(lang)):
        with pytest.raises(ValueError, match=f"{name} \\({lang}\\).*{advice}"):
            call()
    with pytest.raises(CheckError, match=f"--target_lang {lang}"):
        from vaswani_training.lib.arguments import DataArguments

        DataArguments(source_lang="en", target_lang=lang)


def test_evaluate_refuses_a_target_language_without_bleu_before_translating(model_folder, tmp_path):
    test = tmp_path / "test"
    test.with_suffix(".en").write_text("\n".join(ENGLISH[:2]) + "\n")
    test.with_suffix(".th").write_text("สวัสดีครับ\nขอบคุณครับ\n")
    output = tmp_path / "scores.json"
    with pytest.raises(SystemExit) as exit_info:
        evaluate_cli("--model", model_folder, "--test_file", test, "--source_lang", "en", "--target_lang", "th",
                     "--output", output)
    assert "--target_lang th" in str(exit_info.value.code) and "chrF" in str(exit_info.value.code)
    assert not output.exists()


WORDS = st.text(alphabet="abcdefghijklmnopqrstuvwxyzäöüéABCDEFGH", min_size=1, max_size=8)


@PROPERTY
@given(sentences=st.lists(st.lists(WORDS, min_size=4, max_size=9).map(" ".join).map(lambda s: s + "."),
                          min_size=1, max_size=6),
       lang=st.sampled_from(["en", "de", "fr", "zh", "ko"]))
def test_identical_output_scores_100_in_every_form(sentences, lang):
    if lang == "zh":  # words of Chinese characters, without spaces
        sentences = ["".join(chr(0x4E00 + (ord(c) * 7) % 2000) for c in s if c != " ") for s in sentences]
    scores = compute_bleu(sentences, sentences, lowercase_tokenized_references=None if lang == "zh" else
                          [s.lower() for s in sentences], target_lang=lang, tokenized_method="13a")
    assert scores["bleu"] == pytest.approx(100) and scores["paper_bleu"] == pytest.approx(100)
    if lang != "zh":
        assert scores["tok_bleu"] == pytest.approx(100)


def test_references_without_a_four_gram_are_refused_not_scored_zero():
    with pytest.raises(ValueError, match="no reference has 4 tokens"):
        compute_bleu(["A dog."], ["A dog."], target_lang="en")
    assert compute_bleu(["A dog runs home."], ["A dog runs home."], target_lang="en")["bleu"] == pytest.approx(100)


# Flags of vaswani-train that cannot apply or cannot work: refused before any work, nothing written -------------------

BAD_TRAIN_FLAGS = [
    (("--learning_rate", "0.001"), "--learning_rate would do nothing"),
    (("--lr_scheduler_type", "cosine"), "--lr_scheduler_type would do nothing"),
    (("--adam_beta2", "0.999"), "--adam_beta2 would do nothing"),
    (("--weight_decay", "0.01"), "--weight_decay would do nothing"),
    (("--warmup_ratio", "0.1"), "not used by the HfArgumentParser: ['--warmup_ratio', '0.1']"),
    (("--max_steps", "-5"), "--max_steps must be >= 1, got -5"),
    (("--max_steps", "0"), "--max_steps must be >= 1, got 0"),
    (("--label_smoothing_factor", "1.5"), "--label_smoothing_factor must be in [0, 1)"),
    (("--warmup_steps", "-3"), "warmup_steps"),
    (("--vocab_size", "3"), "--vocab_size must exceed 260"),
    (("--config_overrides", "d_model=30,num_heads=4"), "--config_overrides 'd_model=30,num_heads=4': "),
    (("--config_overrides", "dropout=2"), "--config_overrides 'dropout=2': VaswaniConfig: dropout"),
    (("--config_overrides", "d_ff=-1"), "--config_overrides 'd_ff=-1': "),
]


@pytest.mark.parametrize("flags, words", BAD_TRAIN_FLAGS, ids=[" ".join(flags) for flags, _ in BAD_TRAIN_FLAGS])
def test_vaswani_train_refuses_flags_that_cannot_apply_before_any_work(tmp_path, flags, words):
    from helpers import train_cli

    with pytest.raises(CheckError) as refused:
        train_cli(tmp_path / "run", tmp_path / "cache", *flags)
    assert words in str(refused.value), refused.value
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_vocab_size_with_a_given_tokenizer_is_refused(tmp_path, model_folder):
    from helpers import train_cli

    with pytest.raises(CheckError, match="--vocab_size 1000 would do nothing with --model_name_or_path"):
        train_cli(tmp_path / "run", tmp_path / "cache", "--model_name_or_path", model_folder, "--vocab_size", "1000")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("port", ["0", "65536", "99999"])
def test_vaswani_demo_refuses_a_port_outside_the_tcp_range(model_folder, port):
    from vaswani_training.demo import main as demo_main

    with pytest.raises(SystemExit, match=f"--port must be a TCP port from 1 to 65535, got {port}"):
        demo_main(["--model", str(model_folder), "--port", port])


# --model and --model_dir name the same folder in every command -------------------------------------------------------


@pytest.mark.parametrize("module, args", [
    ("translate", ["--model_dir", "{nope}", "--input", "{text}"]),
    ("evaluate_bleu", ["--model_dir", "{nope}"]),
    ("demo", ["--model_dir", "{nope}"]),
    ("convert_ct2", ["--model", "{nope}", "--output_dir", "{out}"]),
    ("publish", ["--model", "{nope}", "--output_dir", "{out}"]),
    ("plot", ["attention", "--model", "{nope}", "--source", "Ein Hund.", "--output_dir", "{out}"]),
])
def test_each_command_takes_the_model_folder_as_model_or_model_dir(module, args, tmp_path, capsys):
    import importlib

    (tmp_path / "in.de").write_text("Ein Hund.\n")
    argv = [a.format(nope=tmp_path / "nope", text=tmp_path / "in.de", out=tmp_path / "out") for a in args]
    main = importlib.import_module(f"vaswani_training.{module}").main
    try:
        code, message = main(argv), ""
    except SystemExit as stop:
        code, message = stop.code, str(stop.code)
    captured = capsys.readouterr()
    said = message + captured.err + captured.out
    assert code not in (0, None)
    assert "is not a saved model folder" in said and str(tmp_path / "nope") in said, said  # the folder was read
