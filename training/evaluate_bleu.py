"""Score a trained model on a test set: detokenized sacreBLEU, the paper's tokenized BLEU (Table 2's form) and, on
Multi30k, lowercased tokenized BLEU.

    vaswani-evaluate --model outputs/multi30k-de-en                  # Multi30k test2016, beam 4, lp 0.6
    vaswani-evaluate --model DIR --test_file data/test --source_lang de --target_lang en --output scores.json

It prints the scores; `--output FILE` also writes them as JSON (nothing is written into the model folder unless
`--output` names a file there, such as `DIR/test_metrics.json`). The metrics JSON records the fingerprint of the
weights it scored (`weights_sha256`), so that `vaswani-publish --metrics` never pairs it with other weights. It never
replaces another file of the model folder (a training run's metrics.json) nor another run's metrics.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file (python training/evaluate_bleu.py): import as vaswani_training
    __package__ = "vaswani_training"

from vaswani_hf.checks import CheckError  # noqa: E402

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


def check_not_run_metrics(output: Path, model_dir: Path) -> None:
    """Refuse an --output that would replace what a run wrote: an existing file of the model folder other than this
    command's own test_metrics.json (the run's metrics.json: its training metrics would be lost), or anywhere a JSON
    file of a training run's metrics (it holds `train_steps`).

    Raises:
        CheckError: naming the file and another --output.
    """
    if not output.is_file():
        return
    inside = output.resolve().parent == model_dir.resolve()
    if inside and output.name != "test_metrics.json":
        raise CheckError(f"--output {output} is a file of the model folder {model_dir}; writing the scores there would "
                         f"replace it (the run's own metrics). Write to {model_dir / 'test_metrics.json'} or to a "
                         f"new file.")
    try:
        held = json.loads(output.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(held, dict) and "train_steps" in held:
        raise CheckError(f"--output {output} holds a training run's metrics ({len(held)} fields, train_steps "
                         f"{held['train_steps']}); the scores would replace them. Choose a new file.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", "--model_dir", required=True, help="A saved model folder (with its tokenizer).")
    parser.add_argument("--test_file", default=None,
                        help="Parallel files PREFIX.{src,tgt}[.gz] or a .jsonl file (default: Multi30k test2016).")
    parser.add_argument("--source_lang", default="de")
    parser.add_argument("--target_lang", default="en")
    parser.add_argument("--num_beams", type=int, default=None, help="Beam size (default: the model's, 4).")
    parser.add_argument("--length_penalty", type=float, default=None,
                        help="Length penalty alpha (default: the model's generation_config.json: what its training run "
                             "chose on validation, else 0.6).")
    parser.add_argument("--length_penalty_style", choices=["hf", "gnmt"], default=None,
                        help="hf: transformers' score / |Y|^alpha; gnmt: the paper's ((5+|Y|)/6)^alpha and at most "
                             "input length + 50 tokens (§6.1). Default: the model's, else hf.")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--max_test_samples", type=int, default=None)
    parser.add_argument("--output", default=None,
                        help="Also write the metrics JSON here, e.g. <model>/test_metrics.json (default: print only).")
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)

    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    import vaswani_hf  # noqa: F401
    from vaswani_hf.checks import check_model_folder, check_output_file, weights_fingerprint
    from vaswani_hf.data import load_multi30k, load_parallel_dataset

    from .inputs import check_device, check_sentence_lengths
    from .output_dir import write_json_atomic
    from .prepare import select

    for name in ("num_beams", "batch_size", "max_test_samples"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name} must be >= 1, got {value}.")
    if args.length_penalty is not None and not math.isfinite(args.length_penalty):
        raise SystemExit(f"--length_penalty must be a finite number, got {args.length_penalty}.")
    if args.length_penalty is not None and args.num_beams == 1:
        raise SystemExit("--length_penalty ranks the finished hypotheses of a beam search, and --num_beams 1 (greedy "
                         "search) has none to rank: leave --length_penalty out, or pass --num_beams 2 or more.")
    output = Path(args.output) if args.output else None
    try:  # a vaswani model folder with complete safetensors weights and its tokenizer; a writable --output
        data_args = DataArguments(source_lang=args.source_lang, target_lang=args.target_lang,
                                  test_file=args.test_file)  # --target_lang whose BLEU is defined
        check_model_folder(args.model)
        device = check_device(args.device)
        if output is not None:
            check_output_file(output, flag="--output")
            check_not_run_metrics(output, Path(args.model))
    except CheckError as error:
        raise SystemExit(str(error)) from None
    try:  # the test set's own checks (files, languages, records): one line, as the checks above
        if args.test_file:
            test = load_parallel_dataset(args.test_file, args.source_lang, args.target_lang)
        else:
            test = load_multi30k(args.source_lang, args.target_lang, splits=("test",))["test"]
    except CheckError as error:
        raise SystemExit(str(error)) from None
    test = select(test, args.max_test_samples)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model, use_safetensors=True).to(device)
    where = args.test_file or "Multi30k test2016"
    sources = [t[args.source_lang] for t in test["translation"]]
    try:  # every sentence fits the model before the first batch is translated
        check_sentence_lengths(model, tokenizer, sources, names=[f"{where}, pair {i + 1}" for i in range(len(sources))])
    except CheckError as error:
        raise SystemExit(str(error)) from None
    result = evaluate_test_set(model, tokenizer, test, data_args, batch_size=args.batch_size,
                               num_beams=args.num_beams, length_penalty=args.length_penalty,
                               is_multi30k=args.test_file is None,
                               length_penalty_style=args.length_penalty_style)
    result["metrics"]["weights_sha256"] = weights_fingerprint(args.model)
    for key, value in result["metrics"].items():
        print(f"{key}: {value}")
    if output is not None:
        write_json_atomic(output, result["metrics"])
        print(f"Scores written to {output}")
    else:
        print(f"Scores not written: --output FILE keeps them (e.g. --output {Path(args.model) / 'test_metrics.json'}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
