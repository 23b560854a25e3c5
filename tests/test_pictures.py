"""Attention pictures (vaswani_hf/pictures/attention.py) and the plot command (training/plot.py)."""

import json
import struct

import pytest
import torch
from helpers import tiny_model

from vaswani_hf.decoding.paper import paper_generate
from vaswani_hf.pictures.attention import (
    AXIS_NAMES,
    NOT_PREDICTED,
    attention_figure,
    attention_maps,
    attention_weights,
    decoder_rows,
    plot_all_attention,
    plot_attention,
)
from vaswani_hf.pictures.positions import curve_dimensions, positional_encoding_figure, wavelength
from vaswani_training.plot import learning_curve_data, plot_learning_curve
from vaswani_training.plot import main as plot_main

SOURCE = "Zwei Hunde spielen im Schnee."
TARGET = "Two dogs are playing in the snow."
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def model(tiny_tokenizer):
    return tiny_model(vocab_size=len(tiny_tokenizer))


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height, len(data)


def _assert_distributions(weights):
    assert torch.allclose(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-5)
    assert (weights >= 0).all()


def test_maps_have_the_right_shapes_and_rows_sum_to_one(model, tiny_tokenizer):
    maps = attention_maps(model, tiny_tokenizer, SOURCE, TARGET, layer=0)
    source_ids = tiny_tokenizer(SOURCE)["input_ids"]
    labels = tiny_tokenizer(text_target=TARGET)["input_ids"]
    S, T = len(source_ids), len(labels)  # decoder input: <s> + target without </s>
    assert maps.encoder.shape == (4, S, S)
    assert maps.decoder.shape == (4, T, T)
    assert maps.cross.shape == (4, T, S)
    for weights in (maps.encoder, maps.decoder, maps.cross):
        _assert_distributions(weights)
    assert maps.decoder.triu(diagonal=1).abs().max().item() == 0.0  # masked: no attention to later positions
    assert maps.source_tokens == tiny_tokenizer.convert_ids_to_tokens(source_ids)
    assert maps.source_tokens[-1] == "</s>" and maps.target_tokens[0] == "<s>"
    assert maps.target_tokens[1:] == tiny_tokenizer.convert_ids_to_tokens(labels[:-1])
    # each decoder row is labelled with the token it predicts: the labels, </s> last
    assert maps.predicted_tokens == tiny_tokenizer.convert_ids_to_tokens(labels)
    assert maps.axes("cross") == (maps.predicted_tokens, maps.source_tokens)
    assert maps.axes("decoder") == (maps.predicted_tokens, maps.target_tokens)
    assert (maps.layer, maps.num_layers) == (0, 2)
    last = attention_maps(model, tiny_tokenizer, SOURCE, TARGET)  # default: the last layer
    assert last.layer == 1 and not torch.allclose(last.encoder, maps.encoder)
    # The heads differ from each other (they are not one map drawn four times).
    assert not torch.allclose(maps.encoder[0], maps.encoder[1])


def test_maps_of_the_models_own_translation(model, tiny_tokenizer):
    maps = attention_maps(model, tiny_tokenizer, SOURCE, num_beams=1)
    ids = torch.tensor([tiny_tokenizer(SOURCE)["input_ids"]])
    generated = paper_generate(model, ids, num_beams=1)[0]
    generated = generated[generated.ne(0)]
    expected = generated[:-1] if generated[-1].item() == 2 else generated
    assert maps.target_tokens == tiny_tokenizer.convert_ids_to_tokens(expected.tolist())
    assert maps.cross.shape == (4, len(expected), ids.shape[1])
    _assert_distributions(maps.cross)


