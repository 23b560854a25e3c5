"""BLEU, offline, in one place: the scores and the `evaluate` metric that computes sacreBLEU during training.

- `scores.py`: `compute_bleu` (detokenized sacreBLEU and Multi30k's lowercased tokenized BLEU), `paper_bleu` (the
  paper's Table 2 form, §6.1: cased tokenized BLEU with German compounds split), the Moses tokenizations they use,
  and `load_bleu_metric`;
- `sacrebleu_local/`: sacreBLEU as a local `evaluate` module, loadable with no network (`SACREBLEU_LOCAL_PATH` is the
  folder to pass to `evaluate.load`; `load_bleu_metric()` does that).
"""

from .scores import (
    SACREBLEU_LOCAL_PATH,
    bleu_tokenizer,
    compute_bleu,
    load_bleu_metric,
    moses_lc_tokenize,
    paper_bleu,
    paper_tokenize,
)

__all__ = ["SACREBLEU_LOCAL_PATH", "bleu_tokenizer", "compute_bleu", "load_bleu_metric", "moses_lc_tokenize",
           "paper_bleu", "paper_tokenize"]
