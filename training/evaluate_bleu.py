"""Score a trained model on a test set: detokenized sacreBLEU and, on Multi30k, lowercased tokenized BLEU.

    vaswani-evaluate --model outputs/multi30k-de-en                  # Multi30k test2016, beam 4, lp 0.6
    vaswani-evaluate --model DIR --test_file data/test --source_lang de --target_lang en --output metrics.json
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="A saved model folder (with its tokenizer).")
    parser.add_argument("--test_file", default=None,
                        help="Parallel files PREFIX.{src,tgt}[.gz] or a .jsonl file (default: Multi30k test2016).")
    parser.add_argument("--source_lang", default="de")
    parser.add_argument("--target_lang", default="en")
    parser.add_argument("--num_beams", type=int, default=4)
    parser.add_argument("--length_penalty", type=float, default=0.6)
    parser.add_argument("--length_penalty_style", choices=["hf", "gnmt"], default="hf",
                        help="hf: transformers' score / |Y|^alpha; gnmt: the paper's ((5+|Y|)/6)^alpha and at most "
                             "input length + 50 tokens (§6.1).")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--max_test_samples", type=int, default=None)
    parser.add_argument("--output", default=None, help="Write the metrics JSON here (default: <model>/test_metrics.json).")
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)

    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    import vaswani_hf  # noqa: F401
    from training.common import DataArguments, evaluate_test_set, select, write_json_atomic
    from vaswani_hf.data import load_multi30k, load_parallel_dataset

    from training.checkpoints import CheckpointError, check_model_folder

    for name in ("num_beams", "batch_size", "max_test_samples"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name} must be >= 1, got {value}.")
    if not math.isfinite(args.length_penalty):
        raise SystemExit(f"--length_penalty must be a finite number, got {args.length_penalty}.")
    from training.guards import check_device
    from vaswani_hf.checks import CheckError, check_output_file

    output = Path(args.output) if args.output else Path(args.model) / "test_metrics.json"
    try:  # a vaswani model folder with complete safetensors weights and its tokenizer; a writable --output
        check_model_folder(args.model)
        device = check_device(args.device)
        check_output_file(output, flag="--output")
    except (CheckpointError, CheckError) as error:
        raise SystemExit(str(error)) from None
    data_args = DataArguments(source_lang=args.source_lang, target_lang=args.target_lang, test_file=args.test_file)
    if args.test_file:
        test = load_parallel_dataset(args.test_file, args.source_lang, args.target_lang)
    else:
        test = load_multi30k(args.source_lang, args.target_lang, splits=("test",))["test"]
    test = select(test, args.max_test_samples)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model, use_safetensors=True).to(device)
    result = evaluate_test_set(model, tokenizer, test, data_args, batch_size=args.batch_size,
                               num_beams=args.num_beams, length_penalty=args.length_penalty,
                               is_multi30k=args.test_file is None,
                               length_penalty_style=args.length_penalty_style)
    write_json_atomic(output, result["metrics"])
    for key, value in result["metrics"].items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
