"""Every door that loads a saved model folder runs one check of it first (`vaswani_hf.checks.check_model_folder`):
vaswani-translate, vaswani-evaluate, vaswani-demo's loader, the exported Space's loader, vaswani-publish,
vaswani-convert-ct2, vaswani-average and vaswani-train --model_name_or_path; `from_pretrained` refuses what concerns the
model (config.json, generation_config.json, the weights) with the same checks.

A tiny model is saved once per module; each test copies it, breaks one thing (a file deleted, truncated, emptied or
not UTF-8, a config field removed or of the wrong type, another model's tokenizer, a garbled generation_config.json)
and runs every door on it: each ends with a non-zero exit and one message naming the file (or field) at fault, and
writes nothing. Also here: what a run records and publishes of local data, the one-layer demo page, and the Space's
loading with the trust it is given.
"""

import json
import math
import re
import shutil
from pathlib import Path

import pytest
from helpers import GERMAN, listing, run_without_vaswani_hf, save_model_folder, write_parallel
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from vaswani_hf import VaswaniForConditionalGeneration, train_joint_bpe
from vaswani_hf.checks import CheckError, check_model_folder
from vaswani_hf.inputs_vaswani import REQUIRED_CONFIG_FIELDS

CODE_FILES = ("configuration_vaswani.py", "fast_paths_vaswani.py", "generation_vaswani.py", "inputs_vaswani.py",
              "kernels_vaswani.py", "loading_vaswani.py", "modeling_vaswani.py")
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors")  # what from_pretrained reads
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_tokenizer):
    """The tiny model saved once with its tokenizer, and another model's tokenizer (another BPE, another size)."""
    root = tmp_path_factory.mktemp("doors")
    folder = save_model_folder(root / "model", tiny_tokenizer)
    other = train_joint_bpe([GERMAN[::-1], GERMAN], vocab_size=300, min_frequency=1)
    other.save_pretrained(root / "other-tokenizer")
    write_parallel(root / "data", name="test")
    (root / "data" / "in.de").write_text(GERMAN[4] + "\n", encoding="utf-8")
    return folder, root


# The mutations: what may happen to a folder (each a function of the copy and the module's root) --------------------


def _json_edit(name, change):
    def mutate(folder, root):
        path = folder / name
        values = json.loads(path.read_text(encoding="utf-8"))
        change(values)
        path.write_text(json.dumps(values), encoding="utf-8")
    return mutate


def _set(name, key, value):
    return _json_edit(name, lambda values: values.__setitem__(key, value))


def _delete(name):
    return lambda folder, root: (folder / name).unlink()


