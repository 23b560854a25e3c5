"""Choosing the length penalty on a development set, as §6.1 did: "These hyperparameters [beam size 4, length penalty
alpha = 0.6] were chosen after experimentation on the development set."

One beam search per beam size is enough for every penalty: `beam_search_hypotheses` extends beams by raw
log-probability and keeps all `num_beams` finished hypotheses of a sentence with their raw scores, and each
(style, alpha) then picks its best among them (`FinishedHypotheses.best`), exactly what `generate(num_beams=k,
length_penalty=alpha, length_penalty_style=style, early_stopping=True)` returns (`vaswani_hf/decoding/paper.py`).

    rows = length_penalty_search(model, tokenizer, sources, references)   # 2 styles x 9 alphas, one decode
    best = best_setting(rows)        # {"length_penalty_style": "hf", "length_penalty": 1.4, "bleu": ..., ...}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .paper import LENGTH_PENALTY_STYLES, beam_search_hypotheses
from .translate import map_batches

# The alphas tried per style: the paper's 0.6 first, then longer outputs (the |Y|^alpha and GNMT penalties both grow
# with alpha; above ~2 a beam of 4 has no longer finished hypothesis left to pick).
DEFAULT_ALPHAS = (0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.5)

__all__ = ["DEFAULT_ALPHAS", "best_setting", "length_penalty_search"]


@torch.no_grad()
def length_penalty_search(model, tokenizer, sources: Sequence[str], references: Sequence[str], *,
                          num_beams: int = 4, alphas: Sequence[float] = DEFAULT_ALPHAS,
                          styles: Sequence[str] = ("hf", "gnmt"), batch_size: int = 64,
                          max_len_b: int = 50) -> list[dict[str, Any]]:
    """Detokenized sacreBLEU (13a) and length ratio of every (style, alpha) from one beam search over `sources`.

    Args:
        model: a `VaswaniForConditionalGeneration` (put in eval mode here); tokenizer: its tokenizer.
        sources, references: the development set, one reference per source.
        num_beams: beam size (>= 2; the paper's 4).
        alphas: length-penalty exponents to try (each >= 0); styles: "hf" (|Y|^alpha) and/or "gnmt"
            (((5 + |Y|) / 6)^alpha).
        batch_size: sentences per beam search (length-sorted).
        max_len_b: at most source length + `max_len_b` output tokens (§6.1: 50).
    Returns:
        one dict per (style, alpha), in the order given: `num_beams`, `length_penalty_style`, `length_penalty`,
        `bleu` (0-100, rounded to 2 places), `length_ratio` (hypothesis / reference tokens, sacreBLEU's 13a
        tokens), `sentences`.
    Raises:
        ValueError: no sources, a different number of references, num_beams < 2, a negative alpha or an unknown
            style.
    """
    import sacrebleu

    sources, references = list(sources), list(references)
    if not sources or len(sources) != len(references):
        raise ValueError(f"length_penalty_search: needs as many references as sources (at least one), got "
                         f"{len(sources)} sources and {len(references)} references.")
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 2:
        raise ValueError(f"length_penalty_search: num_beams must be an integer >= 2, got {num_beams!r}.")
    for alpha in alphas:
        if not alpha >= 0:
            raise ValueError(f"length_penalty_search: alphas must be >= 0, got {alpha!r}.")
    for style in styles:
        if style not in LENGTH_PENALTY_STYLES:
            raise ValueError(f"length_penalty_search: styles must be among {LENGTH_PENALTY_STYLES}, got {style!r}.")
    model.eval()
    device = next(model.parameters()).device
    encoded = tokenizer(sources)["input_ids"]
    order = sorted(range(len(sources)), key=lambda i: len(encoded[i]))
    picks: dict[tuple[str, float], list[str | None]] = {(s, a): [None] * len(sources) for s in styles for a in alphas}

    def search(rows: list[int]):
        with torch.inference_mode():  # per thread (`map_batches` may decode batches side by side)
            padded = tokenizer.pad({"input_ids": [encoded[i] for i in rows]}, return_tensors="pt")
            batch = {name: padded[name].to(device) for name in ("input_ids", "attention_mask")}
            hypotheses = beam_search_hypotheses(model, batch["input_ids"], batch["attention_mask"],
                                                num_beams=num_beams, max_len_b=max_len_b)
            texts = [[t.strip() for t in tokenizer.batch_decode(hypotheses.sequences[:, k], skip_special_tokens=True)]
                     for k in range(num_beams)]
            return texts, {key: hypotheses.best(key[1], key[0]).tolist() for key in picks}

    batches = [order[start:start + batch_size] for start in range(0, len(order), batch_size)]
    for rows, (texts, best) in zip(batches, map_batches(search, batches, device), strict=True):
        for key, out in picks.items():
            for position, (row, k) in enumerate(zip(rows, best[key])):
                out[row] = texts[k][position]
    results = []
    for (style, alpha), hyps in picks.items():
        score = sacrebleu.corpus_bleu(hyps, [references])
        results.append({"num_beams": num_beams, "length_penalty_style": style, "length_penalty": alpha,
                        "bleu": round(score.score, 2),
                        "length_ratio": round(score.sys_len / score.ref_len, 3) if score.ref_len else None,
                        "sentences": len(sources)})
    return results


def best_setting(rows: Sequence[dict[str, Any]], min_length_ratio: float = 0.0) -> dict[str, Any]:
    """The row of highest `bleu` among those whose `length_ratio` (hypothesis / reference length) is at least
    `min_length_ratio`, or among all rows where none is; among equal scores the first (the search lists the paper's
    settings first).

    Args:
        rows: the search's rows (`length_penalty_search`), each with "bleu" and "length_ratio".
        min_length_ratio: 0 (default): the highest BLEU. 1.0: the highest BLEU of the settings whose output is not
            shorter than the references, as `vaswani-train` chooses (BLEU's brevity penalty punishes a short output
            steeply and a long one not at all, so a setting chosen below 1 turns shorter still on a set whose
            references run longer).
    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("best_setting: no rows to choose from.")
    long_enough = [row for row in rows if row["length_ratio"] >= min_length_ratio]
    return max(long_enough or rows, key=lambda row: row["bleu"])  # max keeps the first of equal keys
