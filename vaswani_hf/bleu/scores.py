"""BLEU scores, offline: detokenized sacreBLEU, Multi30k-style lowercased tokenized BLEU and the paper's form (§6.1).

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
* `paper_bleu` — the paper's Table 2 form (`paper_bleu()`): cased tokenized BLEU as tensor2tensor's
  `get_ende_bleu.sh` computes it, with German compounds split as `##AT##-##AT##` (En-De) and plain for other
  targets (En-Fr). The number to set beside Table 2, with its own signature.

Languages written without spaces between words have no such form: Moses's tokenizer and `13a` leave a Chinese
sentence one token, and identical output would score 0. Chinese is scored with sacreBLEU's `zh` tokenizer and Japanese
with `ja-mecab` (where MeCab is installed) in every form, as their signatures say (`bleu_tokenizer`); Thai, Lao,
Khmer and Burmese are refused with what to use instead. A corpus whose references hold no 4-gram is refused too:
BLEU-4 is 0 there whatever the output, identical output included.
"""

from __future__ import annotations

import html
import importlib
import os
import re
import sys
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Union

import sacrebleu

from ..data.caches import remove_damaged

# The folder `evaluate.load` takes: the folder and its script share a name, as evaluate requires.
SACREBLEU_LOCAL_PATH = Path(__file__).resolve().parent / "sacrebleu_local"

__all__ = ["load_bleu_metric", "bleu_tokenizer", "compute_bleu", "moses_lc_tokenize", "paper_bleu", "paper_tokenize",
           "SACREBLEU_LOCAL_PATH"]

RefsArg = Union[Sequence[str], Sequence[Sequence[str]], str, "os.PathLike[str]"]


def load_bleu_metric(**kwargs: Any):
    """The local sacreBLEU `evaluate` module (`vaswani_hf/bleu/sacrebleu_local`, `SACREBLEU_LOCAL_PATH`), loaded with
    no network.

    `kwargs` go to `evaluate.load` (e.g. `experiment_id`, `num_process`/`process_id` for distributed
    evaluation, `keep_in_memory=True`). `metric.compute(predictions=[...], references=[[...], ...])` returns
    `score`, `counts`, `totals`, `precisions`, `bp`, `sys_len`, `ref_len` and `signature`.

    evaluate imports a copy of the module from its modules cache; a copy that fails to load (emptied, cut short) is
    named in a warning, removed and copied again.
    """
    import evaluate

    try:
        return evaluate.load(str(SACREBLEU_LOCAL_PATH), **kwargs)
    except Exception as error:  # evaluate imports its cached copy of the script: a damaged copy is copied again
        if "download_mode" in kwargs:
            raise
        copies = Path(evaluate.config.HF_MODULES_CACHE) / "evaluate_modules" / "metrics" / SACREBLEU_LOCAL_PATH.name
        remove_damaged(copies, f"{type(error).__name__}: {error}", "copying the sacreBLEU module again")
        stale = f"evaluate_modules.metrics.{SACREBLEU_LOCAL_PATH.name}"  # the damaged module, imported already
        for name in [name for name in sys.modules if name.startswith(stale)]:
            del sys.modules[name]
        importlib.invalidate_caches()
        return evaluate.load(str(SACREBLEU_LOCAL_PATH), download_mode="force_redownload", **kwargs)


def _read_refs(refs: RefsArg, name: str) -> list[list[str]]:
    """-> list of reference streams (sacrebleu layout: streams[k][i] = k-th reference of segment i)."""
    if isinstance(refs, (str, os.PathLike)):
        from ..data import read_lines

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
            "Moses-tokenized BLEU (tok_bleu with tokenized_method='moses', paper_bleu) needs sacremoses: "
            "`pip install sacremoses` (or pass tokenized_method='13a' and with_paper_bleu=False to compute_bleu)."
        ) from None
    return MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)


def moses_lc_tokenize(sentences: Sequence[str], lang: str) -> list[str]:
    """Lowercase → Moses punctuation normalization → Moses tokenization (escaped), as Multi30k's `tok/` files.

    Needs `sacremoses`. `lang` is the text's language code (`"en"`, `"de"`, ...).
    """
    norm, tok = _moses(lang)
    return [tok.tokenize(norm.normalize(s.lower()), return_str=True, escape=True) for s in sentences]


# get_ende_bleu.sh's `perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'`: non-overlapping, so "a-b-c" keeps "b-c".
_COMPOUND_HYPHEN = re.compile(r"(\S)-(\S)")
_COMPOUND_SPLIT_LANGS = frozenset({"de"})


