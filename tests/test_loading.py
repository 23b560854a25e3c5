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
import shutil
import struct
from pathlib import Path

import pytest
import torch
from helpers import ROOT, evaluate_cli, exits_with, padded_batch, tiny_config, tiny_model, translate_cli, write
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSeq2SeqLM, BartConfig, BartForConditionalGeneration, MarianConfig, MarianMTModel

from vaswani_hf import VaswaniConfig, VaswaniForConditionalGeneration, VaswaniModel
from vaswani_hf.checks import CheckError, check_model_folder, read_json, safetensors_problem
from vaswani_hf.decoding.translate import translate_sentences

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
    for decoding in (dict(), dict(num_beams=1, do_sample=False)):
        assert torch.equal(_generate(loaded, **decoding), _generate(model, **decoding))


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
    ("length_penalty", 512.0, "a number from -20 to 20"), ("length_penalty", -21, "a number from -20 to 20"),
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


def test_a_generation_config_without_a_start_token_is_refused_naming_the_file(saved):
    """Neither decoder_start_token_id nor bos_token_id: transformers' generate() would fail on its first step; one of
    them is enough."""
    _, folder = saved
    file = folder / "generation_config.json"
    settings = json.loads(file.read_text())
    for name in ("decoder_start_token_id", "bos_token_id"):
        settings.pop(name, None)
    file.write_text(json.dumps(settings))
    with pytest.raises(ValueError, match=rf"{re.escape(str(file))}: no decoder_start_token_id \(nor bos_token_id\)"):
        VaswaniForConditionalGeneration.from_pretrained(folder)
    file.write_text(json.dumps({**settings, "bos_token_id": 1}))
    assert VaswaniForConditionalGeneration.from_pretrained(folder).generation_config.bos_token_id == 1


def test_generate_refuses_settings_of_the_wrong_type_naming_them():
    model = tiny_model()
    for field, value in (("length_penalty", "x"), ("max_new_tokens", "3"), ("temperature", float("nan")),
                         ("top_k", 2.0), ("num_beams", "4"), ("length_penalty", 512.0)):
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


# Damaged or incomplete model folders are refused, naming the file -----------------------------------------------------


def _save_without_shared_embedding(folder, cls):
    """A saved tiny `cls` whose model.safetensors lacks the shared embedding; returns (path, weights, shared name)."""
    from safetensors.torch import load_file, save_file

    cls(tiny_config()).save_pretrained(folder)
    path = folder / "model.safetensors"
    weights = load_file(path)
    shared = next(name for name in weights if name.endswith("shared.weight"))
    save_file({k: v for k, v in weights.items() if k != shared}, path, metadata={"format": "pt"})
    return path, weights, shared


@pytest.mark.parametrize("cls", [VaswaniForConditionalGeneration, VaswaniModel])
def test_missing_or_unexpected_weights_are_refused_naming_the_file(tmp_path, cls):
    from safetensors.torch import save_file

    path, weights, shared = _save_without_shared_embedding(tmp_path, cls)
    with pytest.raises(ValueError, match=re.escape(f"{path}: missing") + f".*{re.escape(shared)}"):
        cls.from_pretrained(tmp_path)
    save_file({**weights, "extra.weight": torch.zeros(3)}, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": 1 unexpected weight\(s\) \(extra.weight\)"):
        cls.from_pretrained(tmp_path)
    save_file(weights, path, metadata={"format": "pt"})
    assert isinstance(cls.from_pretrained(tmp_path), cls)


@pytest.mark.parametrize("cls", [VaswaniForConditionalGeneration, VaswaniModel])
def test_output_loading_info_reports_a_missing_shared_embedding_and_initializes_it(tmp_path, cls):
    """With `output_loading_info=True` the caller checks the missing names: the shared embedding (tied by sharing
    one module) is among them, and initialized as a new model's, not left on the meta device."""
    _, _, shared = _save_without_shared_embedding(tmp_path, cls)
    model, info = cls.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] and shared in set(info["missing_keys"])
    embedding = model.get_input_embeddings().weight
    assert embedding.device.type == "cpu" and bool(torch.isfinite(embedding).all())
    assert 0.5 < float(embedding.std()) * model.config.d_model**0.5 < 2  # N(0, d_model^-1/2), §3.4's scale
    tied = {n for n in model.state_dict() if "embed_tokens" in n or "lm_head" in n}
    assert set(info["missing_keys"]) - {shared} <= tied


