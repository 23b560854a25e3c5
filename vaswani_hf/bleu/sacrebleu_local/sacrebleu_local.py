# Adapted from the "sacrebleu" metric of Hugging Face `evaluate` (Apache-2.0,
# https://github.com/huggingface/evaluate/blob/main/metrics/sacrebleu/sacrebleu.py), kept local so that
# `evaluate.load(<this folder>)` works with no network access. This file must stay self-contained (evaluate
# copies it into its module cache): import only sacrebleu, datasets and evaluate.
"""sacreBLEU as a local `evaluate` metric (offline)."""

import datasets
import evaluate
import sacrebleu as scb

_CITATION = """\
@inproceedings{post-2018-call,
    title = "A Call for Clarity in Reporting {BLEU} Scores",
    author = "Post, Matt",
    booktitle = "Proceedings of the Third Conference on Machine Translation: Research Papers",
    month = oct,
    year = "2018",
    address = "Belgium, Brussels",
    publisher = "Association for Computational Linguistics",
    url = "https://www.aclweb.org/anthology/W18-6319",
    pages = "186--191",
}
"""

_DESCRIPTION = """\
SacreBLEU (Post, 2018): shareable, comparable and reproducible corpus BLEU on detokenized text, with the
standard `13a` (mteval-v13a) tokenizer by default. Local copy of the `evaluate` sacrebleu metric that also
returns the sacreBLEU signature.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `str`): detokenized system outputs, one per segment.
    references (`list` of `list` of `str`, or `list` of `str`): references; the i-th sub-list holds the
        references of the i-th prediction, all sub-lists of the same length. A flat list means one reference each.
    smooth_method (`str`): 'exp' (default), 'none', 'floor' or 'add-k'.
    smooth_value (`float`): for 'floor' (default 0.1) or 'add-k' (default 1).
    tokenize (`str`): '13a' (default), 'none', 'intl', 'char', 'zh', ...
    lowercase (`bool`): case-insensitive BLEU. Default False.
    force (`bool`): do not warn when the input looks tokenized. Default False.
    use_effective_order (`bool`): for sentence-level BLEU. Default False.

Returns:
    'score' (0-100), 'counts', 'totals', 'precisions', 'bp', 'sys_len', 'ref_len', 'signature' (str).

Examples:
    >>> bleu = evaluate.load("vaswani_hf/bleu/sacrebleu_local")
    >>> bleu.compute(predictions=["hello there general kenobi"], references=[["hello there general kenobi"]])["score"]
    100.00000000000004
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class SacrebleuLocal(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            homepage="https://github.com/mjpost/sacreBLEU",
            inputs_description=_KWARGS_DESCRIPTION,
            features=[
                datasets.Features(
                    {
                        "predictions": datasets.Value("string", id="sequence"),
                        "references": datasets.Sequence(datasets.Value("string", id="sequence"), id="references"),
                    }
                ),
                datasets.Features(
                    {
                        "predictions": datasets.Value("string", id="sequence"),
                        "references": datasets.Value("string", id="sequence"),
                    }
                ),
            ],
            codebase_urls=["https://github.com/mjpost/sacreBLEU"],
            reference_urls=["https://github.com/mjpost/sacreBLEU", "https://aclanthology.org/W18-6319"],
        )

    def _compute(
        self,
        predictions,
        references,
        smooth_method="exp",
        smooth_value=None,
        force=False,
        lowercase=False,
        tokenize="13a",
        use_effective_order=False,
    ):
        if len(predictions) == 0:
            raise ValueError("sacrebleu_local: no predictions given.")
        # if only one reference is provided make sure we still use list of lists
        if isinstance(references[0], str):
            references = [[ref] for ref in references]
        references_per_prediction = len(references[0])
        for i, refs in enumerate(references):
            if len(refs) != references_per_prediction:
                raise ValueError(
                    f"sacrebleu_local: prediction 0 has {references_per_prediction} reference(s) but prediction "
                    f"{i} has {len(refs)}; sacreBLEU needs the same number of references for every prediction."
                )
        transformed_references = [[refs[i] for refs in references] for i in range(references_per_prediction)]
        bleu = scb.BLEU(
            lowercase=lowercase,
            force=force,
            tokenize=tokenize,
            smooth_method=smooth_method,
            smooth_value=smooth_value,
            effective_order=use_effective_order,
        )
        output = bleu.corpus_score(predictions, transformed_references)
        return {
            "score": output.score,
            "counts": output.counts,
            "totals": output.totals,
            "precisions": output.precisions,
            "bp": output.bp,
            "sys_len": output.sys_len,
            "ref_len": output.ref_len,
            "signature": str(bleu.get_signature()),
        }
