"""Registration with the Auto classes, and loading a saved folder as remote code where vaswani_hf is not importable:
the folder's code is exactly the model's code files, importing nothing but torch, transformers, safetensors and each
other."""

import ast
import json
import sys
from pathlib import Path

import torch
from helpers import (
    assert_loaded_as_remote_code,
    padded_batch,
    printed_result,
    remote_code_script,
    run_without_vaswani_hf,
    save_model_folder,
    tiny_model,
)
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM, AutoTokenizer, PreTrainedTokenizerFast

import vaswani_hf
from vaswani_hf import VaswaniConfig, VaswaniForConditionalGeneration, VaswaniModel

CODE_FILES = ("configuration_vaswani.py", "fast_paths_vaswani.py", "generation_vaswani.py", "inputs_vaswani.py",
              "kernels_vaswani.py", "loading_vaswani.py", "modeling_vaswani.py")


def test_importing_the_package_registers_the_auto_classes(tmp_path, tiny_tokenizer):
    assert isinstance(AutoConfig.for_model("vaswani", d_model=64, num_heads=2), VaswaniConfig)
    config = tiny_model().config
    assert type(AutoModel.from_config(config)) is VaswaniModel
    assert type(AutoModelForSeq2SeqLM.from_config(config)) is VaswaniForConditionalGeneration
    # AutoTokenizer: a folder whose config says "vaswani" gets the fast tokenizer
    config.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert tokenizer("Zwei Hunde").input_ids == tiny_tokenizer("Zwei Hunde").input_ids


def test_saved_folder_carries_auto_map_and_the_code_files(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForSeq2SeqLM"}
    package = Path(vaswani_hf.__file__).parent
    assert {p.name for p in tmp_path.glob("*.py")} == set(CODE_FILES)
    for name in CODE_FILES:
        assert (tmp_path / name).read_text() == (package / name).read_text()
    # the model code names nothing of this package: it imports the other code files by relative imports
    for name in CODE_FILES:
        if name != "configuration_vaswani.py":  # whose docstring shows `from vaswani_hf import VaswaniConfig`
            assert "vaswani_hf" not in (tmp_path / name).read_text()


# Run by `run_without_vaswani_hf` from the saved folder's parent.
REMOTE_SCRIPT = remote_code_script(
    """
    inputs = torch.load(folder + "/inputs.pt")
    with torch.no_grad():
        logits = model(**inputs).logits
        hidden = base(**inputs).last_hidden_state
    generated = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                               max_new_tokens=5)
    torch.save({"logits": logits, "hidden": hidden, "generated": generated}, folder + "/outputs.pt")
    result["tokens"] = tokenizer("Zwei Hunde").input_ids
    """
)


def test_folder_loads_as_remote_code_without_the_package(tmp_path, tiny_tokenizer):
    folder = tmp_path / "checkpoint"
    model = tiny_model(vocab_size=len(tiny_tokenizer))
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    ids, mask = padded_batch(length=9, vocab=len(tiny_tokenizer))
    inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.randint(4, 99, (3, 6)))
    torch.save(inputs, folder / "inputs.pt")
    with torch.no_grad():
        expected = model(**inputs)
    expected_generation = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5)

    result = printed_result(run_without_vaswani_hf(REMOTE_SCRIPT, folder, cwd=tmp_path, hf_home=tmp_path / "hf_home"))
    assert_loaded_as_remote_code(result)
    assert result["tokens"] == tiny_tokenizer("Zwei Hunde").input_ids
    outputs = torch.load(folder / "outputs.pt")
    assert torch.equal(outputs["logits"], expected.logits)
    torch.testing.assert_close(outputs["hidden"] @ model.model.shared.weight.T, expected.logits)
    assert torch.equal(outputs["generated"], expected_generation)


def test_a_saved_folder_holds_exactly_the_remote_code_files(tmp_path, tiny_tokenizer):
    save_model_folder(tmp_path, tiny_tokenizer)
    assert {p.name for p in tmp_path.glob("*.py")} == set(CODE_FILES)
    assert {p.name for p in tmp_path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".pickle")} == set()
    assert (tmp_path / "model.safetensors").is_file()
    # The weights file is safetensors: an 8-byte header length, then a JSON header.
    assert (tmp_path / "model.safetensors").read_bytes()[8:9] == b"{"


def test_the_remote_code_imports_only_the_standard_library_torch_and_transformers():
    package = Path(vaswani_hf.__file__).parent
    # safetensors is a dependency of transformers itself; the rest are the shipped code files
    allowed = {"torch", "transformers", "safetensors"} | {Path(name).stem for name in CODE_FILES} \
        | set(sys.stdlib_module_names)
    for name in CODE_FILES:
        imported = set()
        for node in ast.walk(ast.parse((package / name).read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add((node.module or "configuration_vaswani").split(".")[0])
        assert imported <= allowed, (name, imported - allowed)
