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
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python training/evaluate_bleu.py): import as vaswani_training
    __package__ = "vaswani_training"

from vaswani_hf.checks import CheckError  # noqa: E402

from .lib.arguments import DataArguments
from .lib.scoring import evaluate_test_set


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

    from .lib.inputs import check_device, check_sentence_lengths
    from .lib.output_dir import write_json_atomic
    from .lib.prepare import select

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
    from vaswani_hf.bleu import compute_bleu

    references = [t[args.target_lang] for t in test["translation"]]
    try:  # BLEU is defined on these references (the references scored as their own output), before translating
        compute_bleu(references, references, target_lang=args.target_lang)
    except ValueError as error:
        raise SystemExit(f"error: {where}: the references cannot be scored: {error}") from None
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
