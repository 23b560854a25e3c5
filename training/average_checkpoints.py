"""Average the last N checkpoints of a training run into one model, as the paper does (§6.1: the last 5 checkpoints
for base models, the last 20 for big ones), like fairseq's `scripts/average_checkpoints.py`.

    vaswani-average --checkpoint_dir outputs/multi30k-de-en --last 5 --output_dir outputs/multi30k-de-en/averaged
    vaswani-average --checkpoints run/checkpoint-9000 run/checkpoint-10000 --output_dir run/averaged

`checkpoint-<step>` folders are ordered by step number. The output folder is a normal model folder (weights,
config, generation config, tokenizer) that `AutoModelForSeq2SeqLM.from_pretrained` and `vaswani-translate` load.
Weights are read with safetensors only; a truncated checkpoint or one holding NaN is refused, naming it. Each
checkpoint must pass `check_model_folder` first, and the newest, whose tokenizer the average carries, with its
tokenizer.

The output is written whole under a temporary name beside `--output_dir`, then renamed. It must be a new folder or an
earlier average (holding only what an average writes), and never a `checkpoint-<step>` name, which resuming, averaging
and Trainer's rotation would take for a checkpoint of the run.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python training/average_checkpoints.py): import as vaswani_training
    __package__ = "vaswani_training"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint_dir", help="A Trainer output_dir holding checkpoint-<step> folders.")
    which.add_argument("--checkpoints", nargs="+", help="Explicit checkpoint folders to average.")
    parser.add_argument("--num_checkpoints", "--last", dest="num_checkpoints", type=int, default=5,
                        help="With --checkpoint_dir: average the newest N checkpoints (default 5, the paper's base "
                             "models; 20 for big).")
    parser.add_argument("--output_dir", required=True, help="Folder to write the averaged model to.")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from vaswani_hf.averaging import (
        average_checkpoints,
        average_last_checkpoints,
        check_average_output,
        find_checkpoints,
        save_averaged_model,
    )
    from vaswani_hf.checks import CheckError, check_model_folder, check_output_dir, check_output_not_in_inputs

    try:
        output = Path(args.output_dir)
        if re.fullmatch(r"checkpoint-\d+", output.name):
            raise CheckError(f"--output_dir {output}: a checkpoint-<step> name is read as a checkpoint of a training "
                             f"run (resuming and averaging would pick it up; Trainer's rotation deletes old ones), "
                             f"and it may be one. Choose another name, e.g. {output.parent / 'averaged'}.")
        # The averaged model must not replace the run's own model (output_dir = the run folder) nor a folder that
        # holds the checkpoints; a new folder inside the run (run/averaged) is fine.
        inputs = [args.checkpoint_dir] if args.checkpoint_dir is not None else args.checkpoints
        check_output_not_in_inputs(args.output_dir, inputs, input_flag="--checkpoint_dir" if args.checkpoint_dir
                                   else "--checkpoints", allow_inside=True)
        check_output_dir(args.output_dir)
        if args.checkpoint_dir is not None:
            chosen = find_checkpoints(args.checkpoint_dir)[-args.num_checkpoints:] if args.num_checkpoints > 0 else []
        else:
            chosen = [Path(p) for p in args.checkpoints]
        for folder in chosen:  # whole model folders; the newest's config and tokenizer go into the average
            check_model_folder(folder, need_tokenizer=folder == chosen[-1])
        if args.checkpoint_dir is not None:
            used = average_last_checkpoints(args.checkpoint_dir, args.num_checkpoints, args.output_dir)
        else:
            used = [Path(p) for p in args.checkpoints]
            if used[-1].is_dir():
                check_average_output(output, used[-1], used)  # before the weights are read
            save_averaged_model(average_checkpoints(used), used[-1], args.output_dir, sources=used)
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"error: {error}") from None
    print(f"Averaged {len(used)} checkpoint(s) into {args.output_dir}:")
    for path in used:
        print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
