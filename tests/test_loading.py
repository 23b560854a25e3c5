"""Loading follows transformers' semantics for legitimate conversions, and refuses what cannot be right.

- Untying on load: `share_encoder_decoder_embeddings=False` (MarianMT's `test_share_encoder_decoder_embeddings`,
  whose module transformers' sdist does not ship, adapted to our classes below) and `tie_word_embeddings=False` load a
  copy of the stored shared matrix (§3.4) into each embedding and `lm_head`, which then train apart;
- offload with `device_map` (everything on disk, or "auto" with a CPU budget that forces disk offload) loads and
  generates the in-memory model's tokens;
- the strict weight check still refuses a missing or foreign tensor, naming the file, and says "truncated or
  corrupted" only when the file is;
- generation_config.json: a truncated file, or a setting of the wrong type, is refused with the file named;
- weights only from safetensors: nothing of ours unpickles. Trainer's own checkpoint files (optimizer.pt,
  scheduler.pt, rng_state.pth) are torch.save pickles that transformers reads on --resume_from_checkpoint; they are
  written by our own run, not downloaded, and not part of a model folder.
"""

import ast
import json
import re
from pathlib import Path

import pytest
import torch
from helpers import ROOT, padded_batch, tiny_config, tiny_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSeq2SeqLM

from vaswani_hf import VaswaniConfig, VaswaniForConditionalGeneration, VaswaniModel

MODEL_CLASSES = (VaswaniModel, VaswaniForConditionalGeneration)


def _generate(model, **settings) -> torch.Tensor:
    ids, mask = padded_batch(length=9)
    return model.generate(input_ids=ids, attention_mask=mask, **{"max_new_tokens": 8, **settings})


@pytest.fixture
def saved(tmp_path):
    """A tiny model with distinct tokens (larger init of the shared matrix) saved with its one shared matrix."""
    model = tiny_model(seed=3)
    with torch.no_grad():
        model.model.shared.weight.mul_(4.0)
    model.save_pretrained(tmp_path / "model")
    return model, tmp_path / "model"


# MarianMT's test, on our classes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_class", MODEL_CLASSES, ids=lambda c: c.__name__)
def test_share_encoder_decoder_embeddings(model_class, tmp_path):
    """transformers' tests/models/marian/test_modeling_marian.py::test_share_encoder_decoder_embeddings, adapted: the
    steps are MarianMT's, the value checks after loading are ours (MarianMT initializes the untied copies at random)."""
    config = tiny_config()
    model = model_class(config)
    assert model.get_encoder().embed_tokens is model.get_decoder().embed_tokens  # shared by default
    assert model.get_encoder().embed_tokens.weight is model.get_decoder().embed_tokens.weight

    untied = model_class(tiny_config(share_encoder_decoder_embeddings=False))
    assert untied.get_encoder().embed_tokens is not untied.get_decoder().embed_tokens
    assert untied.get_encoder().embed_tokens.weight is not untied.get_decoder().embed_tokens.weight

    model.save_pretrained(tmp_path)  # shared embeddings, loaded with share_encoder_decoder_embeddings=False
    loaded = model_class.from_pretrained(tmp_path, share_encoder_decoder_embeddings=False)
    assert not loaded.config.share_encoder_decoder_embeddings
    encoder, decoder = loaded.get_encoder().embed_tokens, loaded.get_decoder().embed_tokens
    assert encoder is not decoder and encoder.weight is not decoder.weight
    shared = model.get_encoder().embed_tokens.weight
    assert torch.equal(encoder.weight, shared) and torch.equal(decoder.weight, shared)  # copies, not random


# Untying --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [dict(share_encoder_decoder_embeddings=False), dict(tie_word_embeddings=False),
                                   dict(share_encoder_decoder_embeddings=False, tie_word_embeddings=False)],
                         ids=["unshared", "untied-head", "both"])
def test_untying_on_load_copies_the_shared_matrix_and_keeps_the_tokens(saved, flags):
    model, folder = saved
    expected = _generate(model)
    loaded = VaswaniForConditionalGeneration.from_pretrained(folder, **flags)
    shared = model.model.shared.weight
    encoder, decoder = loaded.model.encoder.embed_tokens.weight, loaded.model.decoder.embed_tokens.weight
    head = loaded.lm_head.weight
    for weight in (encoder, decoder, head):
        assert torch.equal(weight, shared)
    assert (encoder is decoder) == flags.get("share_encoder_decoder_embeddings", True)
    assert (decoder is head) == flags.get("tie_word_embeddings", True)
    assert torch.equal(_generate(loaded), expected)
    assert torch.equal(_generate(loaded, num_beams=1, do_sample=False), _generate(model, num_beams=1, do_sample=False))

    # The copies train apart: a step on the output projection leaves an untied decoder embedding alone.
    loaded.train()
    ids, mask = padded_batch(length=9)
    loaded(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask.eq(0), -100)).loss.backward()
    with torch.no_grad():
        for parameter in loaded.parameters():
            if parameter.grad is not None:
                parameter.sub_(parameter.grad)
    still_equal = torch.equal(loaded.lm_head.weight, loaded.model.decoder.embed_tokens.weight)
    assert still_equal == flags.get("tie_word_embeddings", True)


