"""The demo page's logic without a browser (`vaswani_hf.pictures.demo`, `training/demo.py`'s `DemoPage`), and the
Space that `vaswani-publish --space` writes. The page in a real browser: tests/test_demo_browser.py."""

import math
import os
import socket
import urllib.request

import pytest
import torch
from helpers import GERMAN, free_port, run_without_vaswani_hf, translate_cli

from vaswani_hf.checks import CheckError
from vaswani_hf.pictures import demo as core
from vaswani_hf.pictures.attention import attention_weights

if os.environ.get("VASWANI_REQUIRE_DEV") != "1":
    pytest.importorskip("gradio", reason="the demo page needs gradio: pip install -e '.[demo]'")
    pytest.importorskip("matplotlib", reason="the demo's pictures need matplotlib: pip install -e '.[demo]'")

from vaswani_training.demo import DemoPage, build_demo, launch, load_model  # noqa: E402
from vaswani_training.lib.space import space_files  # noqa: E402


@pytest.fixture
def loaded(model_folder):
    model, tokenizer = load_model(str(model_folder))
    return model_folder, model, tokenizer


# Requests the page refuses ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, beams, alpha, n, words", [
    ("", 4, 0.6, 1, "empty"),
    ("   \n\t ", 4, 0.6, 1, "empty"),
    (None, 4, 0.6, 1, "empty"),
    ("a" * 10_001, 4, 0.6, 1, "10,001 characters"),
    ("Ein Hund.", 0, 0.6, 1, "Beam size must be a whole number from 1 to 12; got 0"),
    ("Ein Hund.", 13, 0.6, 1, "from 1 to 12; got 13"),
    ("Ein Hund.", 2.5, 0.6, 1, "got 2.5"),
    ("Ein Hund.", None, 0.6, 1, "Beam size"),
    ("Ein Hund.", "four", 0.6, 1, "Beam size"),
    ("Ein Hund.", 4, float("nan"), 1, "Length penalty"),
    ("Ein Hund.", 4, 6.0, 1, "Length penalty"),
    ("Ein Hund.", 4, "x", 1, "Length penalty"),
    ("Ein Hund.", 4, 0.6, 5, "Number of hypotheses must be a whole number from 1 to 4; got 5"),
    ("Ein Hund.", 4, 0.6, 0, "Number of hypotheses"),
])
def test_check_request_refuses_with_a_message(text, beams, alpha, n, words):
    with pytest.raises(CheckError, match=words.replace(".", r"\.").replace("(", r"\(")):
        core.check_request(text, beams, alpha, n)


def test_check_request_accepts_the_limits():
    assert core.check_request("  Ein Hund.  ", 4.0, 0.6, 4.0) == ("Ein Hund.", 4, 0.6, 4)
    assert core.check_request("a" * 10_000, 12, -5, 1)[1:] == (12, -5.0, 1)


def test_a_text_of_too_many_tokens_is_refused_before_decoding(loaded):
    _, model, tokenizer = loaded
    text = " ".join(GERMAN * 3)  # far under 10,000 characters, over 200 subwords
    assert len(text) < core.MAX_CHARACTERS and len(tokenizer(text)["input_ids"]) > core.MAX_SOURCE_TOKENS
    with pytest.raises(CheckError, match="at most 200"):
        core.translate_nbest(model, tokenizer, text, num_beams=2, length_penalty=0.6, num_hypotheses=1)


def test_unknown_characters_are_those_spelled_as_bytes(tiny_tokenizer):
    assert core.unknown_characters(tiny_tokenizer, GERMAN[0]) == []
    assert core.unknown_characters(tiny_tokenizer, "Ein 日本 Hund 日 ✓") == ["日", "本", "✓"]


# Translations: the command's ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("beams, alpha, n", [(1, 0.6, 1), (4, 0.6, 3), (3, 1.0, 3), (5, 0.0, 2)])
def test_the_best_hypothesis_is_vaswani_translates_translation(loaded, tmp_path, beams, alpha, n):
    folder, model, tokenizer = loaded
    sentences = GERMAN[:3]
    (tmp_path / "in.de").write_text("\n".join(sentences) + "\n", encoding="utf-8")
    # --batch_size 1: a batch's outputs may run to its longest source + 50 tokens, the page's to its own + 50
    assert translate_cli("--model", folder, "--input", tmp_path / "in.de", "--output", tmp_path / "out.en",
                         "--num_beams", beams, "--length_penalty", alpha, "--device", "cpu", "--batch_size", 1) == 0
    expected = (tmp_path / "out.en").read_text(encoding="utf-8").splitlines()
    for sentence, command in zip(sentences, expected):
        translation = core.translate_nbest(model, tokenizer, sentence, num_beams=beams, length_penalty=alpha,
                                           num_hypotheses=n)
        assert translation.hypotheses[0].text == command
        assert len(translation.hypotheses) == n
        if beams == 1:
            assert translation.hypotheses[0].score is None
        else:  # best first; each score is the hypothesis' log-probability / length^alpha
            scores = [h.score for h in translation.hypotheses]
            assert scores == sorted(scores, reverse=True) and all(math.isfinite(s) and s < 0 for s in scores)
            hypothesis = translation.hypotheses[1]
            ids = torch.tensor([hypothesis.ids])
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([translation.source_ids]), decoder_input_ids=ids[:, :-1]).logits
            logprob = logits.log_softmax(-1)[0].gather(-1, ids[0, 1:, None]).sum().item()
            length = len(hypothesis.ids) - 1  # the tokens after the start token
            assert hypothesis.score == pytest.approx(logprob / length ** alpha, rel=1e-4, abs=1e-4)