def _check_lang(target_lang) -> str:
    """-> the primary subtag, lowercased ("de-AT" -> "de"): what Moses's rules and the compound splitting key on."""
    if not isinstance(target_lang, str) or not re.fullmatch(r"[A-Za-z]+(?:[-_][A-Za-z0-9]+)*", target_lang):
        raise ValueError(f"target_lang must be a language code such as 'de', 'fr' or 'de-AT' (Moses's tokenizer "
                         f"rules and whether compounds are split depend on it), got {target_lang!r}.")
    return re.split(r"[-_]", target_lang)[0].lower()


# Languages written without spaces between words -> sacreBLEU's tokenizer for them (None: it has none that runs here).
_UNSPACED = {"zh": "zh", "ja": "ja-mecab", "th": None, "lo": None, "km": None, "my": None}
_UNSPACED_NAMES = {"zh": "Chinese", "ja": "Japanese", "th": "Thai", "lo": "Lao", "km": "Khmer", "my": "Burmese"}


def bleu_tokenizer(target_lang: str) -> str | None:
    """The sacreBLEU tokenizer that BLEU of `target_lang` output needs in place of Moses's and `13a`, which split
    at spaces: "zh" for Chinese, "ja-mecab" for Japanese; None for a language written with spaces (the paper's form
    and `13a` apply).

    Raises:
        ValueError: a `target_lang` that is not a language code; Japanese without MeCab (`pip install
            'sacrebleu[ja]'`); Thai, Lao, Khmer or Burmese, which no installed tokenizer splits into words (chrF or
            character BLEU is what to use instead).
    """
    lang = _check_lang(target_lang)
    if lang not in _UNSPACED:
        return None
    name, tokenizer = _UNSPACED_NAMES[lang], _UNSPACED[lang]
    if tokenizer is None:
        raise ValueError(f"BLEU of {name} ({target_lang}) output is undefined here: {name} is written without spaces "
                         f"between words, and neither the paper's form (Moses tokens) nor sacreBLEU's 13a splits it, "
                         f"so identical output would score 0. Score it with chrF (sacrebleu.CHRF()) or character "
                         f"BLEU (sacrebleu.BLEU(tokenize='char')).")
    try:
        sacrebleu.BLEU(tokenize=tokenizer)
    except (ImportError, RuntimeError):
        raise ValueError(f"BLEU of {name} ({target_lang}) output needs sacreBLEU's {tokenizer} tokenizer (the paper's "
                         f"form and 13a split at spaces, which {name} does not have, so identical output would score "
                         f"0), and MeCab is not installed: pip install 'sacrebleu[ja]'.") from None
    return tokenizer


def _check_has_ngrams(metric, streams: list[list[str]], form: str) -> None:
    """Refuse references without a single 4-gram: BLEU-4 is 0 on them whatever the output, identical output included."""
    tokenize = metric.tokenizer if callable(getattr(metric, "tokenizer", None)) else str
    if not any(len(tokenize(r).split()) >= metric.max_ngram_order for stream in streams for r in stream):
        raise ValueError(f"{form}: no reference has {metric.max_ngram_order} tokens, so BLEU-{metric.max_ngram_order} "
                         f"would be 0 whatever the hypotheses (identical ones too). Score a corpus with longer "
                         f"sentences, or use chrF (sacrebleu.CHRF()).")


def paper_tokenize(sentences: Sequence[str], lang: str, *, compound_splitting: bool | None = None) -> list[str]:
    """Detokenized sentences as `get_ende_bleu.sh` hands them to `multi-bleu.perl`: Moses `tokenizer.perl -l
    lang` (sacremoses: cased, HTML escaping on, no aggressive hyphen splitting), then, when `compound_splitting`
    (default: `lang == "de"`), every hyphen between two non-spaces becomes ` ##AT##-##AT## `.

    Returns one space-separated token string per sentence. Raises ValueError for a `lang` that is not a language
    code or is written without spaces (`bleu_tokenizer`); ImportError without sacremoses.
    """
    if bleu_tokenizer(lang) is not None:
        raise ValueError(f"paper_tokenize: Moses's tokenizer splits at spaces, which {lang!r} text does not have; "
                         f"paper_bleu scores it with sacreBLEU's {bleu_tokenizer(lang)!r} tokenizer instead.")
    lang = _check_lang(lang)
    split = lang in _COMPOUND_SPLIT_LANGS if compound_splitting is None else compound_splitting
    tok = _moses(lang)[1]
    out = [tok.tokenize(s, return_str=True, escape=True) for s in sentences]
    return [_COMPOUND_HYPHEN.sub(r"\1 ##AT##-##AT## \2", s) for s in out] if split else out


