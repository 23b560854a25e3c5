"""BLEU, offline: detokenized sacreBLEU and Multi30k-style lowercased tokenized BLEU.

Two numbers, both on a 0–100 scale:

* `bleu` — sacreBLEU (Post, 2018) on detokenized, cased text with the standard `13a` tokenizer against the
  raw references: the comparable number (the paper's Table 2 WMT scores are tokenized BLEU; sacreBLEU is what
  to report today). Comes with its signature, e.g. `nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0`.
* `tok_bleu` — "tokenized lowercased BLEU", the form Multi30k papers report: `multi-bleu.perl` on the
  official `tok/*.lc.norm.tok.*` references, i.e. text that went through Moses `lowercase.perl |
  normalize-punctuation.perl -l L | tokenizer.perl -l L`. The hypotheses are put through the same pipeline
  with `sacremoses` (lowercase → `MosesPunctNormalizer(L)` → `MosesTokenizer(L)` with HTML escaping,
  as tokenizer.perl does by default; this reproduces the shipped Multi30k `tok/` files from the raw ones
  exactly), then scored with sacreBLEU `tokenize="none"`, `smooth_method="none"` — which is what
  `multi-bleu.perl` computes (whitespace tokens, no smoothing, closest-reference brevity penalty).
  `tokenized_method="13a"` is a dependency-free approximation (HTML-unescaped references, sacreBLEU 13a,
  lowercase=True); its number is not the published one and is labelled as such.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Union

import sacrebleu

from .metrics import SACREBLEU_LOCAL_PATH

__all__ = ["load_bleu_metric", "compute_bleu", "moses_lc_tokenize", "SACREBLEU_LOCAL_PATH"]

RefsArg = Union[Sequence[str], Sequence[Sequence[str]], str, "os.PathLike[str]"]


def load_bleu_metric(**kwargs: Any):
    """The local sacreBLEU `evaluate` module (`vaswani_hf/metrics/sacrebleu_local`), loaded with no network.

    `kwargs` go to `evaluate.load` (e.g. `experiment_id`, `num_process`/`process_id` for distributed
    evaluation, `keep_in_memory=True`). `metric.compute(predictions=[...], references=[[...], ...])` returns
    `score`, `counts`, `totals`, `precisions`, `bp`, `sys_len`, `ref_len` and `signature`.
    """
    import evaluate

    return evaluate.load(str(SACREBLEU_LOCAL_PATH), **kwargs)


def _read_refs(refs: RefsArg, name: str) -> list[list[str]]:
    """-> list of reference streams (sacrebleu layout: streams[k][i] = k-th reference of segment i)."""
    if isinstance(refs, (str, os.PathLike)):
        from .data import read_lines

        p = Path(refs)
        if not p.is_file():
            raise ValueError(
                f"{name}: a str is read as a file path and {p} is not a file; pass a list of strings for "
                f"in-memory references."
            )
        return [read_lines(p)]
    refs = list(refs)
    if not refs:
        raise ValueError(f"{name} is empty.")
    if all(isinstance(r, str) for r in refs):
        return [refs]
    if all(isinstance(r, (list, tuple)) for r in refs):
        k = len(refs[0])
        for i, r in enumerate(refs):
            if len(r) != k or not all(isinstance(x, str) for x in r):
                raise ValueError(
                    f"{name}[{i}] must be a list of {k} strings (the same number of references for every "
                    f"segment), got {r!r:.100}."
                )
        if k == 0:
            raise ValueError(f"{name}: every segment has 0 references.")
        return [[r[j] for r in refs] for j in range(k)]
    raise ValueError(f"{name} must be a list of strings (one reference per segment), a list of lists of strings, "
                     f"or a file path.")


def _check_hyps(hypotheses) -> list[str]:
    if isinstance(hypotheses, str):
        raise ValueError("hypotheses must be a list of strings (one per segment), not a single string.")
    hyps = list(hypotheses)
    for i, h in enumerate(hyps):
        if not isinstance(h, str):
            raise ValueError(f"hypotheses[{i}] must be a str, got {type(h).__name__}; decode token ids first "
                             f"(tokenizer.batch_decode(..., skip_special_tokens=True)).")
    if not hyps:
        raise ValueError("hypotheses is empty.")
    return hyps


def _check_lengths(hyps: list[str], streams: list[list[str]], name: str) -> None:
    if len(streams[0]) != len(hyps):
        raise ValueError(f"{len(hyps)} hypotheses but {len(streams[0])} {name}; they must be aligned one per segment.")


@lru_cache(maxsize=8)
def _moses(lang: str):
    try:
        from sacremoses import MosesPunctNormalizer, MosesTokenizer
    except ImportError:
        raise ImportError(
            "tokenized BLEU with tokenized_method='moses' needs sacremoses: `pip install sacremoses` "
            "(or pass tokenized_method='13a' for an approximation that is not the published number)."
        ) from None
    return MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)


def moses_lc_tokenize(sentences: Sequence[str], lang: str) -> list[str]:
    """Lowercase → Moses punctuation normalization → Moses tokenization (escaped), as Multi30k's `tok/` files.

    Needs `sacremoses`. `lang` is the text's language code (`"en"`, `"de"`, ...).
    """
    norm, tok = _moses(lang)
    return [tok.tokenize(norm.normalize(s.lower()), return_str=True, escape=True) for s in sentences]


def compute_bleu(
    hypotheses: Sequence[str],
    references: RefsArg | None = None,
    lowercase_tokenized_references: RefsArg | None = None,
    *,
    target_lang: str = "en",
    tokenized_method: str = "moses",
) -> dict[str, Any]:
    """Corpus BLEU of detokenized `hypotheses`.

    Args:
        hypotheses: system outputs, one detokenized string per segment.
        references: raw (cased, untokenized) references: a list of strings, a list of lists of strings
            (several references per segment), or a file path (plain or `.gz`, one per line). Gives `bleu`.
        lowercase_tokenized_references: the official lowercased tokenized references (e.g.
            `vaswani_hf.data.multi30k_file("test", "en", tokenized_lowercased=True)`); gives `tok_bleu`.
        target_lang: language of the hypotheses, for Moses tokenization (`"en"` for De→En).
        tokenized_method: `"moses"` (default, the published Multi30k number; needs sacremoses) or `"13a"`.

    Returns:
        dict with (when `references` given) `bleu` (float 0–100), `signature` (str), `counts`,
        `totals`, `precisions`, `bp`, `sys_len`, `ref_len`; and (when
        `lowercase_tokenized_references` given) `tok_bleu` (float 0–100) and `tok_signature` (str
        naming the preprocessing, e.g. `lc+moses-norm+moses-tok(en)|multi-bleu|nrefs:1|...`).

    Raises:
        ValueError: neither reference kind given, count mismatch between hypotheses and references, a
            non-string hypothesis, unknown `tokenized_method`.
        ImportError: `tokenized_method="moses"` without sacremoses installed.
    """
    if references is None and lowercase_tokenized_references is None:
        raise ValueError("give `references` (raw, for sacreBLEU) and/or `lowercase_tokenized_references`.")
    if tokenized_method not in ("moses", "13a"):
        raise ValueError(f"tokenized_method must be 'moses' or '13a', got {tokenized_method!r}.")
    hyps = _check_hyps(hypotheses)
    out: dict[str, Any] = {}
    if references is not None:
        streams = _read_refs(references, "references")
        _check_lengths(hyps, streams, "references")
        metric = sacrebleu.BLEU(tokenize="13a")
        res = metric.corpus_score(hyps, streams)
        out.update(
            bleu=res.score, signature=str(metric.get_signature()), counts=res.counts, totals=res.totals,
            precisions=res.precisions, bp=res.bp, sys_len=res.sys_len, ref_len=res.ref_len,
        )
    if lowercase_tokenized_references is not None:
        streams = _read_refs(lowercase_tokenized_references, "lowercase_tokenized_references")
        _check_lengths(hyps, streams, "lowercase_tokenized_references")
        if tokenized_method == "moses":
            tok_hyps = moses_lc_tokenize(hyps, target_lang)
            metric = sacrebleu.BLEU(tokenize="none", smooth_method="none", force=True)
            res = metric.corpus_score(tok_hyps, streams)
            prefix = f"lc+moses-norm+moses-tok({target_lang})|multi-bleu"
        else:
            streams = [[html.unescape(r) for r in s] for s in streams]
            metric = sacrebleu.BLEU(tokenize="13a", lowercase=True, smooth_method="none", force=True)
            res = metric.corpus_score(hyps, streams)
            prefix = "approx:unescaped-refs+13a-lc"
        out.update(tok_bleu=res.score, tok_signature=f"{prefix}|{metric.get_signature()}")
    return out
