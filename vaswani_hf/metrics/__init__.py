"""Local `evaluate` metric modules (loadable offline).

``SACREBLEU_LOCAL_PATH`` is the folder to pass to ``evaluate.load``; ``vaswani_hf.bleu.load_bleu_metric()``
does that for you.
"""

from pathlib import Path

SACREBLEU_LOCAL_PATH = Path(__file__).resolve().parent / "sacrebleu_local"

__all__ = ["SACREBLEU_LOCAL_PATH"]
