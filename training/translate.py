"""Translate sentences with a trained model, like `fairseq-interactive` / `fairseq-generate`.

    vaswani-translate --model outputs/multi30k-de-en < sentences.de > out.en
    vaswani-translate --model outputs/multi30k-de-en --input sentences.de --output out.en --num_beams 4

Reads one sentence a line (file or stdin), writes one translation a line (file, written atomically, or stdout).
Decoding defaults to the model's `generate()` with its generation_config.json: the beam, length penalty and its form
that its training run chose on validation (§6.1), else beam 4 and 0.6 applied as transformers does (score /
|Y|^0.6); at most input length + 50 tokens. `--length_penalty_style gnmt` decodes as the paper does (§6.1): GNMT's
penalty, score / ((5 + |Y|) / 6)^alpha (`vaswani_hf.decoding.paper_generate`).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python training/translate.py): import as vaswani_training
    __package__ = "vaswani_training"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", "--model_dir", required=True, help="A saved model folder (with its tokenizer).")
    parser.add_argument("--input", default="-", help="Source sentences, one a line; '-' for stdin (default).")
    parser.add_argument("--output", default="-", help="Where translations go; '-' for stdout (default).")
    parser.add_argument("--num_beams", type=int, default=None, help="Beam size (default: the model's, 4).")
    parser.add_argument("--length_penalty", type=float, default=None,
                        help="Length penalty alpha (default: the model's generation_config.json, what its training "
                             "run chose on validation, else 0.6), applied as --length_penalty_style says.")
    parser.add_argument("--length_penalty_style", choices=["hf", "gnmt"], default=None,
                        help="hf: transformers' score / |Y|^alpha; gnmt: the paper's score / ((5+|Y|)/6)^alpha "
                             "(§6.1). Default: the model's generation_config.json, else hf.")
    parser.add_argument("--batch_size", type=int, default=64, help="Sentences per batch (default 64).")
    parser.add_argument("--max_new_tokens", type=int, default=None,
                        help="Maximum output length (default: input length + 50); both length penalty styles.")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps (default: cuda if available).")
    parser.add_argument("--trust_remote_code", action="store_true",
                        help="Allow a Hub-style folder's own model code to run (only for folders you trust).")
    return parser


def decode_lines(raw: bytes, name: str) -> list[str]:
    """UTF-8 bytes -> lines, ended by "\\n", "\\r\\n" or a lone "\\r" but never by U+2028 and the like inside a
    sentence (`vaswani_hf.data.split_lines`, as the training data is read), so the output stays aligned with the
    input; empty lines kept.

    Raises:
        SystemExit: bytes that are not UTF-8, naming `name`, the line and the byte.
    """
    from vaswani_hf.data import split_lines

    lines = []
    for lineno, chunk in enumerate(split_lines(raw), start=1):
        try:
            lines.append(chunk.decode("utf-8"))
        except UnicodeDecodeError as error:
            raise SystemExit(f"{name}:{lineno}: not valid UTF-8 (byte {chunk[error.start:error.start + 1]!r} at byte "
                             f"offset {error.start} of the line). Re-encode the input as UTF-8, e.g. "
                             f"`iconv -f latin1 -t utf-8`.") from None
    if lines and lines[0].startswith("\ufeff"):
        lines[0] = lines[0][1:]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    import vaswani_hf  # noqa: F401  (registers the model with the Auto classes)
    from vaswani_hf.decoding.translate import translate_sentences

    from .lib.output_dir import write_lines_atomic

    if args.batch_size < 1:
        raise SystemExit(f"--batch_size must be >= 1, got {args.batch_size}.")
    if args.num_beams is not None and args.num_beams < 1:
        raise SystemExit(f"--num_beams must be >= 1, got {args.num_beams}.")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise SystemExit(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}.")
    if args.length_penalty is not None and not math.isfinite(args.length_penalty):
        raise SystemExit(f"--length_penalty must be a finite number, got {args.length_penalty}.")
    model_dir = Path(args.model)
    from vaswani_hf.checks import CheckError, check_model_folder, check_output_file

    from .lib.inputs import check_device, check_sentence_lengths

    try:  # a vaswani model folder with complete safetensors weights and its tokenizer
        check_model_folder(model_dir, trust_remote_code=args.trust_remote_code)
        device = check_device(args.device)
        if args.output != "-":  # found now, not after every sentence is translated
            check_output_file(args.output, flag="--output")
            output = Path(args.output).resolve()
            if args.input != "-" and output == Path(args.input).resolve():
                raise CheckError(f"--output {args.output} is the --input file; the translations would replace the "
                                 f"sentences. Choose another --output.")
            if output.parent == model_dir.resolve() and output.exists():
                raise CheckError(f"--output {args.output} is a file of the model folder {model_dir}; choose another "
                                 f"--output.")
    except CheckError as error:
        raise SystemExit(str(error)) from None
    if args.input == "-":
        stdin = getattr(sys.stdin, "buffer", None)
        lines = decode_lines(stdin.read() if stdin is not None else sys.stdin.read().encode("utf-8"), "stdin")
    else:
        path = Path(args.input)
        if not path.is_file():
            raise SystemExit(f"--input {path}: no such file.")
        lines = decode_lines(path.read_bytes(), str(path))
    if not any(line.strip() for line in lines):
        raise SystemExit(f"No input sentences: {'stdin' if args.input == '-' else args.input} is empty.")
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=args.trust_remote_code)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, trust_remote_code=args.trust_remote_code,
                                                  use_safetensors=True).to(device)
    where = "stdin" if args.input == "-" else args.input
    try:  # every sentence fits the model before the first batch is translated
        check_sentence_lengths(model, tokenizer, lines, names=[f"{where}:{i + 1}" for i in range(len(lines))])
    except CheckError as error:
        raise SystemExit(str(error)) from None
    generate_fn, style = None, {}
    if args.length_penalty_style == "gnmt":
        from vaswani_hf.decoding.paper import paper_generate

        generation = model.generation_config
        alpha = args.length_penalty if args.length_penalty is not None else (
            generation.length_penalty if generation.length_penalty is not None else 0.6)
        beams = args.num_beams or generation.num_beams or 4
        # --max_new_tokens caps every output as in hf style; without it the paper's input length + 50 (§6.1).
        limits = {"max_len_a": 0.0, "max_len_b": args.max_new_tokens} if args.max_new_tokens else {}
        generate_fn = lambda m, **kw: paper_generate(  # noqa: E731
            m, kw["input_ids"], kw["attention_mask"], num_beams=beams, alpha=alpha, **limits)
    elif args.length_penalty_style == "hf" and getattr(model.generation_config, "length_penalty_style", None) == "gnmt":
        style = {"length_penalty_style": "hf"}  # over the folder's own choice
    # Empty lines stay empty lines, so the output aligns with the input line by line.
    index = [i for i, line in enumerate(lines) if line.strip()]
    translated = translate_sentences(model, tokenizer, [lines[i] for i in index], batch_size=args.batch_size,
                                     num_beams=args.num_beams, length_penalty=args.length_penalty,
                                     max_new_tokens=args.max_new_tokens, generate_fn=generate_fn, **style)
    out = [""] * len(lines)
    for i, text in zip(index, translated):
        out[i] = text
    if args.output == "-":
        sys.stdout.write("".join(line + "\n" for line in out))
    else:
        write_lines_atomic(args.output, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
