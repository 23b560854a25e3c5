"""Registration with the Auto classes, and loading a saved folder as remote code where vaswani_hf is not importable."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from conftest import make_tiny_model, padded_batch
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM, AutoTokenizer, PreTrainedTokenizerFast

import vaswani_hf
from vaswani_hf import VaswaniConfig, VaswaniForConditionalGeneration, VaswaniModel

CODE_FILES = ("configuration_vaswani.py", "generation_vaswani.py", "kernels_vaswani.py", "loading_vaswani.py",
              "modeling_vaswani.py")


def test_importing_the_package_registers_the_auto_classes(tmp_path, tiny_tokenizer):
    assert isinstance(AutoConfig.for_model("vaswani", d_model=64, num_heads=2), VaswaniConfig)
    config = make_tiny_model().config
    assert type(AutoModel.from_config(config)) is VaswaniModel
    assert type(AutoModelForSeq2SeqLM.from_config(config)) is VaswaniForConditionalGeneration
    # AutoTokenizer: a folder whose config says "vaswani" gets the fast tokenizer
    config.save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert tokenizer("Zwei Hunde").input_ids == tiny_tokenizer("Zwei Hunde").input_ids


def test_saved_folder_carries_auto_map_and_the_code_files(tmp_path):
    make_tiny_model().save_pretrained(tmp_path)
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


# Runs with `python -I` (no PYTHONPATH, no user site, no current directory on sys.path) from the saved folder's
# parent, with a meta-path finder that refuses vaswani_hf even if it were installed.
REMOTE_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "vaswani_hf" or name.startswith("vaswani_hf."):
                raise ImportError("vaswani_hf is hidden in this test")

    sys.meta_path.insert(0, Refuse())
    # Drop the checkout itself (not paths below it: CI's virtual environment lives in the checkout's .venv).
    sys.path = [p for p in sys.path if p not in ("", ".") and p.rstrip("/") != sys.argv[2].rstrip("/")]
    result = {}
    try:
        import vaswani_hf  # noqa: F401
        result["import_vaswani_hf"] = "succeeded"
    except ImportError:
        result["import_vaswani_hf"] = "failed"

    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM, AutoTokenizer

    folder = sys.argv[1]
    for name, auto in (("config", AutoConfig), ("model", AutoModelForSeq2SeqLM)):
        try:
            auto.from_pretrained(folder)
            result["refused_without_flag_" + name] = False
        except Exception as error:  # with no terminal to ask, a ValueError asking for trust_remote_code=True
            result["refused_without_flag_" + name] = "trust_remote_code" in str(error)

    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
    base = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    inputs = torch.load(folder + "/inputs.pt")
    with torch.no_grad():
        logits = model(**inputs).logits
        hidden = base(**inputs).last_hidden_state
    generated = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                               max_new_tokens=5)
    torch.save({"logits": logits, "hidden": hidden, "generated": generated}, folder + "/outputs.pt")
    result.update(
        config_class=type(config).__module__ + "." + type(config).__name__,
        model_class=type(model).__module__ + "." + type(model).__name__,
        base_class=type(base).__name__,
        tied=model.lm_head.weight is model.model.shared.weight,
        tokens=tokenizer("Zwei Hunde").input_ids,
        loaded_modules=sorted(m for m in sys.modules if m.startswith("vaswani_hf")),
    )
    print("RESULT=" + json.dumps(result))
    """
)


def test_folder_loads_as_remote_code_without_the_package(tmp_path, tiny_tokenizer):
    folder = tmp_path / "checkpoint"
    model = make_tiny_model(vocab_size=len(tiny_tokenizer))
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    ids, mask = padded_batch(length=9, vocab=len(tiny_tokenizer))
    inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.randint(4, 99, (3, 6)))
    torch.save(inputs, folder / "inputs.pt")
    with torch.no_grad():
        expected = model(**inputs)
    expected_generation = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5)

    repo_root = os.path.dirname(os.path.dirname(os.path.abspath(vaswani_hf.__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    completed = subprocess.run(
        [sys.executable, "-I", "-c", REMOTE_SCRIPT, str(folder), repo_root],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout.split("RESULT=")[-1])
    assert result["import_vaswani_hf"] == "failed"
    assert result["loaded_modules"] == []
    assert result["refused_without_flag_config"] is True
    assert result["refused_without_flag_model"] is True
    assert result["config_class"].startswith("transformers_modules.")
    assert result["config_class"].endswith("configuration_vaswani.VaswaniConfig")
    assert result["model_class"].endswith("modeling_vaswani.VaswaniForConditionalGeneration")
    assert result["base_class"] == "VaswaniModel"
    assert result["tied"] is True
    assert result["tokens"] == tiny_tokenizer("Zwei Hunde").input_ids
    outputs = torch.load(folder / "outputs.pt")
    assert torch.equal(outputs["logits"], expected.logits)
    torch.testing.assert_close(outputs["hidden"] @ model.model.shared.weight.T, expected.logits)
    assert torch.equal(outputs["generated"], expected_generation)