def paper_bleu(
    hypotheses: Sequence[str],
    references: RefsArg,
    *,
    target_lang: str,
    compound_splitting: bool | None = None,
) -> dict[str, Any]:
    r"""BLEU as the paper reports it in Table 2 (§6.1): cased, Moses-tokenized, German compounds split.

    tensor2tensor's `tensor2tensor/utils/get_ende_bleu.sh`, the script behind the paper's En-De figures (and the
    recipe Łukasz Kaiser gave in tensor2tensor issue #61, June 2017), runs `tokenizer.perl -l de` on the
    detokenized decodes; the reference `newstest2014.tok.de` went through the same `tokenizer.perl -q -l de`
    (google/seq2seq `bin/data/wmt16_en_de.sh`). Both sides are then put "in ATAT format (comparable to papers like
    GNMT, ConvS2S)" with `perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'` and scored by
    `multi-bleu.perl ref < hyp`: whitespace tokens, case-sensitive, no smoothing, closest-reference brevity penalty.
    Here the same steps run on both sides: `paper_tokenize` (sacremoses' Python port of a recent `tokenizer.perl`),
    then sacreBLEU with `tokenize="none"`, `smooth_method="none"`, which computes what `multi-bleu.perl` computes.
    The paper's En-Fr figure is the plain form: the same without compound splitting, the default for every target
    but German.

    Not reproduced: later versions of the script also pass the decodes (not the reference) through
    `replace-unicode-punctuation.perl`, and the reference tensor2tensor published for its En-De checkpoints had its
    German quotes („ “) replaced by `"` (tensor2tensor issue #317), so that they tokenize to `&quot;` on both sides.
    Here both sides keep their own quotes.

    Chinese and Japanese have no such form (Moses splits at spaces): they are scored with sacreBLEU's `zh` or
    `ja-mecab` tokenizer, otherwise as above, and the signature starts with `tok:zh in place of moses-tok(zh)`.

    Args:
        hypotheses: system outputs, one detokenized string per segment.
        references: raw (cased, untokenized) references, as `compute_bleu` takes them: a list of strings, a list of
            lists of strings, or a file path.
        target_lang: language of the hypotheses (`"de"`, `"fr"`, ...), for Moses's rules.
        compound_splitting: split hyphenated compounds; default `target_lang == "de"` (the paper's En-De form).

    Returns:
        dict with `bleu` (float 0–100), `signature` (str, e.g. `moses-tok(de)+compound-split(##AT##)|multi-bleu|
        nrefs:1|case:mixed|eff:no|tok:none|smooth:none|version:2.6.0`), `counts` and `totals` (matched and
        hypothesis n-grams, n = 1..4, over the tokens above), `precisions` (percent), `bp`, `sys_len`, `ref_len`.

    Raises:
        ValueError: as `compute_bleu` for the hypotheses and references; a `target_lang` that is not a language
            code, or one `bleu_tokenizer` refuses; references without a 4-gram.
        ImportError: without sacremoses.
    """
    lang = _check_lang(target_lang)
    hyps = _check_hyps(hypotheses)
    streams = _read_refs(references, "references")
    _check_lengths(hyps, streams, "references")
    return _paper_score(hyps, streams, lang, compound_splitting)


def _paper_score(hyps: list[str], streams: list[list[str]], lang: str, compound_splitting: bool | None):
    unspaced = bleu_tokenizer(lang)
    if unspaced is not None:  # multi-bleu's computation on the language's own tokens
        metric = sacrebleu.BLEU(tokenize=unspaced, smooth_method="none", force=True)
        _check_has_ngrams(metric, streams, "paper_bleu")
        res = metric.corpus_score(hyps, streams)
        return dict(bleu=res.score, signature=f"tok:{unspaced} in place of moses-tok({lang})|multi-bleu|"
                    f"{metric.get_signature()}", counts=res.counts, totals=res.totals, precisions=res.precisions,
                    bp=res.bp, sys_len=res.sys_len, ref_len=res.ref_len)
    split = lang in _COMPOUND_SPLIT_LANGS if compound_splitting is None else bool(compound_splitting)
    tok_hyps = paper_tokenize(hyps, lang, compound_splitting=split)
    tok_streams = [paper_tokenize(stream, lang, compound_splitting=split) for stream in streams]
    metric = sacrebleu.BLEU(tokenize="none", smooth_method="none", force=True)
    _check_has_ngrams(metric, tok_streams, "paper_bleu")
    res = metric.corpus_score(tok_hyps, tok_streams)
    steps = f"moses-tok({lang})" + ("+compound-split(##AT##)" if split else "")
    return dict(bleu=res.score, signature=f"{steps}|multi-bleu|{metric.get_signature()}", counts=res.counts,
                totals=res.totals, precisions=res.precisions, bp=res.bp, sys_len=res.sys_len, ref_len=res.ref_len)


