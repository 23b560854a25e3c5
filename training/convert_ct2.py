"""Convert a trained model to CTranslate2 for fast inference (CPU int8, GPU float16).

    vaswani-convert-ct2 --model_dir outputs/multi30k-de-en/averaged --output_dir outputs/ct2 --quantization int8

Then translate with CTranslate2 directly:

    import ctranslate2, transformers
    translator = ctranslate2.Translator("outputs/ct2", device="cpu")
    tokenizer = transformers.AutoTokenizer.from_pretrained("outputs/ct2")   # the tokenizer is copied too
    source = tokenizer.convert_ids_to_tokens(tokenizer("Ein Hund läuft.").input_ids)   # ends with </s>
    result = translator.translate_batch([source], beam_size=4, length_penalty=0.6, return_end_token=True)

with the beam and length penalty of the folder's `decoding.json` (what the model folder chose on validation, or for a
folder that chose the paper's GNMT penalty, which CTranslate2 has not, the nearest setting in transformers' form);

or with `vaswani_hf.decoding.ct2_translate(translator, tokenizer, sentences)`.
"""

from __future__ import annotations

import argparse
import sys

if __package__ in (None, ""):  # run as a file (python training/convert_ct2.py): import as vaswani_training
    __package__ = "vaswani_training"

QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16", "float32")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", "--model", required=True, help="A saved model folder with its tokenizer.")
    parser.add_argument("--output_dir", required=True, help="The CTranslate2 model folder to write.")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="Weight type (default: float32 as trained); int8 for CPU, float16/int8_float16 for GPU.")
    parser.add_argument("--max_positions", type=int, default=None,
                        help="Rows of the converted model's sinusoidal position table, i.e. the longest source or "
                             "output (default: the model's max_position_embeddings); refused for learned positions, "
                             "whose table the weights fix.")
    parser.add_argument("--length_penalty", type=float, default=None,
                        help="For a model folder that chose the paper's GNMT length penalty, which CTranslate2 has "
                             "not: the alpha of transformers' form (score / |Y|^alpha) to convert with (default: the "
                             "best such setting in the folder's validation scores, metrics.json).")
    parser.add_argument("--force", action="store_true", help="Replace --output_dir if it exists.")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import vaswani_hf  # noqa: F401  (registers the model with the Auto classes)
    from vaswani_hf.checks import CheckError, check_model_folder
    from vaswani_hf.decoding.ct2 import convert_to_ct2

    try:
        check_model_folder(args.model_dir)  # config, every JSON file, weights, tokenizer of the model's size
    except CheckError as error:
        raise SystemExit(f"error: {error}") from None
    try:
        path = convert_to_ct2(args.model_dir, args.output_dir, quantization=args.quantization,
                              max_positions=args.max_positions, force=args.force, length_penalty=args.length_penalty)
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as error:
        raise SystemExit(f"error: {error}") from None
    import json

    from vaswani_hf.decoding.ct2 import DECODING_FILE

    decoding = json.loads((path / DECODING_FILE).read_text(encoding="utf-8"))
    print(f"Converted {args.model_dir} to {path} ({args.quantization or 'float32'}). Translate with {decoding['note']} "
          f"(written to {path / DECODING_FILE}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