def test_an_unexpected_safetensors_header_is_reported_not_a_crash(tmp_path):
    for header in ({"w": {"dtype": "F32", "shape": [1]}}, {"w": "nonsense"}, {"w": {"data_offsets": [4, 0]}}, [1, 2]):
        data = json.dumps(header).encode()
        path = tmp_path / "model.safetensors"
        path.write_bytes(struct.pack("<Q", len(data)) + data)
        assert "unreadable header" in safetensors_problem(path)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_a_truncated_json_file_of_a_model_folder_is_named(model_folder, tmp_path, name):
    path = model_folder / name
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(CheckError, match=re.escape(f"{path}: not valid JSON")):
        check_model_folder(model_folder)
    source = tmp_path / "in.de"
    source.write_text("Ein Hund.\n", encoding="utf-8")
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source), re.escape(f"{path}: not valid JSON"))


def test_read_json_names_the_file(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"a": ')
    with pytest.raises(CheckError, match=re.escape(f"{path}: not valid JSON")):
        read_json(path)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, tiny_tokenizer):
    """A saved model folder and its translations of two sentences."""
    folder = tmp_path_factory.mktemp("pristine") / "model"
    model = tiny_model(vocab_size=len(tiny_tokenizer))
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    sentences = ["Ein Hund läuft.", "Zwei Kinder spielen im Park."]
    return folder, sentences, translate_sentences(model, tiny_tokenizer, sentences, num_beams=2, max_new_tokens=6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_damaged_file_of_a_model_folder_is_named_or_changes_nothing(pristine, tmp_path, data):
    """Each file of a model folder truncated at any length or overwritten with arbitrary bytes: the command's check and
    load either refuse it with an error naming that file, or translate exactly as before."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer


    source, sentences, expected = pristine
    folder = tmp_path / "damaged"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(source, folder)
    name = data.draw(st.sampled_from(sorted(p.name for p in folder.iterdir() if p.is_file())), label="file")
    path = folder / name
    original = path.read_bytes()
    if data.draw(st.booleans(), label="truncate"):
        damaged = original[: data.draw(st.integers(0, len(original) - 1), label="keep")]
    else:
        damaged = data.draw(st.binary(max_size=64), label="bytes")
    path.write_bytes(damaged)
    try:
        check_model_folder(folder)
        model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as error:  # noqa: BLE001 - the property: whatever the error, it names the file
        assert name in str(error), f"{type(error).__name__} does not name {name}: {error}"
        event("refused, naming the file")
        return
    event("loaded: identical translations required")
    assert translate_sentences(model, tokenizer, sentences, num_beams=2, max_new_tokens=6) == expected


@pytest.fixture
def foreign_folders(tmp_path, tiny_tokenizer):
    """A tiny BART and a tiny Marian model, built locally, saved with a tokenizer."""
    sizes = dict(vocab_size=len(tiny_tokenizer), d_model=16, encoder_layers=1, decoder_layers=1,
                 encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                 max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 decoder_start_token_id=1)
    folders = {"bart": tmp_path / "bart", "marian": tmp_path / "marian"}
    BartForConditionalGeneration(BartConfig(**sizes)).save_pretrained(folders["bart"])
    MarianMTModel(MarianConfig(**sizes)).save_pretrained(folders["marian"])
    for folder in folders.values():
        tiny_tokenizer.save_pretrained(folder)
    return folders


@pytest.mark.parametrize(("model_type", "architecture"), [("bart", "BartForConditionalGeneration"),
                                                          ("marian", "MarianMTModel")])
def test_a_folder_of_another_model_type_is_refused(foreign_folders, tmp_path, model_type, architecture):
    folder = foreign_folders[model_type]
    # transformers alone only warns, then fails deep inside (Marian) or loads none of the weights (BART).
    for load in (VaswaniForConditionalGeneration.from_pretrained, VaswaniConfig.from_pretrained):
        with pytest.raises(ValueError, match=re.escape(f"{folder / 'config.json'}: model_type is "
                                                       f"'{model_type}' ({architecture}), not 'vaswani'")):
            load(folder)
    # The commands would otherwise load it with AutoModelForSeq2SeqLM and translate as a different model.
    expected = re.escape(f"{folder / 'config.json'}: model_type is '{model_type}' ({architecture}), not 'vaswani'")
    source = write(tmp_path / "in.de", "Ein Hund.\n")
    exits_with(lambda: translate_cli("--model", folder, "--input", source), expected)
    exits_with(lambda: evaluate_cli("--model", folder, "--max_test_samples", 2), expected)
    exits_with(lambda: translate_cli("--model", tmp_path / "nowhere", "--input", source),
               "is not a saved model folder \\(no config.json\\)")


@pytest.mark.parametrize("keep", [0, 4, 20, "half", "minus_one"])
def test_a_truncated_weights_file_is_refused(model_folder, tmp_path, keep):
    weights = model_folder / "model.safetensors"
    size = weights.stat().st_size
    keep = {"half": size // 2, "minus_one": size - 1}.get(keep, keep)
    with open(weights, "r+b") as handle:
        handle.truncate(keep)
    for load in (VaswaniForConditionalGeneration.from_pretrained, AutoModelForSeq2SeqLM.from_pretrained):
        with pytest.raises(OSError, match=re.escape(f"{model_folder}: the weights file (model.safetensors) cannot be "
                                                    f"read") + ".*truncated or corrupted"):
            load(model_folder)
    source = write(tmp_path / "in.de", "Ein Hund.\n")
    exits_with(lambda: translate_cli("--model", model_folder, "--input", source),
               re.escape(f"{model_folder}: the weights cannot be used (model.safetensors is truncated"),
               "copy it again or use another checkpoint")


def test_weights_with_nan_bytes_are_refused(model_folder):
    # safetensors has no checksum: bytes overwritten in place (same length) load without complaint in transformers.
    weights = model_folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = b"\xff" * 64  # float32 0xffffffff is NaN
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=re.escape(f"{model_folder}: weight ") + r".* holds NaN or infinite values"):
        VaswaniForConditionalGeneration.from_pretrained(model_folder)


# Folders written by earlier releases ------------------------------------------------------------------------------

EARLIER = ROOT / "tests" / "data" / "checkpoint_3323448"


def seeded_weight(name: str, shape: list[int], index: int) -> torch.Tensor:
    """The value of weight `index` (in sorted order) of the earlier release's folder: drawn from a fixed seed, with
    LayerNorm gains near 1, so that its translations vary (what the release wrote of it is the names and shapes)."""
    values = torch.randn(*shape, generator=torch.Generator().manual_seed(1000 + index))
    if "layer_norm" in name:
        return (1.0 if name.endswith("weight") else 0.0) + 0.1 * values
    return values * (shape[-1] ** -0.5 if len(shape) == 2 else 0.1)


def test_a_folder_written_by_an_earlier_release_loads_and_translates_as_that_release_did(tmp_path):
    """A model folder as release 3323448 wrote it: its config.json (with that release's `label_smoothing` field) and
    generation_config.json verbatim, the tensors its model.safetensors held (names and shapes; the values drawn from
    fixed seeds). It loads, and greedy and beam search give the tokens that release gave, its logits its sums."""
    expected = json.loads((EARLIER / "expected.json").read_text())
    for name in ("config.json", "generation_config.json"):
        shutil.copy(EARLIER / name, tmp_path / name)
    weights = {name: seeded_weight(name, shape, index)
               for index, (name, shape) in enumerate(sorted(expected["weights"].items()))}
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = VaswaniForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert not hasattr(model.config, "label_smoothing")
    ids = torch.tensor(expected["inputs"]["input_ids"])
    mask = ids.ne(0).long()
    with torch.no_grad():
        beam = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10)
        greedy = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, num_beams=1)
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=beam[:, :-1]).logits.double()
    assert beam.tolist() == expected["beam_4"] and greedy.tolist() == expected["greedy"]
    assert beam.tolist() != greedy.tolist()  # beam search made a choice of its own
    assert float(logits.sum()) == pytest.approx(expected["logits_sum"], rel=1e-5)
    assert float(logits.abs().sum()) == pytest.approx(expected["logits_abs_sum"], rel=1e-5)
    # control: one weight off by its own scale changes the logits far beyond the tolerance
    weights["model.encoder.layers.0.fc1.weight"] = weights["model.encoder.layers.0.fc1.weight"] * 2
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    changed = VaswaniForConditionalGeneration.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        other = changed(input_ids=ids, attention_mask=mask, decoder_input_ids=beam[:, :-1]).logits.double()
    assert float(other.abs().sum()) != pytest.approx(expected["logits_abs_sum"], rel=1e-3)
