"""VaswaniConfig: the paper's defaults (Table 3), presets, overrides, options, validation, generation defaults."""

import json
import re

import pytest
import torch
from helpers import exits_with, tiny_config, tiny_model, translate_cli
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from transformers import (
    AutoConfig,
    AutoModelForSeq2SeqLM,
    GenerationConfig,
)

from vaswani_hf import VaswaniConfig, VaswaniForConditionalGeneration, VaswaniModel

PAPER_BASE = dict(
    vocab_size=37000,
    target_vocab_size=None,
    d_model=512,
    encoder_layers=6,
    decoder_layers=6,
    num_heads=8,
    d_ff=2048,
    dropout=0.1,
    attention_dropout=0.0,
    activation_dropout=0.0,
    activation_function="relu",
    normalize_before=False,
    position_embedding_type="sinusoidal",
    share_encoder_decoder_embeddings=True,
    tie_word_embeddings=True,
    scale_embedding=True,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=1,
    is_encoder_decoder=True,
)

# A valid non-default value for every field.
OVERRIDES = dict(
    vocab_size=1234,
    target_vocab_size=777,
    d_model=96,
    encoder_layers=3,
    decoder_layers=5,
    num_heads=12,
    d_ff=100,
    dropout=0.25,
    attention_dropout=0.05,
    activation_dropout=0.15,
    activation_function="gelu",
    normalize_before=True,
    position_embedding_type="learned",
    max_position_embeddings=77,
    share_encoder_decoder_embeddings=False,
    tie_word_embeddings=False,
    scale_embedding=False,
    layer_norm_eps=1e-6,
    use_cache=False,
    pad_token_id=3,
    bos_token_id=5,
    eos_token_id=6,
    decoder_start_token_id=7,
)


def test_defaults_are_the_paper_base_model():
    config = VaswaniConfig()
    for name, value in PAPER_BASE.items():
        assert getattr(config, name) == value, name
    assert config.decoder_vocab_size == 37000
    assert config.d_model // config.num_heads == 64  # d_k = d_v = 64 (§3.2.2)
    # transformers' generic names map onto ours
    assert (config.hidden_size, config.num_attention_heads, config.intermediate_size) == (512, 8, 2048)


def test_base_preset_equals_defaults_and_big_preset_is_table_3():
    assert VaswaniConfig.base().to_dict() == VaswaniConfig().to_dict()
    big = VaswaniConfig.big()
    assert (big.d_model, big.num_heads, big.d_ff, big.dropout) == (1024, 16, 4096, 0.3)
    assert (big.encoder_layers, big.decoder_layers, big.vocab_size, big.activation_function) == (6, 6, 37000, "relu")
    assert big.d_model // big.num_heads == 64
    # presets take overrides, e.g. the EN-FR big model's P_drop = 0.1 (§6.1)
    assert VaswaniConfig.big(dropout=0.1).dropout == 0.1
    assert VaswaniConfig.big(dropout=0.1).d_model == 1024
    assert VaswaniConfig.base(vocab_size=8000).vocab_size == 8000


def test_every_field_is_overridable_and_survives_save_and_load(tmp_path):
    config = VaswaniConfig(**OVERRIDES)
    for name, value in OVERRIDES.items():
        assert getattr(config, name) == value, name
    config.save_pretrained(tmp_path)
    reloaded = VaswaniConfig.from_pretrained(tmp_path)
    for name, value in OVERRIDES.items():
        assert getattr(reloaded, name) == value, name
    assert reloaded.decoder_vocab_size == 777
    via_auto = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(via_auto, VaswaniConfig) and via_auto.d_ff == 100


def test_a_config_of_earlier_releases_with_label_smoothing_loads_without_it(tmp_path):
    """Label smoothing is a setting of training (--label_smoothing_factor), not of the model: a config.json that still
    carries it loads, and the field is not written back."""
    config = VaswaniConfig(d_model=64, num_heads=4).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**config, "label_smoothing": 0.1}))
    loaded = VaswaniConfig.from_pretrained(tmp_path)
    assert loaded.d_model == 64 and not hasattr(loaded, "label_smoothing")
    loaded.save_pretrained(tmp_path / "again")
    assert "label_smoothing" not in json.loads((tmp_path / "again" / "config.json").read_text())


