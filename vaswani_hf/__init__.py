"""vaswani-hf: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as a transformers model.

Importing this package registers the model with transformers' Auto classes, so that
`AutoConfig`, `AutoModel`, `AutoModelForSeq2SeqLM` and `AutoTokenizer` load folders saved from it.
"""

from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM, AutoTokenizer, PreTrainedTokenizerFast

from .configuration_vaswani import VaswaniConfig
from .modeling_vaswani import VaswaniForConditionalGeneration, VaswaniModel, VaswaniPreTrainedModel
from .pipeline import register_translation_pipeline
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

__all__ = ["VaswaniConfig", "VaswaniForConditionalGeneration", "VaswaniModel", "VaswaniPreTrainedModel",
           "__version__", "train_joint_bpe"]
