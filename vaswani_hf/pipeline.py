"""`pipeline("translation", model=..., tokenizer=...)` for transformers versions that dropped the task.

transformers 5.x removed its text-to-text pipelines ("translation", "summarization", "text2text-generation") in
favour of chat models. A translation model still wants one, so importing `vaswani_hf` registers this small
`TranslationPipeline` under "translation" where transformers no longer has it; where it still does, nothing changes.
"""

from __future__ import annotations

from transformers import AutoModelForSeq2SeqLM
from transformers.pipelines import PIPELINE_REGISTRY, Pipeline


class TranslationPipeline(Pipeline):
    """Translate strings with a seq2seq model: `translator("Ein Hund.")` -> `[{"translation_text": "A dog."}]`.

    Generation keyword arguments (`num_beams`, `length_penalty`, `max_new_tokens`, ...) go to `model.generate`;
    the defaults come from the model's generation config (beam 4, length penalty 0.6 for paper models).
    """

    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    def __call__(self, inputs, *args, **kwargs):
        """One string -> `[{"translation_text": ...}]`; a list of strings -> one dict per string, a flat list (as
        transformers' own translation pipeline returns), unless several sequences per input are asked for."""
        result = super().__call__(inputs, *args, **kwargs)
        if isinstance(inputs, list) and all(isinstance(item, list) and len(item) == 1 for item in result):
            return [item[0] for item in result]
        return result

    def _sanitize_parameters(self, **generate_kwargs):
        return {}, generate_kwargs, {}

    def preprocess(self, text: str):
        if not isinstance(text, str):
            raise ValueError(f"The translation pipeline takes strings, got {type(text).__name__}.")
        return self.tokenizer(text, return_tensors="pt")

    def _forward(self, model_inputs, **generate_kwargs):
        source_length = model_inputs["input_ids"].shape[1]
        if "max_new_tokens" not in generate_kwargs and "max_length" not in generate_kwargs:
            generate_kwargs["max_length"] = source_length + 51  # §6.1: input length + 50, plus the start token
        return {"output_ids": self.model.generate(**model_inputs, **generate_kwargs)}

    def postprocess(self, model_outputs):
        texts = self.tokenizer.batch_decode(model_outputs["output_ids"], skip_special_tokens=True)
        return [{"translation_text": text.strip()} for text in texts]


def register_translation_pipeline() -> bool:
    """Register `TranslationPipeline` as "translation" if transformers has no such task; True if it did."""
    if "translation" in PIPELINE_REGISTRY.get_supported_tasks():
        return False
    try:
        from transformers.pipelines import REMOVED_TASKS
    except ImportError:
        REMOVED_TASKS = {}
    REMOVED_TASKS.pop("translation", None)
    PIPELINE_REGISTRY.register_pipeline("translation", pipeline_class=TranslationPipeline,
                                        pt_model=AutoModelForSeq2SeqLM, type="text")
    return True