def test_an_untied_model_saves_every_matrix_and_reloads_strictly(saved, tmp_path):
    model, folder = saved
    loaded = VaswaniForConditionalGeneration.from_pretrained(folder, share_encoder_decoder_embeddings=False,
                                                            tie_word_embeddings=False)
    loaded.save_pretrained(tmp_path / "untied")
    names = set(load_file(tmp_path / "untied" / "model.safetensors"))
    assert {"model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight"} <= names
    assert "model.shared.weight" not in names
    again = VaswaniForConditionalGeneration.from_pretrained(tmp_path / "untied")  # no keywords: its own config
    assert not again.config.share_encoder_decoder_embeddings and not again.config.tie_word_embeddings
    assert torch.equal(_generate(again), _generate(model))


def test_untying_through_the_auto_class_and_a_config(saved):
    model, folder = saved
    auto = AutoModelForSeq2SeqLM.from_pretrained(folder, share_encoder_decoder_embeddings=False)
    assert auto.model.encoder.embed_tokens is not auto.model.decoder.embed_tokens
    config = VaswaniConfig.from_pretrained(folder, tie_word_embeddings=False)
    given = VaswaniForConditionalGeneration.from_pretrained(folder, config=config)
    assert given.lm_head.weight is not given.model.shared.weight
    for loaded in (auto, given):
        assert torch.equal(loaded.lm_head.weight, model.model.shared.weight)
        assert torch.equal(_generate(loaded), _generate(model))


def test_a_base_model_unties_from_the_full_models_folder(saved):
    model, folder = saved
    base = VaswaniModel.from_pretrained(folder, share_encoder_decoder_embeddings=False)
    assert base.encoder.embed_tokens is not base.decoder.embed_tokens
    assert torch.equal(base.decoder.embed_tokens.weight, model.model.shared.weight)


def test_untying_needs_the_shared_matrix_in_the_file(saved):
    _, folder = saved
    state = load_file(folder / "model.safetensors")
    del state["model.shared.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors: missing 2 weight\(s\) of the model "
                                         r"\(model\.decoder\.embed_tokens\.weight, model\.encoder\.embed_tokens"):
        VaswaniForConditionalGeneration.from_pretrained(folder, share_encoder_decoder_embeddings=False)


# Offload with device_map ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["disk", "auto"])
def test_offloaded_models_load_and_generate_the_in_memory_tokens(saved, tmp_path, placement):
    pytest.importorskip("accelerate", reason="device_map needs accelerate")
    model, folder = saved
    # "auto" with a CPU budget smaller than the model (~100 kB) places most layers on disk
    device_map = {"": "disk"} if placement == "disk" else "auto"
    budget = {} if placement == "disk" else dict(max_memory={"cpu": 20_000})
    loaded = VaswaniForConditionalGeneration.from_pretrained(folder, device_map=device_map,
                                                            offload_folder=tmp_path / "offload", **budget)
    devices = {parameter.device.type for parameter in loaded.parameters()}
    assert "meta" in devices  # offloaded: the weights are read from disk as each layer runs
    for settings in (dict(), dict(num_beams=1, do_sample=False)):
        assert torch.equal(_generate(loaded, **settings), _generate(model, **settings))


def test_offloading_an_untied_load_keeps_the_tokens(saved, tmp_path):
    pytest.importorskip("accelerate", reason="device_map needs accelerate")
    model, folder = saved
    loaded = VaswaniForConditionalGeneration.from_pretrained(folder, share_encoder_decoder_embeddings=False,
                                                            device_map={"": "disk"}, offload_folder=tmp_path / "o")
    assert torch.equal(_generate(loaded), _generate(model))


def test_offloading_still_refuses_a_missing_tensor(saved, tmp_path):
    pytest.importorskip("accelerate", reason="device_map needs accelerate")
    _, folder = saved
    state = load_file(folder / "model.safetensors")
    del state["model.decoder.layers.1.fc2.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 weight\(s\) of the model \(model\.decoder\.layers\.1\.fc2"):
        VaswaniForConditionalGeneration.from_pretrained(folder, device_map={"": "disk"},
                                                        offload_folder=tmp_path / "offload")


# The strict weight check ----------------------------------------------------------------------------------------------