def _truncate(name):
    return lambda folder, root: (folder / name).write_bytes((folder / name).read_bytes()[:(folder / name).stat().st_size
                                                                                      // 2])


def _empty(name):
    return lambda folder, root: (folder / name).write_bytes(b"")


def _latin1(name):  # the file re-encoded as Latin-1 after a non-ASCII value: not UTF-8
    return lambda folder, root: (folder / name).write_bytes(
        (folder / name).read_bytes().replace(b"{", '{"note": "Größe", '.encode("latin-1"), 1))


def _swap_tokenizer(folder, root):
    for name in TOKENIZER_FILES:
        shutil.copy(root / "other-tokenizer" / name, folder / name)


# A wrong-typed value per field, by the type the field has: a string for numbers and flags, a number for strings.
WRONG_TYPE = {"activation_function": 3, "position_embedding_type": 1.5, "normalize_before": "false",
              "share_encoder_decoder_embeddings": "no", "tie_word_embeddings": 1, "scale_embedding": "true",
              "target_vocab_size": "420", "layer_norm_eps": "1e-5", "dropout": [0.1], "attention_dropout": "0",
              "activation_dropout": {"p": 0}}


def _wrong_type(field):
    return WRONG_TYPE.get(field, "8")


# (id, mutation, file the message must name, words it must hold); every door refuses these.
REFUSED = [
    *[(f"delete-{name}", _delete(name), name, words) for name, words in (
        ("config.json", "no config.json"), ("model.safetensors", "model.safetensors is missing"),
        ("tokenizer.json", "no tokenizer.json"),
        ("tokenizer_config.json", "no such file; it names the tokenizer's padding, start and end tokens"))],
    *[(f"truncate-{name}", _truncate(name), name, "") for name in (*MODEL_FILES, *TOKENIZER_FILES)],
    *[(f"empty-{name}", _empty(name), name, "") for name in (*MODEL_FILES, *TOKENIZER_FILES)],
    *[(f"latin1-{name}", _latin1(name), name, "UTF-8") for name in ("config.json", "generation_config.json",
                                                                   *TOKENIZER_FILES)],
    ("config-a-list", lambda folder, root: (folder / "config.json").write_text("[]"), "config.json", "JSON object"),
    ("generation-a-list", lambda folder, root: (folder / "generation_config.json").write_text("[4]"),
     "generation_config.json", "JSON object"),
    ("tokenizer-config-a-string", lambda folder, root: (folder / "tokenizer_config.json").write_text('"x"'),
     "tokenizer_config.json", "JSON object"),
    *[(f"no-{field}", _json_edit("config.json", lambda values, field=field: values.pop(field)), "config.json", field)
      for field in REQUIRED_CONFIG_FIELDS],
    ("no-model_type", _json_edit("config.json", lambda values: values.pop("model_type")), "config.json", "model_type"),
    *[(f"wrong-type-{field}", _set("config.json", field, _wrong_type(field)), "config.json", field)
      for field in REQUIRED_CONFIG_FIELDS],
    ("huge-vocab_size", _set("config.json", "vocab_size", 2**40), "config.json", "vocab_size"),
    ("other-d_ff", _set("config.json", "d_ff", 38), "model.safetensors", "another shape"),
    ("other-d_model", _set("config.json", "d_model", 64), "model.safetensors", "another shape"),
    ("more-layers", _set("config.json", "encoder_layers", 3), "model.safetensors", "missing"),
    ("pre-ln", _set("config.json", "normalize_before", True), "model.safetensors", "missing"),
    ("other-tokenizer", _swap_tokenizer, "tokenizer.json", "does not belong"),
    ("tokenizer-pads-with-eos", _set("tokenizer_config.json", "pad_token", "</s>"), "tokenizer_config.json",
     "pad_token_id"),
    ("beams-0", _set("generation_config.json", "num_beams", 0), "generation_config.json", "num_beams"),
    ("beams-a-string", _set("generation_config.json", "num_beams", "4"), "generation_config.json", "num_beams"),
    ("eos-outside", _set("generation_config.json", "eos_token_id", [2, 9999]), "generation_config.json",
     "eos_token_id is [2, 9999], outside the model's vocabulary of 420"),  # one end token of two: the config's
    ("start-outside", _set("generation_config.json", "decoder_start_token_id", 420), "generation_config.json",
     "decoder_start_token_id is 420, outside the model's vocabulary"),
    ("eos-not-the-configs", _set("generation_config.json", "eos_token_id", 5), "generation_config.json",
     "config.json says 2"),
    ("penalty-style", _set("generation_config.json", "length_penalty_style", "paper"), "generation_config.json",
     "length_penalty_style"),
    ("gnmt-no-early-stopping", _json_edit("generation_config.json", lambda values: values.update(
        length_penalty_style="gnmt", early_stopping=False)), "generation_config.json", "early_stopping"),
    ("penalty-nan", _set("generation_config.json", "length_penalty", math.nan), "generation_config.json",
     "length_penalty"),
]


@pytest.fixture
def broken(saved, tmp_path, request):
    """A copy of the saved folder with one mutation applied: (folder, file to be named, words, work folder)."""
    folder, root = saved
    _, mutate, file, words = request.param
    copy = Path(shutil.copytree(folder, tmp_path / "model"))
    mutate(copy, root)
    work = tmp_path / "work"
    work.mkdir()
    return copy, file, words, work, root


# The doors: each runs one command (or loader) on `model` with its outputs in `work` and returns its message ---------


def _translate(model, work, root, *extra):
    from vaswani_training.translate import main

    return main(["--model", str(model), "--input", str(root / "data" / "in.de"), "--output", str(work / "out.en"),
                 "--num_beams", "1", *extra])


def _evaluate(model, work, root):
    from vaswani_training.evaluate_bleu import main

    return main(["--model", str(model), "--test_file", str(root / "data" / "test"), "--max_test_samples", "1",
                 "--num_beams", "1", "--output", str(work / "scores.json")])


def _served(*args, **kwargs):
    raise AssertionError("the page was served")


def _demo(model, work, root, *extra):
    import vaswani_training.demo as demo

    launch, demo.launch = demo.launch, _served
    try:
        return demo.main(["--model", str(model), *extra])
    finally:
        demo.launch = launch


def _export(model, work, root):
    from vaswani_training.publish import main

    return main(["--model_dir", str(model), "--output_dir", str(work / "hub")])


def _export_ct2(model, work, root):
    pytest.importorskip("ctranslate2")
    from vaswani_training.convert_ct2 import main

    return main(["--model_dir", str(model), "--output_dir", str(work / "ct2")])


def _average(model, work, root):
    from vaswani_training.average_checkpoints import main

    return main(["--checkpoints", str(model), "--output_dir", str(work / "averaged")])


def _train(model, work, root):
    from helpers import TINY_RUN

    from vaswani_training.lib.run import command_cli
    from vaswani_training.train import main

    prefix = str(root / "data" / "test")
    return command_cli(lambda: main([*TINY_RUN, "--model_name_or_path", str(model), "--train_file", prefix,
                                     "--max_steps", "1", "--output_dir", str(work / "run"), "--cache_dir",
                                     str(work / "cache")]))


DOORS = {"translate": _translate, "evaluate": _evaluate, "demo": _demo,
         "space": lambda model, work, root: _demo(model, work, root, "--trust_remote_code"),
         "export": _export, "export-ct2": _export_ct2, "average": _average, "train": _train}


def _refused(door, model, work, root) -> str:
    """Run `door`; it must exit non-zero with a message (no traceback) and write nothing. Returns the message."""
    before = listing(model), listing(root)
    with pytest.raises(SystemExit) as stopped:
        DOORS[door](model, work, root)
    code = stopped.value.code
    assert isinstance(code, str) and code, f"{door}: exit status {code!r}, not a message"
    assert "Traceback" not in code and "\n" not in code.strip(), code
    assert (listing(model), listing(root)) == before, f"{door} changed its inputs"
    assert list(work.iterdir()) == [], f"{door} wrote {[p.name for p in work.iterdir()]}"
    return code


@pytest.mark.parametrize("door", list(DOORS))
@pytest.mark.parametrize("broken", REFUSED, ids=[case[0] for case in REFUSED], indirect=True)
def test_every_door_refuses_a_broken_folder_naming_the_file(broken, door):
    model, file, words, work, root = broken
    message = _refused(door, model, work, root)
    assert str(model) in message and file in message, message
    assert words in message, message


# What from_pretrained reads; without model_type the class named loads the folder as it is (the commands refuse it).
FROM_PRETRAINED = [case for case in REFUSED if case[2] in MODEL_FILES and case[0] != "no-model_type"]


@pytest.mark.parametrize("cls_name", ["VaswaniForConditionalGeneration", "AutoModelForSeq2SeqLM"])
@pytest.mark.parametrize("broken", FROM_PRETRAINED, ids=[case[0] for case in FROM_PRETRAINED], indirect=True)
def test_from_pretrained_refuses_what_concerns_the_model_naming_the_file(broken, cls_name):
    """`from_pretrained`'s own checks (loading_vaswani.py) of config.json, generation_config.json and the weights:
    one error naming the file, never transformers' `ignore_mismatched_sizes` advice or a model built from defaults."""
    import transformers

    model, file, words, work, root = broken
    cls = getattr(transformers, cls_name) if cls_name.startswith("Auto") else VaswaniForConditionalGeneration
    with pytest.raises((OSError, ValueError)) as refused:
        cls.from_pretrained(model)
    message = str(refused.value)
    assert file in message and "ignore_mismatched_sizes" not in message, message
    if cls is VaswaniForConditionalGeneration:  # (AutoConfig reads config.json before the model's class: "config.json")
        assert str(model) in message, message


# The model's code files: read only where the folder's own code runs ------------------------------------------------


CODE_MUTATIONS = [(f"{how}-{name}", mutate(name), name, "") for name in CODE_FILES
                  for how, mutate in (("delete", _delete), ("truncate", _truncate), ("empty", _empty))]


@pytest.mark.parametrize("door", ["space", "translate-remote-code"])
@pytest.mark.parametrize("broken", CODE_MUTATIONS, ids=[case[0] for case in CODE_MUTATIONS], indirect=True)
def test_doors_that_run_the_folders_code_refuse_a_broken_code_file(broken, door, monkeypatch):
    model, file, words, work, root = broken
    monkeypatch.setitem(DOORS, "translate-remote-code",
                        lambda model, work, root: _translate(model, work, root, "--trust_remote_code"))
    message = _refused(door, model, work, root)
    assert str(model / file) in message, message


def test_without_remote_code_the_code_files_and_generation_config_are_not_needed(saved, tmp_path):
    """With vaswani_hf installed the doors use its code: a folder without its code files translates as the whole one;
    without generation_config.json it decodes with the defaults (beam 4, length penalty 0.6 as transformers applies
    it), which the whole folder's file holds."""
    folder, root = saved
    bare = Path(shutil.copytree(folder, tmp_path / "bare"))
    for name in (*CODE_FILES, "generation_config.json"):
        (bare / name).unlink()
    check_model_folder(bare)
    with pytest.raises(CheckError, match=re.escape(f"{bare / 'modeling_vaswani.py'}: no such file")):
        check_model_folder(bare, trust_remote_code=True)
    outputs = []
    for model in (folder, bare):
        work = tmp_path / f"work-{model.name}"
        work.mkdir()
        assert _translate(model, work, root) == 0
        outputs.append((work / "out.en").read_text(encoding="utf-8"))
    assert outputs[0] == outputs[1] and outputs[0].strip()


# The Space: the page's own copy of the check, without vaswani_hf, and the trust it is given ----------------------


SPACE_LOADER = """
import json, sys
space, broken = sys.argv[1], sys.argv[2:]
sys.path.insert(0, space)
import vaswani_demo.page as page
from vaswani_demo.page import load_model, main

def served(*args, **kwargs):
    raise AssertionError("the page was served")

page.launch, page.build_demo = served, lambda *args, **kwargs: None
model, tokenizer = load_model(space, trust_remote_code=True)
result = {"module": type(model).__module__, "tokenizer_entries": len(tokenizer), "refused": []}
for folder in broken:
    try:
        main(["--model", folder, "--trust_remote_code"])
        result["refused"].append(None)
    except SystemExit as stop:
        result["refused"].append(stop.code)
print("RESULT=" + json.dumps(result))
"""


def test_the_space_checks_its_folder_and_loads_with_the_trust_it_is_given(saved, tmp_path):
    """The exported Space (vaswani_hf not installed) loads model and tokenizer with trust_remote_code, so transformers'
    prompt never shows, and refuses a broken folder naming the file, as vaswani-demo does."""
    from helpers import printed_result

    from vaswani_training.lib.publishing import write_hub_folder

    folder, root = saved
    space = write_hub_folder(folder, tmp_path / "space", space=True)
    cases = {"tokenizer.json": _swap_tokenizer, "config.json": _json_edit("config.json", lambda v: v.pop("d_model")),
             "modeling_vaswani.py": _truncate("modeling_vaswani.py"),
             "generation_config.json": _set("generation_config.json", "num_beams", 0),
             "model.safetensors": _set("config.json", "d_ff", 38)}  # the model's own from_pretrained finds this one
    broken = []
    for name, mutate in cases.items():
        copy = Path(shutil.copytree(space, tmp_path / f"broken-{len(broken)}"))
        mutate(copy, root)
        broken.append(copy)
    completed = run_without_vaswani_hf(SPACE_LOADER, space, *broken, cwd=tmp_path, hf_home=tmp_path / "hf")
    result = printed_result(completed)
    assert result["module"].startswith("transformers_modules.") and result["tokenizer_entries"] == 420
    assert "Do you wish to run the custom code" not in completed.stdout + completed.stderr
    for (name, _), copy, message in zip(cases.items(), broken, result["refused"], strict=True):
        assert message and str(copy / name) in message, (name, message)


# Any edit of the config files: refused naming the file, or a folder that loads and translates ----------------------


DELETE = "<delete>"
PLAUSIBLE = st.sampled_from([0, 1, 2, 4, 0.0, 0.2, 0.6, True, False, "relu", "gelu", "sinusoidal", "hf", "gnmt"])
VALUES = st.one_of(PLAUSIBLE, st.just(DELETE), st.none(), st.booleans(), st.integers(-2, 450),
                   st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["relu", "gelu", "learned",
                                                                                   "sinusoidal", "hf", "gnmt", "",
                                                                                   "8", "false"]),
                   st.lists(st.integers(0, 3), max_size=2))
GENERATION_FIELDS = ("num_beams", "length_penalty", "length_penalty_style", "early_stopping", "eos_token_id",
                     "pad_token_id", "decoder_start_token_id", "bos_token_id", "max_length")


def _apply(values: dict, edits: dict) -> None:
    for name, value in edits.items():
        if value == DELETE:
            values.pop(name, None)
        else:
            values[name] = value


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=st.dictionaries(st.sampled_from((*REQUIRED_CONFIG_FIELDS, "model_type")), VALUES, max_size=2),
       generation=st.dictionaries(st.sampled_from(GENERATION_FIELDS), VALUES, max_size=2))