def test_saved_config_carries_auto_map(tmp_path):
    VaswaniConfig().save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "vaswani"
    assert saved["auto_map"] == {
        "AutoConfig": "configuration_vaswani.VaswaniConfig",
        "AutoModel": "modeling_vaswani.VaswaniModel",
        "AutoModelForSeq2SeqLM": "modeling_vaswani.VaswaniForConditionalGeneration",
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(d_model=30, num_heads=4), r"d_model \(30\) must be divisible by num_heads \(4\)"),
        (dict(d_model=0), "d_model must be a positive integer"),
        (dict(vocab_size=-5), "vocab_size must be a positive integer"),
        (dict(encoder_layers=0), "encoder_layers must be a positive integer"),
        (dict(decoder_layers=0), "decoder_layers must be a positive integer"),
        (dict(num_heads=0), "num_heads must be a positive integer"),
        (dict(d_ff=-1), "d_ff must be a positive integer"),
        (dict(d_ff=2.5), "d_ff must be a positive integer"),
        (dict(max_position_embeddings=0), "max_position_embeddings must be a positive integer"),
        (dict(target_vocab_size=0, share_encoder_decoder_embeddings=False), "target_vocab_size must be a positive"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
        (dict(dropout=-0.1), r"dropout must be in \[0, 1\)"),
        (dict(attention_dropout=1.5), r"attention_dropout must be in \[0, 1\)"),
        (dict(activation_dropout=-0.01), r"activation_dropout must be in \[0, 1\)"),
        (dict(target_vocab_size=50), "share_encoder_decoder_embeddings=True needs one vocabulary"),
        (dict(activation_function="mish"), "unknown activation_function 'mish'"),
        (dict(position_embedding_type="rotary"), "unknown position_embedding_type 'rotary'"),
    ],
)
def test_invalid_configs_raise_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_divisibility_error_suggests_a_valid_head_count():
    # 30 = 2 * 3 * 5: the largest head count <= 4 that divides it is 3
    with pytest.raises(ValueError, match=r"choose e\.g\. num_heads=3\."):
        VaswaniConfig(d_model=30, num_heads=4)
    assert VaswaniConfig(d_model=30, num_heads=3).d_model == 30


@pytest.mark.parametrize("tie", [True, False])
def test_separate_vocabularies(tie):
    model = tiny_model(target_vocab_size=57, share_encoder_decoder_embeddings=False, tie_word_embeddings=tie)
    inner = model.model
    assert inner.encoder.embed_tokens.weight.shape == (99, 32)
    assert inner.decoder.embed_tokens.weight.shape == (57, 32)
    assert inner.encoder.embed_tokens.weight is not inner.decoder.embed_tokens.weight
    assert (model.lm_head.weight is inner.decoder.embed_tokens.weight) == tie
    out = model(input_ids=torch.randint(3, 99, (2, 6)), labels=torch.randint(3, 57, (2, 4)))
    assert out.logits.shape == (2, 4, 57)
    assert torch.isfinite(out.loss)
    with pytest.raises(ValueError, match="outside this model's vocabulary of 57"):
        model(input_ids=torch.randint(3, 99, (2, 6)), decoder_input_ids=torch.full((2, 3), 80))


def test_sharing_off_with_one_vocabulary_keeps_two_matrices():
    model = tiny_model(share_encoder_decoder_embeddings=False)  # two-way sharing: decoder input and lm_head
    inner = model.model
    assert inner.encoder.embed_tokens.weight is not inner.decoder.embed_tokens.weight
    assert model.lm_head.weight is inner.decoder.embed_tokens.weight
    names = {name for name, _ in model.named_parameters()}
    assert "model.encoder.embed_tokens.weight" in names and "model.decoder.embed_tokens.weight" in names


@pytest.mark.parametrize(
    "overrides",
    [dict(normalize_before=True), dict(position_embedding_type="learned"),
     dict(attention_dropout=0.3, activation_dropout=0.3), dict(activation_function="gelu")],
)
def test_options_build_working_models(overrides):
    model = tiny_model(**overrides)
    ids = torch.randint(3, 99, (2, 7))
    out = model(input_ids=ids, labels=ids)
    assert torch.isfinite(out.loss)
    if overrides.get("normalize_before"):
        # pre-LN adds one final LayerNorm per stack
        assert model.model.encoder.layer_norm is not None and model.model.decoder.layer_norm is not None
    else:
        assert model.model.encoder.layer_norm is None
    if overrides.get("position_embedding_type") == "learned":
        assert model.model.encoder.embed_positions.weight.requires_grad
        assert "model.encoder.embed_positions.weight" in dict(model.named_parameters())
    # dropout options make training forwards stochastic only where they are set
    if "attention_dropout" in overrides:
        model.train()
        torch.manual_seed(0)
        a = model(input_ids=ids, labels=ids).loss
        torch.manual_seed(1)
        b = model(input_ids=ids, labels=ids).loss
        assert not torch.allclose(a, b)


def test_pre_ln_differs_from_post_ln_on_the_same_weights():
    post = tiny_model(seed=3)
    pre = tiny_model(seed=3, normalize_before=True)
    ids = torch.randint(3, 99, (2, 7))
    assert not torch.allclose(post(input_ids=ids, decoder_input_ids=ids).logits,
                              pre(input_ids=ids, decoder_input_ids=ids).logits)


