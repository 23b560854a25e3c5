"""`pipeline("translation", ...)` and `pipeline("translation_{src}_to_{tgt}", ...)` for transformers versions that
dropped the task.

transformers 5.x removed its text-to-text pipelines ("translation", "summarization", "text2text-generation") in
favour of chat models. A translation model still wants one, so importing `vaswani_hf` registers this small
`TranslationPipeline` under "translation" where transformers no longer has it, and lets the registry read
"translation_de_to_en" as the "translation" task with the pair ("de", "en"), as transformers 4 did for MarianMT;
where transformers still has the task, nothing changes.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
from transformers import AutoModelForSeq2SeqLM
from transformers.pipelines import PIPELINE_REGISTRY, Pipeline

# ISO 639 codes with optional subtags ("de", "pt-BR", "zh-Hans"): no underscore, so the task splits unambiguously.
_LANGUAGE = r"[A-Za-z]{2,3}(?:-[A-Za-z0-9]{2,8})*"
_TRANSLATION_TASK = re.compile(rf"translation_({_LANGUAGE})_to_({_LANGUAGE})")


class TranslationTaskError(KeyError, ValueError):
    """A malformed "translation_..." task: a `KeyError` as transformers raises for unknown tasks, and a `ValueError`
    as this package raises for every bad argument."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def parse_translation_task(task: str) -> tuple[str, str] | None:
    """The language pair a translation task names: "translation_de_to_en" -> ("de", "en"); "translation" -> None.

    Raises:
        TranslationTaskError: `task` starts with "translation_" but is not "translation_{src}_to_{tgt}" with
            language codes such as "de", "en" or "pt-BR".
    """
    if task == "translation":
        return None
    match = _TRANSLATION_TASK.fullmatch(task)
    if match is None:
        raise TranslationTaskError(
            f"Invalid translation task {task!r}: use 'translation' or 'translation_{{src}}_to_{{tgt}}' with language "
            f"codes, e.g. 'translation_de_to_en' or 'translation_en_to_pt-BR'.")
    return match.group(1), match.group(2)


def declared_language_pairs(config) -> list[tuple[str, str]]:
    """The pairs a model's config names in `task_specific_params` ("translation_de_to_en": {...}), transformers'
    place for them (T5, MarianMT); empty when the config names none, as this package's configs do by default."""
    params = getattr(config, "task_specific_params", None) or {}
    return [(match.group(1), match.group(2)) for key in params
            if isinstance(key, str) and (match := _TRANSLATION_TASK.fullmatch(key))]


def _check_counts(kwargs: dict[str, Any]) -> None:
    """Turn `batch_size` and `num_workers` in `kwargs` into ints (NumPy and 0-d tensor integers too), in place: a
    DataLoader given "2", 2.0 or np.int64(2) fails deep inside torch's sampler instead."""
    for name, minimum in (("batch_size", 1), ("num_workers", 0)):
        value = kwargs.get(name)
        if value is None:
            continue
        try:
            count = None if isinstance(value, bool) else operator.index(value)
        except TypeError:
            count = None
        if count is None or count < minimum:
            kind = "a positive integer" if minimum == 1 else "an integer >= 0"
            raise ValueError(f"TranslationPipeline: {name} must be {kind}, got {value!r} ({type(value).__name__}).")
        kwargs[name] = count