def test_bad_layer_and_batch(model, tiny_tokenizer):
    with pytest.raises(ValueError, match="has 2 layers"):
        attention_maps(model, tiny_tokenizer, SOURCE, TARGET, layer=2)
    with pytest.raises(ValueError, match="batch size 1"):
        attention_weights(model, torch.ones(2, 3, dtype=torch.long), torch.ones(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="empty"):
        attention_maps(model, tiny_tokenizer, "  ", TARGET)


def test_pngs_are_written(model, tiny_tokenizer, tmp_path):
    maps = attention_maps(model, tiny_tokenizer, SOURCE, TARGET)
    paths = plot_all_attention(maps, tmp_path / "pictures")
    assert [p.name for p in paths] == ["attention_layer2_encoder.png", "attention_layer2_decoder.png",
                                       "attention_layer2_cross.png"]
    for path in paths:
        width, height, size = _png_size(path)
        assert width > 500 and height > 200 and size > 10_000  # four labelled heatmaps, not an empty canvas
    assert not list((tmp_path / "pictures").glob("*.tmp"))
    with pytest.raises(KeyError, match="Unknown attention kind"):
        plot_attention(maps, "self", tmp_path / "x.png")


LOG_HISTORY = [
    {"step": 10, "loss": 5.0, "learning_rate": 1e-4, "epoch": 0.1},
    {"step": 20, "loss": 4.0, "learning_rate": 2e-4, "epoch": 0.2},
    {"step": 20, "eval_loss": 4.5, "eval_bleu": 3.25, "epoch": 0.2},
    {"step": 30, "loss": 3.5, "learning_rate": 1.5e-4, "epoch": 0.3},
    {"step": 40, "eval_loss": 3.9, "eval_bleu": 8.5, "epoch": 0.4},
    {"step": 40, "train_loss": 4.2, "train_runtime": 12.0, "epoch": 0.4},  # end-of-training summary
]


def test_learning_curve_data():
    data = learning_curve_data(LOG_HISTORY)
    assert data["train_loss"] == [(10, 5.0), (20, 4.0), (30, 3.5)]
    assert data["eval_loss"] == [(20, 4.5), (40, 3.9)]
    assert data["eval_bleu"] == [(20, 3.25), (40, 8.5)]
    assert data["learning_rate"] == [(10, 1e-4), (20, 2e-4), (30, 1.5e-4)]
    assert learning_curve_data(LOG_HISTORY, metric="chrf")["eval_chrf"] == []
    with pytest.raises(ValueError, match="list of dicts"):
        learning_curve_data({"step": 1})


def test_curve_png_from_a_run_folder(tmp_path):
    run = tmp_path / "run"
    for step, history in ((900, LOG_HISTORY[:3]), (10000, LOG_HISTORY)):  # the newest checkpoint is read
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    path = plot_learning_curve(run, tmp_path / "curve.png")
    width, height, size = _png_size(path)
    assert width > 800 and height > 200 and size > 10_000
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"log_history": []}))
    with pytest.raises(ValueError, match="no logged"):
        plot_learning_curve(empty, tmp_path / "x.png")


def test_command(model, tiny_tokenizer, tmp_path, capsys):
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer.save_pretrained(tmp_path / "model")
    assert plot_main(["attention", "--model_dir", str(tmp_path / "model"), "--source", SOURCE, "--layer", "1",
                      "--output_dir", str(tmp_path / "pics")]) == 0
    assert sorted(p.name for p in (tmp_path / "pics").iterdir()) == [
        "attention_layer1_cross.png", "attention_layer1_decoder.png", "attention_layer1_encoder.png"]
    assert "Wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="between 1 and 2"):
        plot_main(["attention", "--model_dir", str(tmp_path / "model"), "--source", SOURCE, "--layer", "3",
                   "--output_dir", str(tmp_path / "pics")])
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"log_history": LOG_HISTORY}))
    assert plot_main(["curve", "--trainer_state", str(state), "--output", str(tmp_path / "curve.png")]) == 0
    assert _png_size(tmp_path / "curve.png")[2] > 10_000
    with pytest.raises(SystemExit, match="No trainer_state.json"):
        plot_main(["curve", "--trainer_state", str(tmp_path / "nowhere"), "--output", str(tmp_path / "c.png")])


def test_decoder_rows_are_the_inputs_and_what_each_predicts():
    assert decoder_rows([1, 7, 8, 2], eos_token_id=2) == ([1, 7, 8], [7, 8, 2])
    assert decoder_rows([1, 7, 8], eos_token_id=2) == ([1, 7, 8], [7, 8, None])  # cut off before </s>
    assert decoder_rows([1], eos_token_id=2) == ([1], [None])


