"""Safe loading: weights only from safetensors, nothing of ours unpickles, and the remote code of a saved folder is
exactly the model's code files, importing nothing but torch, transformers, safetensors and each other.

Trainer's own checkpoint files (optimizer.pt, scheduler.pt, rng_state.pth) are torch.save pickles that transformers
reads on --resume_from_checkpoint; they are written by our own run, not downloaded, and not part of a model folder.
"""

import ast
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, tiny_model

import vaswani_hf
from vaswani_hf import VaswaniForConditionalGeneration

REMOTE_CODE = {"configuration_vaswani.py", "generation_vaswani.py", "kernels_vaswani.py", "loading_vaswani.py",
               "modeling_vaswani.py"}


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


def test_a_saved_folder_holds_exactly_the_remote_code_files(tmp_path, tiny_tokenizer):
    tiny_model(vocab_size=len(tiny_tokenizer)).save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.glob("*.py")} == REMOTE_CODE
    assert {p.name for p in tmp_path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".pickle")} == set()
    assert (tmp_path / "model.safetensors").is_file()
    # The weights file is safetensors: an 8-byte header length, then a JSON header.
    assert (tmp_path / "model.safetensors").read_bytes()[8:9] == b"{"


def test_the_remote_code_imports_only_the_standard_library_torch_and_transformers():
    package = Path(vaswani_hf.__file__).parent
    # safetensors is a dependency of transformers itself; the rest are the shipped code files
    allowed = {"torch", "transformers", "safetensors"} | {Path(name).stem for name in REMOTE_CODE} \
        | set(sys.stdlib_module_names)
    for name in REMOTE_CODE:
        imported = set()
        for node in ast.walk(ast.parse((package / name).read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add((node.module or "configuration_vaswani").split(".")[0])
        assert imported <= allowed, (name, imported - allowed)


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
