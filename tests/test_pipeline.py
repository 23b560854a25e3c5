"""`pipeline("translation_{src}_to_{tgt}")` as MarianMT's in transformers 4, and the translation pipeline's refusals of
bad tasks, inputs and batch sizes before any work."""

import numpy as np
import pytest
import torch
from helpers import save_model_folder, tiny_model
from transformers import pipeline

from vaswani_hf.decoding.pipeline import TranslationPipeline, TranslationTaskError, parse_translation_task

GENERATE = dict(max_new_tokens=6, num_beams=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_tokenizer):
    return str(save_model_folder(tmp_path_factory.mktemp("pipeline") / "model", tiny_tokenizer, seed=3))


@pytest.fixture(scope="module")
def translator(folder):
    return pipeline("translation", model=folder)


def test_a_language_pair_task_translates_as_translation_and_generate(folder, translator, tiny_tokenizer,
                                                                    parallel_text):
    sources = parallel_text[0][:3]
    paired = pipeline("translation_de_to_en", model=folder)
    assert type(paired) is TranslationPipeline and paired.task == "translation_de_to_en"
    texts = [result["translation_text"] for result in paired(sources, **GENERATE)]
    assert texts == [result["translation_text"] for result in translator(sources, **GENERATE)]
    expected = []
    for source in sources:
        output_ids = paired.model.generate(**tiny_tokenizer(source, return_tensors="pt"), **GENERATE)
        expected.append(tiny_tokenizer.decode(output_ids[0], skip_special_tokens=True).strip())
    assert texts == expected
    assert sum(len(text) for text in texts) >= 3  # the model says something: equal texts are not three empty ones
    # batched: the same as generate() on the right-padded batch
    batch = tiny_tokenizer(sources, padding=True, return_tensors="pt")
    batched = paired.model.generate(**batch, **GENERATE)
    assert [result["translation_text"] for result in paired(sources, batch_size=3, **GENERATE)] == [
        text.strip() for text in tiny_tokenizer.batch_decode(batched, skip_special_tokens=True)]


@pytest.mark.parametrize("task, pair", [("translation", None), ("translation_de_to_en", ("de", "en")),
                                        ("translation_en_to_pt-BR", ("en", "pt-BR")),
                                        ("translation_deu_to_eng", ("deu", "eng"))])
def test_task_names_parse_to_language_pairs(task, pair):
    assert parse_translation_task(task) == pair


@pytest.mark.parametrize("task", ["translation_de_en", "translation_de_to", "translation__to_en",
                                  "translation_german_to_english", "translation_de_to_en_x", "translation_de_to_en "])
def test_a_malformed_language_pair_is_refused(task, folder):
    with pytest.raises(TranslationTaskError, match=r"translation_\{src\}_to_\{tgt\}") as caught:
        pipeline(task, model=folder)
    assert isinstance(caught.value, KeyError) and isinstance(caught.value, ValueError)  # transformers' and ours
    assert str(caught.value).startswith(f"Invalid translation task {task!r}")


def test_a_pair_the_config_does_not_declare_is_refused(tiny_tokenizer):
    model = tiny_model(seed=3, vocab_size=len(tiny_tokenizer))
    model.config.task_specific_params = {"translation_de_to_en": {}}
    with pytest.raises(ValueError, match="does not translate en to de; .* declares translation_de_to_en"):
        pipeline("translation_en_to_de", model=model, tokenizer=tiny_tokenizer)
    translator = pipeline("translation_de_to_en", model=model, tokenizer=tiny_tokenizer)
    alone = pipeline("translation", model=model, tokenizer=tiny_tokenizer)
    assert translator("Zwei Hunde", **GENERATE) == alone("Zwei Hunde", src_lang="de", tgt_lang="en", **GENERATE)
    with pytest.raises(ValueError, match="does not translate from fr; "):
        alone("Zwei Hunde", src_lang="fr")
    with pytest.raises(ValueError, match="does not translate into de; "):
        alone("Zwei Hunde", tgt_lang="de")
    with pytest.raises(ValueError, match="src_lang='en' contradicts the task 'translation_de_to_en'"):
        translator("Zwei Hunde", src_lang="en")


def test_a_model_that_declares_no_pair_takes_any_pair_name(folder, translator):
    # as MarianMT's pipeline: the name documents the direction, the model translates the one it learned
    paired = pipeline("translation_en_to_fr", model=folder)
    assert paired("Zwei Hunde", **GENERATE) == translator("Zwei Hunde", **GENERATE)


@pytest.mark.parametrize("inputs, match", [([], "inputs is an empty list"), ((), "inputs is an empty list"),
                                           (["Zwei Hunde", 3], r"inputs\[1\] is int, not a string"),
                                           ([None], r"inputs\[0\] is NoneType"),
                                           (7, "inputs must be a string or a list of strings, got int")])
def test_inputs_that_are_not_strings_are_refused(translator, inputs, match):
    with pytest.raises(ValueError, match=match):
        translator(inputs)


@pytest.mark.parametrize("batch_size", ["2", 2.0, 0, -1, True])
def test_a_batch_size_that_is_not_a_positive_integer_is_refused(folder, translator, batch_size):
    pattern = rf"TranslationPipeline: batch_size must be a positive integer, got {batch_size!r}"
    with pytest.raises(ValueError, match=pattern):
        translator(["Zwei Hunde", "Ein Mann"], batch_size=batch_size)
    with pytest.raises(ValueError, match=pattern):
        pipeline("translation", model=folder, batch_size=batch_size)


@pytest.mark.parametrize("num_workers", ["1", -1, 1.5])
def test_a_num_workers_that_is_not_a_count_is_refused(translator, num_workers):
    with pytest.raises(ValueError, match=rf"num_workers must be an integer >= 0, got {num_workers!r}"):
        translator("Zwei Hunde", num_workers=num_workers)


def test_numpy_and_tensor_integers_are_batch_sizes(translator, parallel_text):
    sources = parallel_text[0][:2]
    expected = translator(sources, batch_size=2, **GENERATE)
    assert translator(sources, batch_size=np.int64(2), **GENERATE) == expected
    assert translator(sources, batch_size=torch.tensor(2), num_workers=np.int32(0), **GENERATE) == expected
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got tensor"):
        translator(sources, batch_size=torch.tensor(2.0))