@example(config={}, generation={"length_penalty": 8})  # an integer alpha once overflowed in transformers' |Y|**alpha
@example(config={}, generation={"length_penalty": 512.0})  # so does a float one this large: refused
@example(config={}, generation={"decoder_start_token_id": DELETE, "bos_token_id": DELETE})  # no start token: refused
def test_any_edit_of_the_config_files_is_refused_naming_the_file_or_translates(saved, tmp_path_factory, config,
                                                                             generation):
    from transformers import AutoTokenizer

    folder, root = saved
    copy = Path(shutil.copytree(folder, tmp_path_factory.mktemp("edited") / "model"))
    for name, edits in (("config.json", config), ("generation_config.json", generation)):
        _json_edit(name, lambda values, edits=edits: _apply(values, edits))(copy, root)
    try:
        check_model_folder(copy)
    except CheckError as error:
        event("refused")
        message = str(error)
        named = [name for name in (*MODEL_FILES, *TOKENIZER_FILES) if str(copy / name) in message]
        assert named or message.startswith(f"{copy}: the weights"), message
        return
    event("loaded")
    model = VaswaniForConditionalGeneration.from_pretrained(copy).eval()
    batch = AutoTokenizer.from_pretrained(copy)([GERMAN[1]], return_tensors="pt")
    output = model.generate(**batch, max_new_tokens=4)
    assert output.shape[0] == 1 and 2 <= output.shape[1] <= 5
    assert int(output[0, 0]) == model.config.decoder_start_token_id


