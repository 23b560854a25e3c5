"""Decoding: turning source sentences into translations, by every route this package offers.

- `paper.py`: the paper's decoding (§6.1): beam 4, the GNMT length penalty ((5 + |Y|) / 6)^0.6, at most input length
  + 50 tokens (`paper_generate`), and transformers' |Y|^0.6 as the other named style (`length_penalty`);
- `search.py`: the length penalty chosen on a development set (§6.1), every (style, alpha) from one beam search
  (`length_penalty_search`, `best_setting`);
- `translate.py`: `translate_sentences`, lists of sentences in length-sorted batches through `generate()` (or
  `paper_generate`), what `vaswani-translate`, `vaswani-evaluate` and the demo page call;
- `pipeline.py`: `pipeline("translation")` and "translation_{src}_to_{tgt}", registered when `vaswani_hf` is imported
  (transformers 5 dropped the task);
- `exported.py`: export, and only this is export here: the encoder and one decoder step as graphs (`torch.export`,
  ONNX) with their own greedy and beam search loops;
- `ct2.py`: conversion to CTranslate2 (`convert_to_ct2`) and translating with the converted model (`ct2_translate`).

The public names of each file are importable from here, except the exported graphs' loops (`beam_search`,
`greedy_search`) and CTranslate2's `QUANTIZATIONS`, which say what they are only beside their file's other names:
import them from `vaswani_hf.decoding.exported` and `vaswani_hf.decoding.ct2`.
"""

from .ct2 import build_ct2_spec, convert_to_ct2, ct2_translate, vocabulary_from_tokenizer
from .exported import (
    VaswaniExportableDecoderStep,
    VaswaniExportableEncoder,
    onnx_export_generation,
    onnx_generation_functions,
    torch_export_generation,
)
from .paper import (
    LENGTH_PENALTY_STYLES,
    FinishedHypotheses,
    SourceLengthLimitLogitsProcessor,
    beam_search_hypotheses,
    gnmt_length_penalty,
    hf_length_penalty,
    length_penalty,
    max_output_lengths,
    paper_generate,
)
from .pipeline import (
    TranslationPipeline,
    TranslationTaskError,
    declared_language_pairs,
    parse_translation_task,
    register_translation_pipeline,
)
from .search import DEFAULT_ALPHAS, best_setting, length_penalty_search
from .translate import translate_sentences

__all__ = [
    "DEFAULT_ALPHAS",
    "LENGTH_PENALTY_STYLES",
    "FinishedHypotheses",
    "SourceLengthLimitLogitsProcessor",
    "TranslationPipeline",
    "TranslationTaskError",
    "VaswaniExportableDecoderStep",
    "VaswaniExportableEncoder",
    "beam_search_hypotheses",
    "best_setting",
    "build_ct2_spec",
    "convert_to_ct2",
    "ct2_translate",
    "declared_language_pairs",
    "gnmt_length_penalty",
    "hf_length_penalty",
    "length_penalty",
    "length_penalty_search",
    "max_output_lengths",
    "onnx_export_generation",
    "onnx_generation_functions",
    "paper_generate",
    "parse_translation_task",
    "register_translation_pipeline",
    "torch_export_generation",
    "translate_sentences",
    "vocabulary_from_tokenizer",
]