def test_a_missing_or_foreign_tensor_is_refused_naming_the_file_and_not_called_damage(saved):
    _, folder = saved
    file = folder / "model.safetensors"
    state = load_file(file)
    for change, pattern in (
        (lambda s: s.pop("model.encoder.layers.0.self_attn.k_proj.bias"),
         r"missing 1 weight\(s\) of the model \(model\.encoder\.layers\.0\.self_attn\.k_proj\.bias\)"),
        (lambda s: s.update({"model.encoder.layers.9.fc1.weight": torch.zeros(2, 2)}),
         r"1 unexpected weight\(s\) \(model\.encoder\.layers\.9\.fc1\.weight\)"),
    ):
        changed = dict(state)
        change(changed)
        save_file(changed, file, metadata={"format": "pt"})
        with pytest.raises(ValueError, match=pattern) as error:
            VaswaniForConditionalGeneration.from_pretrained(folder)
        message = str(error.value)
        assert message.startswith(str(file)) and "damaged" not in message and "corrupted" not in message
        assert "saved from another model" in message


def test_a_truncated_weights_file_is_called_truncated(saved):
    _, folder = saved
    file = folder / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(OSError, match="truncated or corrupted"):
        VaswaniForConditionalGeneration.from_pretrained(folder)


# generation_config.json ----------------------------------------------------------------------------------------------


def test_a_truncated_generation_config_is_refused_naming_the_file(saved):
    _, folder = saved
    file = folder / "generation_config.json"
    text = file.read_text()
    assert json.loads(text)["num_beams"] == 4
    file.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=rf"{file}: not a readable generation config .*truncated"):
        VaswaniForConditionalGeneration.from_pretrained(folder)
    file.write_text(text)
    assert VaswaniForConditionalGeneration.from_pretrained(folder).generation_config.num_beams == 4


@pytest.mark.parametrize("field,value,expected", [
    ("num_beams", "4", "an integer >= 1"), ("length_penalty", "x", "a finite number"),
    ("max_length", 3.5, "an integer"), ("do_sample", "no", "true or false"),
    ("early_stopping", "yes", 'true, false or "never"'), ("eos_token_id", [2, "3"], "a token id"),
])
def test_a_generation_config_value_of_the_wrong_type_is_refused_naming_the_field(saved, field, value, expected):
    _, folder = saved
    file = folder / "generation_config.json"
    settings = json.loads(file.read_text())
    settings[field] = value
    file.write_text(json.dumps(settings))
    with pytest.raises(ValueError, match=rf"{re.escape(str(file))}: {field} must be {re.escape(expected)}.*, got "
                                         rf"{re.escape(repr(value))}"):
        VaswaniForConditionalGeneration.from_pretrained(folder)


def test_generate_refuses_settings_of_the_wrong_type_naming_them():
    model = tiny_model()
    for field, value in (("length_penalty", "x"), ("max_new_tokens", "3"), ("temperature", float("nan")),
                         ("top_k", 2.0), ("num_beams", "4")):
        with pytest.raises(ValueError, match=rf"generate\(\): {field} must be"):
            _generate(model, **{field: value})
    model.generation_config.length_penalty = "0.6"  # set on the model's config
    with pytest.raises(ValueError, match=r"generate\(\): the generation config \(generation_config\): length_penalty "
                                         r"must be a finite number, got '0.6'"):
        _generate(model)
    model.generation_config.length_penalty = 0.6
    assert _generate(model).shape == (3, 9)


# Weights only from safetensors: nothing of ours unpickles -------------------------------------------------------------


def calls(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
                yield f"{func.value.id}.{func.attr}", node
            elif isinstance(func, ast.Name):
                yield func.id, node


def test_no_code_of_ours_unpickles():
    sources = [*(ROOT / "vaswani_hf").rglob("*.py"), *(ROOT / "training").rglob("*.py")]
    assert len(sources) > 10
    offending = []
    for path in sources:
        for name, node in calls(path):
            allow_pickle = any(k.arg == "allow_pickle" for k in node.keywords)
            if name in ("torch.load", "pickle.load", "pickle.loads", "dill.load", "joblib.load") or allow_pickle:
                offending.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
        text = path.read_text(encoding="utf-8")
        if "import pickle" in text or "from pickle" in text:
            offending.append(f"{path.relative_to(ROOT)}: imports pickle")
    assert offending == []


def test_pickled_weights_are_not_loaded_unless_asked_for(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(OSError, match="no file named model.safetensors"):
        VaswaniForConditionalGeneration.from_pretrained(tmp_path)
    # An explicit opt-out still works (transformers then uses torch.load(weights_only=True)).
    loaded = VaswaniForConditionalGeneration.from_pretrained(tmp_path, use_safetensors=False)
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)