# The demo page of a one-layer, one-head model -----------------------------------------------------------------------


def test_the_demo_page_of_a_one_layer_one_head_model_hides_the_sliders_and_translates(tiny_tokenizer, tmp_path):
    pytest.importorskip("gradio")
    from vaswani_training.demo import DemoPage, build_demo, load_model

    folder = save_model_folder(tmp_path / "one", tiny_tokenizer, encoder_layers=1, decoder_layers=1, num_heads=1)
    model, tokenizer = load_model(str(folder))
    demo = build_demo(model, tokenizer)  # Gradio refuses a slider whose minimum is its maximum
    sliders = {block.elem_id: block for block in demo.blocks.values() if block.elem_id in ("layer", "head")}
    assert [(sliders[k].visible, sliders[k].value) for k in ("layer", "head")] == [(False, 1), (False, 1)]
    state, status, text, *_ = DemoPage(model, tokenizer).translate(GERMAN[2], 2, 0.6, 1, 1, 1, "cross")
    assert state is not None and "hypotheses" in status and len(state["maps"]) == 1
    two = save_model_folder(tmp_path / "two", tiny_tokenizer)
    sliders = {block.elem_id: block for block in build_demo(*load_model(str(two))).blocks.values()
               if block.elem_id in ("layer", "head")}
    assert [(sliders[k].visible, sliders[k].maximum) for k in ("layer", "head")] == [(True, 2), (True, 4)]