def test_every_attention_picture_has_head_numbers_token_ticks_axis_names_and_a_colour_scale(model, tiny_tokenizer):
    maps = attention_maps(model, tiny_tokenizer, SOURCE, TARGET)
    for kind in ("encoder", "decoder", "cross"):
        figure = attention_figure(maps, kind)
        heads = [ax for ax in figure.axes if ax.get_title().startswith("head")]
        assert [ax.get_title() for ax in heads] == ["head 1", "head 2", "head 3", "head 4"]
        rows, cols = maps.axes(kind)
        assert [t.get_text() for t in heads[0].get_xticklabels()] == cols
        assert [t.get_text() for t in heads[0].get_yticklabels()] == rows
        assert heads[0].get_ylabel() == AXIS_NAMES[kind][0] and heads[-1].get_xlabel() == AXIS_NAMES[kind][1]
        (colour_bar,) = [ax for ax in figure.axes if ax not in heads]
        assert colour_bar.get_ylabel() == "attention weight"
        # one scale for all heads: every image spans 0 to the largest weight of the figure
        limits = [ax.images[0].get_clim() for ax in heads]
        assert limits == [(0.0, pytest.approx(float(maps[kind].max())))] * 4
    one = attention_figure(maps, "cross", heads=[2])
    assert "head 3" in one._suptitle.get_text() and [ax.get_title() for ax in one.axes][:1] == ["head 3"]
    with pytest.raises(IndexError, match="head 5 does not exist"):
        attention_figure(maps, "cross", heads=[4])


def test_a_decoder_row_without_a_prediction_is_marked(model, tiny_tokenizer):
    from vaswani_hf.pictures.attention import predicted_token_labels

    assert predicted_token_labels(tiny_tokenizer, [5, None])[1] == NOT_PREDICTED


def test_the_positional_encoding_picture_is_section_3_5(model, tiny_tokenizer):
    import math

    d_model = model.config.d_model
    assert wavelength(0, d_model) == pytest.approx(2 * math.pi)
    assert wavelength(d_model - 1, d_model) == pytest.approx(2 * math.pi * 10000 ** ((d_model - 2) / d_model))
    dims = curve_dimensions(512)
    # geometric: 2π, 2π·10, 2π·100, 2π·1000
    assert [round(wavelength(d, 512) / (2 * math.pi)) for d in dims] == [1, 10, 100, 1000]
    tokens = tiny_tokenizer.convert_ids_to_tokens(tiny_tokenizer(SOURCE)["input_ids"])
    figure = positional_encoding_figure(model, tokens)
    heat, lines = figure.axes[0], figure.axes[1]
    table = heat.images[0].get_array()
    assert table.shape == (len(tokens), d_model)
    positions = torch.arange(len(tokens), dtype=torch.float64)[:, None]
    i = torch.arange(d_model // 2, dtype=torch.float64)
    angles = positions / 10000 ** (2 * i / d_model)
    # the sines of every i, then the cosines: smooth halves, not interleaved stripes
    assert torch.allclose(torch.as_tensor(table[:, : d_model // 2]).double(), torch.sin(angles), atol=1e-5)
    assert torch.allclose(torch.as_tensor(table[:, d_model // 2:]).double(), torch.cos(angles), atol=1e-5)
    assert [t.get_text() for t in heat.get_yticklabels()] == [f"{n} {t}" for n, t in enumerate(tokens)]
    labels = [line.get_label() for line in lines.get_lines()]
    assert labels[0].startswith("2i = 0: wavelength 6")
    # the legend sits below the curves, not over them
    legend = lines.get_legend()
    assert legend is not None and legend.get_bbox_to_anchor().y1 < lines.get_window_extent().y0 + 1
    assert "wavelength" in figure._supxlabel.get_text()


def test_positions_command(model, tiny_tokenizer, tmp_path, capsys):
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer.save_pretrained(tmp_path / "model")
    assert plot_main(["positions", "--model_dir", str(tmp_path / "model"), "--source", SOURCE,
                      "--output", str(tmp_path / "pe.png")]) == 0
    width, height, size = _png_size(tmp_path / "pe.png")
    assert width > 600 and size > 10_000
    assert plot_main(["positions", "--model_dir", str(tmp_path / "model"), "--positions", "40",
                      "--output", str(tmp_path / "pe40.png")]) == 0
    assert _png_size(tmp_path / "pe40.png")[1] > height  # more rows
    with pytest.raises(SystemExit, match="--positions must be between 1 and 1000"):
        plot_main(["positions", "--model_dir", str(tmp_path / "model"), "--positions", "0",
                   "--output", str(tmp_path / "x.png")])
    with pytest.raises(SystemExit, match="no config.json"):
        plot_main(["positions", "--model_dir", str(tmp_path), "--positions", "4", "--output", str(tmp_path / "x.png")])