def compute_bleu(
    hypotheses: Sequence[str],
    references: RefsArg | None = None,
    lowercase_tokenized_references: RefsArg | None = None,
    *,
    target_lang: str = "en",
    tokenized_method: str = "moses",
    with_paper_bleu: bool = True,
) -> dict[str, Any]:
    """Corpus BLEU of detokenized `hypotheses`.

    Args:
        hypotheses: system outputs, one detokenized string per segment.
        references: raw (cased, untokenized) references: a list of strings, a list of lists of strings
            (several references per segment), or a file path (plain or `.gz`, one per line). Gives `bleu`.
        lowercase_tokenized_references: the official lowercased tokenized references (e.g.
            `vaswani_hf.data.multi30k_file("test", "en", tokenized_lowercased=True)`); gives `tok_bleu`.
        target_lang: language of the hypotheses, for Moses tokenization (`"en"` for De→En); Chinese and Japanese
            are scored with sacreBLEU's `zh` and `ja-mecab` tokenizers in `bleu` and `paper_bleu`
            (`bleu_tokenizer`; their signatures say so).
        tokenized_method: `"moses"` (default, the published Multi30k number; needs sacremoses) or `"13a"`.
        with_paper_bleu: with `references`, also the paper's Table 2 form (`paper_bleu`: cased, Moses-tokenized,
            compounds split when `target_lang` is `"de"`; needs sacremoses).

    Returns:
        dict with (when `references` given) `bleu` (float 0–100), `signature` (str), `counts`,
        `totals`, `precisions`, `bp`, `sys_len`, `ref_len`, and with `with_paper_bleu` `paper_bleu` (float
        0–100) and `paper_signature` (str); and (when
        `lowercase_tokenized_references` given) `tok_bleu` (float 0–100) and `tok_signature` (str
        naming the preprocessing, e.g. `lc+moses-norm+moses-tok(en)|multi-bleu|nrefs:1|...`).

    Raises:
        ValueError: neither reference kind given, count mismatch between hypotheses and references, a
            non-string hypothesis, unknown `tokenized_method`, a `target_lang` that is not a language code or that
            `bleu_tokenizer` refuses (Thai, Japanese without MeCab, ...), `lowercase_tokenized_references` for a
            language written without spaces, references without a 4-gram (BLEU-4 would be 0 whatever the output).
        ImportError: `tokenized_method="moses"` or `with_paper_bleu` without sacremoses installed.
    """
    if references is None and lowercase_tokenized_references is None:
        raise ValueError("give `references` (raw, for sacreBLEU) and/or `lowercase_tokenized_references`.")
    if tokenized_method not in ("moses", "13a"):
        raise ValueError(f"tokenized_method must be 'moses' or '13a', got {tokenized_method!r}.")
    hyps = _check_hyps(hypotheses)
    unspaced = bleu_tokenizer(target_lang)
    if unspaced is not None and lowercase_tokenized_references is not None:
        raise ValueError(f"lowercase_tokenized_references: tokenized BLEU compares Moses tokens, which {target_lang!r} "
                         f"text does not have (no spaces between words); leave them out: `bleu` and `paper_bleu` "
                         f"score it with sacreBLEU's {unspaced!r} tokenizer.")
    out: dict[str, Any] = {}
    if references is not None:
        streams = _read_refs(references, "references")
        _check_lengths(hyps, streams, "references")
        metric = sacrebleu.BLEU(tokenize=unspaced or "13a")
        _check_has_ngrams(metric, streams, "references")
        res = metric.corpus_score(hyps, streams)
        out.update(
            bleu=res.score, signature=str(metric.get_signature()), counts=res.counts, totals=res.totals,
            precisions=res.precisions, bp=res.bp, sys_len=res.sys_len, ref_len=res.ref_len,
        )
        if with_paper_bleu:
            paper = _paper_score(hyps, streams, _check_lang(target_lang), None)
            out.update(paper_bleu=paper["bleu"], paper_signature=paper["signature"])
    if lowercase_tokenized_references is not None:
        streams = _read_refs(lowercase_tokenized_references, "lowercase_tokenized_references")
        _check_lengths(hyps, streams, "lowercase_tokenized_references")
        if tokenized_method == "moses":
            tok_hyps = moses_lc_tokenize(hyps, target_lang)
            metric = sacrebleu.BLEU(tokenize="none", smooth_method="none", force=True)
            _check_has_ngrams(metric, streams, "lowercase_tokenized_references")
            res = metric.corpus_score(tok_hyps, streams)
            prefix = f"lc+moses-norm+moses-tok({target_lang})|multi-bleu"
        else:
            streams = [[html.unescape(r) for r in s] for s in streams]
            metric = sacrebleu.BLEU(tokenize="13a", lowercase=True, smooth_method="none", force=True)
            res = metric.corpus_score(hyps, streams)
            prefix = "approx:unescaped-refs+13a-lc"
        # lowercased before sacreBLEU sees the text: its signature's "case:mixed" would misname the comparison
        signature = str(metric.get_signature()).replace("case:mixed", "case:lc")
        out.update(tok_bleu=res.score, tok_signature=f"{prefix}|{signature}")
    return out