# Attention of the chosen hypothesis ---------------------------------------------------------------------------------


def test_hypothesis_attention_is_every_layers_teacher_forced_attention(loaded):
    _, model, tokenizer = loaded
    translation = core.translate_nbest(model, tokenizer, GERMAN[1], num_beams=3, length_penalty=0.6,
                                       num_hypotheses=3)
    hypothesis = translation.hypotheses[2]
    maps = core.hypothesis_attention(model, tokenizer, translation, 2)
    config = model.config
    assert len(maps) == config.decoder_layers == 2
    S = len(translation.source_ids)
    decoder_ids = hypothesis.ids[:-1] if hypothesis.ids[-1] == config.eos_token_id else hypothesis.ids
    T = len(decoder_ids)
    for layer, m in enumerate(maps):
        assert m.layer == layer and m.source_tokens == tokenizer.convert_ids_to_tokens(translation.source_ids)
        assert m.target_tokens[0] == "<s>" and len(m.target_tokens) == T
        assert m.encoder.shape == (4, S, S) and m.decoder.shape == (4, T, T) and m.cross.shape == (4, T, S)
        expected = attention_weights(model, torch.tensor(translation.source_ids), torch.tensor(decoder_ids), layer)
        for kind in core.ATTENTION_KINDS:
            torch.testing.assert_close(m[kind], expected[kind])
            torch.testing.assert_close(m[kind].sum(-1), torch.ones(m[kind].shape[:-1]))
    assert core.output_tokens(tokenizer, hypothesis) == tokenizer.convert_ids_to_tokens(hypothesis.ids[1:])


def test_source_highlight_is_the_tokens_cross_attention_scaled_to_one(loaded):
    _, model, tokenizer = loaded
    translation = core.translate_nbest(model, tokenizer, GERMAN[2], num_beams=2, length_penalty=0.6,
                                       num_hypotheses=1)
    maps = core.hypothesis_attention(model, tokenizer, translation, 0)[-1]
    shaded = core.source_highlight(maps, 3)
    assert [token for token, _ in shaded] == maps.source_tokens  # "▁" kept: the word boundaries, as in the pictures
    mean = maps.cross[:, 3].mean(0)
    assert [w for _, w in shaded] == pytest.approx((mean / mean.max()).tolist(), abs=1e-4)
    assert max(w for _, w in shaded) == pytest.approx(1.0)
    one_head = core.source_highlight(maps, 3, head=1)
    assert [w for _, w in one_head] == pytest.approx((maps.cross[1, 3] / maps.cross[1, 3].max()).tolist(), abs=1e-4)


# Pictures ------------------------------------------------------------------------------------------------------------


def test_the_pages_pictures_are_the_figures_vaswani_plot_draws(loaded, monkeypatch):
    import numpy as np

    from vaswani_hf.pictures import attention
    from vaswani_hf.pictures.attention import attention_figure

    _, model, tokenizer = loaded
    translation = core.translate_nbest(model, tokenizer, GERMAN[0], num_beams=2, length_penalty=0.6,
                                       num_hypotheses=1)
    maps = core.hypothesis_attention(model, tokenizer, translation, 0)[0]
    image = core.draw_heads(maps, "cross")
    assert image.mode == "RGB"
    expected = core.figure_image(attention_figure(maps, "cross"))
    assert np.array_equal(np.asarray(image), np.asarray(expected))
    drawn = []  # vaswani-plot's PNG is the same figure
    monkeypatch.setattr(attention, "save_figure", lambda figure, path, dpi=100: drawn.append(figure) or path)
    attention.plot_attention(maps, "cross", "unused.png")
    assert np.array_equal(np.asarray(core.figure_image(drawn[0])), np.asarray(expected))
    empty = core.AttentionMaps(maps.source_tokens, maps.target_tokens, 0, 1, torch.empty(0), maps.decoder, maps.cross)
    assert core.draw_heads(empty, "encoder") is None and core.draw_head(empty, "encoder", 0) is None


