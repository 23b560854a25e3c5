"""The test set of a run, translated and scored: what `vaswani-train` prints at its end and `vaswani-evaluate`
prints for a saved model.
"""

from __future__ import annotations

import time
from typing import Any

from vaswani_hf.checks import CheckError

from .arguments import DataArguments


def evaluate_test_set(model, tokenizer, test_dataset, data_args: DataArguments, *, batch_size: int = 64,
                      num_beams: int | None = None, length_penalty: float | None = None, is_multi30k: bool = True,
                      length_penalty_style: str | None = None) -> dict[str, Any]:
    """Translate the test split and score it with detokenized sacreBLEU, the paper's cased tokenized BLEU
    (`vaswani_hf.bleu.paper_bleu`: Moses-tokenized, German compounds split, §6.1 Table 2) and, on the shipped
    Multi30k, lowercased tokenized BLEU against the official `tok/` references.

    `num_beams`, `length_penalty`, `length_penalty_style` default to the model's generation config (what a training
    run chose on validation; beam 4, 0.6, "hf" where it says nothing). `length_penalty_style`: "hf"
    (`model.generate`: score / |Y|^alpha) or "gnmt" (the paper's ((5 + |Y|) / 6)^alpha and at most input length + 50
    tokens, `vaswani_hf.decoding.paper_generate`).

    Returns:
        `{"metrics": {...}, "hypotheses": [...], "sources": [...], "references": [...]}`; the metrics are
        `test_bleu`, `test_bleu_signature`, `test_paper_bleu`, `test_paper_bleu_signature`, on Multi30k
        `test_tok_bleu` and `test_tok_bleu_signature`,
        `test_sentences`, `test_seconds`, `test_sentences_per_second` and the decoding settings.

    Raises:
        CheckError: an unknown `length_penalty_style`.
    """
    from vaswani_hf.bleu import compute_bleu
    from vaswani_hf.data import multi30k_file, read_lines
    from vaswani_hf.decoding.translate import translate_sentences

    generation = model.generation_config
    num_beams = num_beams or generation.num_beams or 4
    length_penalty = length_penalty if length_penalty is not None else (
        generation.length_penalty if generation.length_penalty is not None else 0.6)
    length_penalty_style = length_penalty_style or getattr(generation, "length_penalty_style", None) or "hf"
    sources = [t[data_args.source_lang] for t in test_dataset["translation"]]
    references = [t[data_args.target_lang] for t in test_dataset["translation"]]
    start = time.perf_counter()
    generate_fn = None
    if length_penalty_style == "gnmt":
        from vaswani_hf.decoding.paper import paper_generate

        def generate_fn(m, input_ids, attention_mask=None, **_):
            return paper_generate(m, input_ids, attention_mask, num_beams=num_beams, alpha=length_penalty)
    elif length_penalty_style != "hf":
        raise CheckError(f"length_penalty_style must be 'hf' or 'gnmt', got {length_penalty_style!r}.")
    hypotheses = translate_sentences(model, tokenizer, sources, batch_size=batch_size, num_beams=num_beams,
                                     length_penalty=length_penalty, generate_fn=generate_fn,
                                     **({"length_penalty_style": "hf"} if generate_fn is None and getattr(
                                         generation, "length_penalty_style", None) == "gnmt" else {}))
    seconds = time.perf_counter() - start
    tok_refs = None
    if is_multi30k and data_args.target_lang in ("de", "en"):
        tok_refs = read_lines(multi30k_file("test", data_args.target_lang, tokenized_lowercased=True))
        tok_refs = tok_refs[: len(hypotheses)]
    scores = compute_bleu(hypotheses, references, tok_refs, target_lang=data_args.target_lang)
    metrics = {
        "test_bleu": round(scores["bleu"], 2),
        "test_bleu_signature": scores["signature"],
        "test_length_ratio": round(scores["sys_len"] / scores["ref_len"], 3) if scores["ref_len"] else None,
        "test_paper_bleu": round(scores["paper_bleu"], 2),
        "test_paper_bleu_signature": scores["paper_signature"],
        "test_sentences": len(sources),
        "test_seconds": round(seconds, 1),
        "test_sentences_per_second": round(len(sources) / seconds, 2),
        "num_beams": num_beams,
        "length_penalty": length_penalty,
        "length_penalty_style": length_penalty_style,
    }
    if "tok_bleu" in scores:
        metrics["test_tok_bleu"] = round(scores["tok_bleu"], 2)
        metrics["test_tok_bleu_signature"] = scores["tok_signature"]
    return {"metrics": metrics, "hypotheses": hypotheses, "sources": sources, "references": references}