class TranslationPipeline(Pipeline):
    """Translate strings with a seq2seq model: `translator("Ein Hund.")` -> `[{"translation_text": "A dog."}]`.

    Built by `pipeline("translation", model=...)` or `pipeline("translation_{src}_to_{tgt}", model=...)`. The model
    translates the one direction it was trained for: the pair in the task name (and `src_lang`/`tgt_lang`, accepted
    at construction or per call as MarianMT's pipeline accepts them) changes nothing in the output, but is refused
    when the model's config declares its pairs (`config.task_specific_params`) and this one is not among them.
    Generation keyword arguments (`num_beams`, `length_penalty`, `max_new_tokens`, ...) go to `model.generate`;
    the defaults come from the model's generation config (beam 4, length penalty 0.6 for paper models). An empty
    string (or one of whitespace only) translates to "" without a model call, in its place among the others: given
    only `</s>`, a model would invent a sentence.

    Raises:
        TranslationTaskError: a malformed "translation_..." task name.
        ValueError: a pair the model does not declare; `batch_size` or `num_workers` that is not an integer (or
            below 1, resp. 0); inputs that are an empty list or hold something other than strings.
    """

    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    def __init__(self, *args, **kwargs):
        _check_counts(kwargs)
        super().__init__(*args, **kwargs)

    def _check_languages(self, src_lang: str | None, tgt_lang: str | None) -> None:
        pair = parse_translation_task(self.task) if self.task and self.task.startswith("translation") else None
        if pair is not None:
            for name, given, expected in (("src_lang", src_lang, pair[0]), ("tgt_lang", tgt_lang, pair[1])):
                if given is not None and given != expected:
                    raise ValueError(f"TranslationPipeline: {name}={given!r} contradicts the task {self.task!r}.")
            src_lang, tgt_lang = src_lang or pair[0], tgt_lang or pair[1]
        declared = declared_language_pairs(self.model.config)
        if not declared or (src_lang is None and tgt_lang is None):
            return
        if not any(src_lang in (None, src) and tgt_lang in (None, tgt) for src, tgt in declared):
            names = ", ".join(f"translation_{src}_to_{tgt}" for src, tgt in declared)
            asked = (f"{src_lang} to {tgt_lang}" if src_lang and tgt_lang else
                     f"from {src_lang}" if src_lang else f"into {tgt_lang}")
            raise ValueError(f"TranslationPipeline: the model does not translate {asked}; its "
                             f"config.task_specific_params declares {names}.")

    def __call__(self, inputs, *args, **kwargs):
        """One string -> `[{"translation_text": ...}]`; a list (or tuple) of strings -> one dict per string, a flat list
        (as transformers' own translation pipeline returns), unless several sequences per input are asked for.

        Raises:
            ValueError: an empty list, an item that is not a string, or `batch_size`/`num_workers` not a count.
        """
        if isinstance(inputs, (list, tuple)):
            inputs = list(inputs)  # transformers batches lists only; a tuple would reach preprocess whole
            if not inputs:
                raise ValueError("TranslationPipeline: inputs is an empty list; pass a string or a list of strings.")
            wrong = next((i for i, item in enumerate(inputs) if not isinstance(item, str)), None)
            if wrong is not None:
                raise ValueError(f"TranslationPipeline: inputs[{wrong}] is {type(inputs[wrong]).__name__}, not a "
                                 f"string; the pipeline translates strings.")
        elif not isinstance(inputs, str) and not hasattr(inputs, "__iter__"):
            raise ValueError(f"TranslationPipeline: inputs must be a string or a list of strings, got "
                             f"{type(inputs).__name__}.")
        _check_counts(kwargs)
        result = super().__call__(inputs, *args, **kwargs)
        if isinstance(inputs, list) and all(isinstance(item, list) and len(item) == 1 for item in result):
            return [item[0] for item in result]
        return result

    def _sanitize_parameters(self, src_lang: str | None = None, tgt_lang: str | None = None, **generate_kwargs):
        self._check_languages(src_lang, tgt_lang)
        return {}, generate_kwargs, {}

    def preprocess(self, text: str):
        if not isinstance(text, str):
            raise ValueError(f"The translation pipeline takes strings, got {type(text).__name__}.")
        # every item carries the flag, so that batches of empty and other strings collate
        return {**self.tokenizer(text, return_tensors="pt"), "empty_source": torch.tensor([[int(not text.strip())]])}

    def _forward(self, model_inputs, **generate_kwargs):
        empty = model_inputs.pop("empty_source").reshape(-1).bool()
        source_length = model_inputs["input_ids"].shape[1]
        if "max_new_tokens" not in generate_kwargs and "max_length" not in generate_kwargs:
            generate_kwargs["max_length"] = source_length + 51  # §6.1: input length + 50, plus the start token
        if not bool(empty.any()):
            return {"output_ids": self.model.generate(**model_inputs, **generate_kwargs)}
        per_source = generate_kwargs.get("num_return_sequences") or \
            getattr(self.model.generation_config, "num_return_sequences", None) or 1
        kept = (~empty).nonzero().flatten()
        pad = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        if not len(kept):
            return {"output_ids": torch.full((len(empty) * per_source, 1), pad)}
        generated = self.model.generate(**{name: value[kept] for name, value in model_inputs.items()},
                                        **generate_kwargs)
        output = generated.new_full((len(empty) * per_source, generated.shape[1]), pad)  # "" once decoded
        output[(kept[:, None] * per_source + torch.arange(per_source)).flatten().to(output.device)] = generated
        return {"output_ids": output}

    def postprocess(self, model_outputs):
        texts = self.tokenizer.batch_decode(model_outputs["output_ids"], skip_special_tokens=True)
        return [{"translation_text": text.strip()} for text in texts]


def _with_translation_pairs(check_task):
    """Wrap `PipelineRegistry.check_task` so that "translation_{src}_to_{tgt}" resolves to the "translation" task with
    the pair as its options, as transformers 4's registry resolved it."""

    def check_translation_task(task: str):
        if isinstance(task, str) and task.startswith("translation_"):
            pair = parse_translation_task(task)
            normalized_task, targeted_task, _ = check_task("translation")
            return normalized_task, targeted_task, pair
        return check_task(task)

    check_translation_task.reads_translation_pairs = True
    return check_translation_task


def register_translation_pipeline() -> bool:
    """Register `TranslationPipeline` as "translation" (and its "translation_{src}_to_{tgt}" forms) if transformers
    has no such task; True if it did."""
    if "translation" in PIPELINE_REGISTRY.get_supported_tasks():
        return False
    try:
        from transformers.pipelines import REMOVED_TASKS
    except ImportError:
        REMOVED_TASKS = {}
    REMOVED_TASKS.pop("translation", None)
    PIPELINE_REGISTRY.register_pipeline("translation", pipeline_class=TranslationPipeline,
                                        pt_model=AutoModelForSeq2SeqLM, type="text")
    if not getattr(PIPELINE_REGISTRY.check_task, "reads_translation_pairs", False):
        PIPELINE_REGISTRY.check_task = _with_translation_pairs(PIPELINE_REGISTRY.check_task)
    return True


__all__ = ["TranslationPipeline", "TranslationTaskError", "declared_language_pairs", "parse_translation_task",
           "register_translation_pipeline"]