def test_draw_head_and_positional_encoding_are_images(loaded):
    _, model, tokenizer = loaded
    translation = core.translate_nbest(model, tokenizer, GERMAN[0], num_beams=2, length_penalty=0.6,
                                       num_hypotheses=1)
    maps = core.hypothesis_attention(model, tokenizer, translation, 0)[1]
    short = core.draw_head(maps, "encoder", 3)
    assert short.size[0] > 200 and short.size[1] > 200
    with pytest.raises(IndexError, match="head 5 does not exist: the model has 4 heads"):
        core.draw_head(maps, "encoder", 4)
    tokens = tokenizer.convert_ids_to_tokens(translation.source_ids)
    small, large = (core.draw_positional_encoding(model, tokens[:n]) for n in (4, len(tokens)))
    assert small.size[0] == large.size[0] > 400 and large.size[1] > small.size[1] > 150


# The page's events ---------------------------------------------------------------------------------------------------


def test_page_translate_fills_every_output(loaded):
    _, model, tokenizer = loaded
    page = DemoPage(model, tokenizer)
    out = page.translate(GERMAN[3], 4, 0.6, 3, 2, 1, "cross")
    state, status, text, hypotheses, *pictures, positional, targets, shaded = out
    expected = core.translate_nbest(model, tokenizer, GERMAN[3], num_beams=4, length_penalty=0.6, num_hypotheses=3)
    assert text == expected.hypotheses[0].text and status.startswith("3 hypotheses (beam 4, length penalty 0.6)")
    assert [value for _, value in hypotheses["choices"]] == [0, 1, 2] and hypotheses["value"] == 0
    assert all(image is not None and min(image.size) > 10 for image in [*pictures, positional])
    assert len(targets["choices"]) == len(expected.hypotheses[0].ids) - 1
    # the target tokens listed are the decoder rows' labels in the pictures: what each row predicts
    maps = core.hypothesis_attention(model, tokenizer, expected, 0)[1]
    listed = [label.split(" ", 1)[1] for label in targets["choices"]]
    assert listed == maps.predicted_tokens[:len(listed)]
    assert maps.predicted_tokens[len(listed):] in ([], ["…"])  # a hypothesis cut off before </s>: its last row
    # no shading until a target token is chosen
    assert shaded == [(token, 0.0) for token in maps.source_tokens]
    assert page.highlight(state, None, 2) == shaded
    # another hypothesis, another layer, a target token
    chosen = page.choose_hypothesis(state, 2, 1, 2, "decoder")
    assert chosen[1] == expected.hypotheses[2].text and chosen[0]["index"] == 2
    redrawn = page.redraw(chosen[0], 1, 4, "encoder")
    assert len(redrawn) == 4 and redrawn[3].size != pictures[3].size
    assert page.highlight(chosen[0], 1, 1) == core.source_highlight(chosen[0]["maps"][0], 1)


@pytest.mark.parametrize("text, beams, words", [
    ("", 4, "empty"), ("     ", 4, "empty"), ("x" * 10_001, 4, "10,001 characters"), ("Ein Hund.", 0, "Beam size"),
    ("Ein Hund.", 99, "Beam size"), (" ".join(GERMAN * 3), 4, "subword tokens"),
])
def test_page_shows_bad_input_as_a_message(loaded, text, beams, words):
    _, model, tokenizer = loaded
    with pytest.warns(UserWarning, match=words):  # gr.Warning outside a request
        out = DemoPage(model, tokenizer).translate(text, beams, 0.6, 1, 1, 1, "cross")
    assert out[0] is None and words in out[1] and out[2] == ""
    assert out[4:9] == [None] * 5


def test_page_names_characters_outside_the_vocabulary(loaded):
    _, model, tokenizer = loaded
    status = DemoPage(model, tokenizer).translate("Ein Hund 日本.", 2, 0.6, 1, 1, 1, "cross")[1]
    assert "Characters outside the vocabulary" in status and status.endswith("日 本")


def test_launch_sends_nothing_beyond_localhost(loaded, monkeypatch):
    _, model, tokenizer = loaded
    contacted = []
    connect, getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def record_connect(sock, address):
        contacted.append(address[0] if isinstance(address, tuple) else address)
        return connect(sock, address)

    def record_lookup(host, *args, **kwargs):
        contacted.append(host)
        return getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", record_connect)
    monkeypatch.setattr(socket, "getaddrinfo", record_lookup)
    demo = build_demo(model, tokenizer)
    url = launch(demo, host="127.0.0.1", port=free_port(), block=False)
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            assert response.status == 200 and b"gradio" in response.read().lower()
    finally:
        demo.close()
    assert contacted and set(contacted) <= {"127.0.0.1", "localhost", "::1"}, contacted