def test_generation_defaults_are_the_papers_and_saved_beside_the_model(tmp_path):
    model = tiny_model()
    generation = model.generation_config
    assert (generation.num_beams, generation.length_penalty) == (4, 0.6)
    assert (generation.decoder_start_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 0)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["num_beams"] == 4 and saved["length_penalty"] == 0.6
    # generation settings are not model-config fields
    assert "num_beams" not in json.loads((tmp_path / "config.json").read_text())
    # a user's change to the generation config survives save/load
    model.generation_config.num_beams = 6
    model.save_pretrained(tmp_path)
    assert VaswaniForConditionalGeneration.from_pretrained(tmp_path).generation_config.num_beams == 6
    assert GenerationConfig.from_pretrained(tmp_path).num_beams == 6


def test_base_model_has_no_generation_head():
    model = VaswaniModel(tiny_config())
    assert not hasattr(model, "lm_head")


# Validation, naming config.json; any config.json builds a working model or is refused (hypothesis) --------------------


@pytest.mark.parametrize(("field", "value", "message"), [
    ("normalize_before", "false", "normalize_before must be true or false"),
    ("tie_word_embeddings", 1, "tie_word_embeddings must be true or false"),
    ("layer_norm_eps", -100, "layer_norm_eps must be a small positive number"),
    ("layer_norm_eps", 0, "layer_norm_eps must be a small positive number"),
    ("dropout", True, r"dropout must be in \[0, 1\)"),
    ("pad_token_id", 100000, r"pad_token_id must be a token id in \[0, "),
    ("eos_token_id", -1, r"eos_token_id must be a token id"),
    ("d_model", 32.0, "d_model must be a positive integer"),
])
def test_a_bad_field_in_config_json_is_refused_naming_the_file(model_folder, tmp_path, field, value, message):
    config = json.loads((model_folder / "config.json").read_text())
    config[field] = value
    (model_folder / "config.json").write_text(json.dumps(config))
    where = re.escape(str(model_folder / "config.json"))
    with pytest.raises(ValueError, match=f"{where}: {message}"):
        VaswaniForConditionalGeneration.from_pretrained(model_folder)
    with pytest.raises(ValueError, match=f"{where}: {message}"):
        VaswaniConfig.from_pretrained(model_folder)
    source = tmp_path / "in.de"
    source.write_text("Ein Hund.\n", encoding="utf-8")
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source), f"{where}: {message}")


def test_constructing_a_config_checks_types_and_ranges():
    with pytest.raises(ValueError, match="normalize_before must be true or false"):
        VaswaniConfig(normalize_before="yes")
    with pytest.raises(ValueError, match="layer_norm_eps"):
        VaswaniConfig(layer_norm_eps=float("nan"))
    assert VaswaniConfig(layer_norm_eps=1.0).layer_norm_eps == 1.0  # transformers' common tests use 1.0
    with pytest.raises(ValueError, match=r"bos_token_id must be a token id in \[0, 10\)"):
        VaswaniConfig(vocab_size=10, bos_token_id=10)


FIELDS = ["vocab_size", "target_vocab_size", "d_model", "encoder_layers", "decoder_layers", "num_heads", "d_ff",
          "dropout", "attention_dropout", "activation_dropout", "activation_function", "normalize_before",
          "position_embedding_type", "max_position_embeddings", "share_encoder_decoder_embeddings",
          "tie_word_embeddings", "scale_embedding", "layer_norm_eps", "use_cache", "pad_token_id",
          "bos_token_id", "eos_token_id", "decoder_start_token_id"]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from(["relu", "gelu", "learned", "sinusoidal", "true", "false", "no", "", "8"]),
                   st.lists(st.integers(0, 5), max_size=2))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=4))
def test_any_config_json_builds_a_working_model_or_is_refused_naming_config_json(tmp_path, changes):
    folder = tmp_path / "cfg"
    folder.mkdir(exist_ok=True)
    base = tiny_config(vocab_size=20, d_model=8, encoder_layers=1, decoder_layers=1, num_heads=2, d_ff=8)
    config = {**base.to_dict(), **changes}
    (folder / "config.json").write_text(json.dumps(config))
    try:
        loaded = VaswaniConfig.from_pretrained(folder)
    except ValueError as error:
        assert str(error).startswith(f"{folder / 'config.json'}: "), str(error)
        event("refused")
        return
    event("built")
    model = VaswaniForConditionalGeneration(loaded).eval()
    ids = torch.tensor([[min(3, loaded.vocab_size - 1), loaded.eos_token_id if isinstance(loaded.eos_token_id, int)
                         else 0]])
    decoder_ids = torch.tensor([[loaded.decoder_start_token_id]])
    logits = model(input_ids=ids, decoder_input_ids=decoder_ids).logits
    assert logits.shape == (1, 1, loaded.decoder_vocab_size) and bool(torch.isfinite(logits).all())


def test_a_saved_config_edited_to_impossible_sizes_is_refused_on_load(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_heads"] = 0
    (tmp_path / "config.json").write_text(json.dumps(config))
    for load in (VaswaniConfig.from_pretrained, VaswaniForConditionalGeneration.from_pretrained,
                 AutoModelForSeq2SeqLM.from_pretrained):
        with pytest.raises(ValueError, match="num_heads must be a positive integer, got 0"):
            load(tmp_path)
