"""vaswani-hf: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as a transformers model.

Importing this package registers the model with transformers' Auto classes, so that
`AutoConfig`, `AutoModel`, `AutoModelForSeq2SeqLM` and `AutoTokenizer` load folders saved from it.
"""

from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM, AutoTokenizer, PreTrainedTokenizerFast

from .configuration_vaswani import VaswaniConfig
from .decoding.pipeline import register_translation_pipeline
from .modeling_vaswani import VaswaniForConditionalGeneration, VaswaniModel, VaswaniPreTrainedModel
from .tokenization_vaswani import train_joint_bpe

__version__ = "0.1.0"

AutoConfig.register("vaswani", VaswaniConfig, exist_ok=True)
AutoModel.register(VaswaniConfig, VaswaniModel, exist_ok=True)
AutoModelForSeq2SeqLM.register(VaswaniConfig, VaswaniForConditionalGeneration, exist_ok=True)
# The joint BPE is a plain fast tokenizer (tokenizer.json): no tokenizer code of ours is needed to load it.
AutoTokenizer.register(VaswaniConfig, fast_tokenizer_class=PreTrainedTokenizerFast, exist_ok=True)
# transformers 5 dropped the "translation" pipeline task; bring it back for seq2seq models.
register_translation_pipeline()

# Saved folders carry the model code and an `auto_map`, so that they load without this package installed
# (`trust_remote_code=True`).
VaswaniConfig.register_for_auto_class()
VaswaniModel.register_for_auto_class("AutoModel")
VaswaniForConditionalGeneration.register_for_auto_class("AutoModelForSeq2SeqLM")



def _register_peft_targets() -> None:
    """PEFT's default target modules for model_type "vaswani" (what `LoraConfig()` without `target_modules` adapts):
    the query and value projections of every attention, as for BART and T5. Nothing happens without PEFT."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        return
    try:
        from peft.utils import constants
    except Exception:  # noqa: BLE001 - a PEFT that fails to import is not this package's error
        return
    for name in ("TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING",
                 "TRANSFORMERS_MODELS_TO_ADALORA_TARGET_MODULES_MAPPING"):
        mapping = getattr(constants, name, None)
        if isinstance(mapping, dict):
            mapping.setdefault("vaswani", ["q_proj", "v_proj"])


_register_peft_targets()

__all__ = ["VaswaniConfig", "VaswaniForConditionalGeneration", "VaswaniModel", "VaswaniPreTrainedModel",
           "__version__", "train_joint_bpe"]