# The Space --------------------------------------------------------------------------------------------------------


SPACE_SCRIPT = """
import json, os, sys, urllib.request
folder, port = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, folder)
from vaswani_demo.page import build_demo, launch, load_model
from vaswani_demo.pictures import demo as core
model, tokenizer = load_model(folder, trust_remote_code=True)
translation = core.translate_nbest(model, tokenizer, sys.argv[3], num_beams=4, length_penalty=0.6, num_hypotheses=2)
demo = build_demo(model, tokenizer)
url = launch(demo, host="127.0.0.1", port=port, block=False)
with urllib.request.urlopen(url, timeout=30) as response:
    served = response.status
demo.close()
print("RESULT=" + json.dumps({"text": translation.hypotheses[0].text, "served": served,
                              "model_module": type(model).__module__,
                              "vaswani_hf": sorted(m for m in sys.modules if m.startswith("vaswani_hf"))}))
"""


def test_the_published_space_runs_from_the_folder_alone(model_folder, tmp_path):
    from helpers import printed_result

    from vaswani_training.lib.publishing import write_hub_folder

    folder = write_hub_folder(model_folder, tmp_path / "space", space=True)
    names = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    assert set(space_files()) <= names and {"app.py", "requirements.txt", "model.safetensors"} <= names
    requirements = (folder / "requirements.txt").read_text().splitlines()
    assert any(r.startswith("gradio") for r in requirements) and any(r.startswith("torch") for r in requirements)
    assert not any(r.startswith("playwright") for r in requirements)
    readme = (folder / "README.md").read_text()
    header = readme.split("---\n")[1]
    assert "sdk: gradio\n" in header and "app_file: app.py\n" in header and "pipeline_tag: translation" in header
    (tmp_path / "in.de").write_text(GERMAN[4] + "\n", encoding="utf-8")
    assert translate_cli("--model", model_folder, "--input", tmp_path / "in.de", "--output", tmp_path / "out.en",
                         "--num_beams", 4, "--length_penalty", 0.6) == 0
    completed = run_without_vaswani_hf(SPACE_SCRIPT, folder, free_port(), GERMAN[4], cwd=tmp_path,
                                       hf_home=tmp_path / "hf", GRADIO_ANALYTICS_ENABLED="False")
    result = printed_result(completed)
    assert result["vaswani_hf"] == [] and result["model_module"].startswith("transformers_modules.")
    assert result["text"] == (tmp_path / "out.en").read_text(encoding="utf-8").strip() and result["served"] == 200


def test_the_command_refuses_a_missing_folder_and_a_bad_concurrency(tmp_path, model_folder):
    from vaswani_training.demo import main

    with pytest.raises(SystemExit, match="not a saved model folder"):
        main(["--model", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="--concurrency must be >= 1, got 0"):
        main(["--model", str(model_folder), "--concurrency", "0"])


def test_the_page_says_what_the_model_was_trained_on(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text('{"dataset": "multi30k", "data": {"kind": "multi30k"}}')
    assert core.training_data_note(run) == core.MULTI30K_NOTE
    assert "29,000" in core.MULTI30K_NOTE and "Flickr" in core.MULTI30K_NOTE
    published = tmp_path / "published"
    published.mkdir()
    card = "---\nlicense: apache-2.0\ndatasets:\n- wmt/wmt14\nlanguage:\n- de\n---\n# x\n"
    (published / "README.md").write_text(card)
    assert core.training_data_note(published).startswith("This model was trained on wmt/wmt14.")
    (published / "metrics.json").write_text("not json")  # a damaged record: the card still tells
    assert core.training_data_note(published).startswith("This model was trained on wmt/wmt14.")
    (published / "README.md").write_text("---\ndatasets: [bentrevett/multi30k]\n---\n# x\n")  # inline list
    assert core.training_data_note(published) == core.MULTI30K_NOTE
    (published / "README.md").write_text("---\ndatasets: [unclosed\n---\n# x\n")  # not YAML: not recorded
    assert core.training_data_note(published).startswith("What this model was trained on is not recorded")
    assert core.training_data_note(tmp_path).startswith("What this model was trained on is not recorded")
    assert core.training_data_note(None).startswith("What this model was trained on is not recorded")


def test_the_page_shows_the_training_data_note_of_the_folder_it_serves(loaded):
    folder, model, tokenizer = loaded
    (folder / "metrics.json").write_text('{"dataset": "multi30k"}')
    demo = build_demo(model, tokenizer, model_dir=str(folder))
    texts = [block.value for block in demo.blocks.values() if getattr(block, "elem_id", None) == "training_data"]
    assert texts == [f"*{core.MULTI30K_NOTE}*"]