# What a run records and publishes of local data -----------------------------------------------------------------------


def test_a_local_dataset_folder_is_recorded_and_published_as_local(saved, tmp_path):
    """--dataset_name naming a local folder: metrics.json records it as local; the card lists no Hub dataset, names
    the folder (not its path) and says it is local; the demo page says local files. A run recorded before there was a
    "local" kind (kind "hub" with the folder's path) is published the same way."""
    import yaml

    from vaswani_hf.checks import weights_fingerprint
    from vaswani_hf.pictures.demo import training_data_note
    from vaswani_training.lib.arguments import DataArguments
    from vaswani_training.lib.prepare import data_sources, dataset_label
    from vaswani_training.lib.publishing import card_data_for, write_hub_folder

    folder, root = saved
    local = tmp_path / "private" / "wmt-sample"
    local.mkdir(parents=True)
    args = DataArguments(dataset_name=str(local))
    assert data_sources(args) == {"kind": "local", "path": str(local), "config": None}
    assert dataset_label(args) == "wmt-sample"
    hub = DataArguments(dataset_name="wmt/wmt14", dataset_config_name="de-en")
    assert data_sources(hub) == {"kind": "hub", "name": "wmt/wmt14", "config": "de-en"}
    assert card_data_for({"dataset": "wmt/wmt14", "data": data_sources(hub)}, model_name="m", source_lang="de",
                         target_lang="en").datasets == ["wmt/wmt14"]
    legacy = {"dataset": str(local), "data": {"kind": "hub", "name": str(local), "config": None}}
    for record in ({"dataset": dataset_label(args), "data": data_sources(args)}, legacy):
        model = Path(shutil.copytree(folder, tmp_path / f"run-{len(list(tmp_path.iterdir()))}"))
        metrics = {**record, "train_steps": 3, "source_lang": "de", "target_lang": "en", "test_bleu": 1.5,
                   "test_bleu_signature": "nrefs:1", "test_sentences": 2, "num_beams": 4, "length_penalty": 0.6,
                   "weights_sha256": weights_fingerprint(model)}
        (model / "metrics.json").write_text(json.dumps(metrics))
        readme = (write_hub_folder(model, tmp_path / f"hub-{model.name}") / "README.md").read_text()
        meta = yaml.safe_load(readme.split("---")[1])
        assert "datasets" not in meta, meta
        assert meta["model-index"][0]["results"][0]["dataset"]["type"] == "custom"
        assert str(tmp_path) not in readme and "Hub dataset" not in readme
        assert "on a local folder (`wmt-sample`)" in readme.replace("\n", " ")
        assert training_data_note(model).startswith("This model was trained on local files (wmt-sample).")


def test_a_code_file_that_lost_a_name_another_imports_is_refused(saved, tmp_path):
    """A code file cut at a line's end is still Python: what the auto_map and the other code files take from it must be
    defined in it."""
    folder, root = saved
    copy = Path(shutil.copytree(folder, tmp_path / "model"))
    inputs = copy / "inputs_vaswani.py"
    inputs.write_text(inputs.read_text(encoding="utf-8").replace("def check_input_ids(", "def _gone("),
                      encoding="utf-8")
    with pytest.raises(CheckError, match=re.escape(f"{inputs}: defines no check_input_ids, which")):
        check_model_folder(copy, trust_remote_code=True)
    check_model_folder(copy)  # not read without remote code
