"""Publishing: write a Hub-ready folder from a trained model folder, and optionally upload it to the Hugging Face
Hub.

    vaswani-publish --model_dir outputs/multi30k-de-en --output_dir outputs/hub/multi30k-de-en
    vaswani-publish --model_dir outputs/multi30k-de-en --output_dir outputs/hub/multi30k-de-en \\
        --push_to_hub --hub_model_id you/vaswani-multi30k-de-en

(`vaswani-train --push_to_hub --hub_model_id you/NAME` does both at the end of training, into `output_dir/hub`.)

The folder holds what `AutoModelForSeq2SeqLM.from_pretrained(repo, trust_remote_code=True)` needs, and nothing else:

- `model.safetensors` (the embedding shared by encoder, decoder and output projection stored once, §3.4),
  `config.json` with the `auto_map` that points the Auto classes at the code below, `generation_config.json`
  (the model folder's: the beam, the length penalty alpha and its form that the run chose on validation, §6.1,
  which `generate()` applies; a model that chose nothing has beam 4 and 0.6 in transformers' form, |Y|^0.6);
- the seven model code files (`HUB_CODE_FILES`: configuration, modeling, generation, loading, inputs, kernels and
  fast paths): the only code, importing nothing but torch, transformers, safetensors and each other;
- `tokenizer.json` and `tokenizer_config.json`: the joint BPE as a plain fast tokenizer (no tokenizer code);
- `README.md`: the model card, rendered (Jinja2, `huggingface_hub.ModelCard.from_template`) from `model_card.md` at
  the repository root (installed with the commands as package data of vaswani_training): Hub metadata (languages,
  license, dataset, base model, BLEU, tags, a model-index with the run's test BLEU read from its `metrics.json`), the
  model's history (trained from scratch or fine-tuned from which model, on which data, how many updates), usage with
  `trust_remote_code=True`, training details and citations.

A `metrics.json` that describes other weights than the folder's (it records their fingerprint, `weights_sha256`; one
without it must not be older than the weights) is refused: a card never publishes another model's BLEU.

The folder is written under a temporary name beside `--output_dir` and renamed when complete, with the modes the
user's umask gives. Uploading uses `huggingface_hub.HfApi.create_repo` and `upload_folder`; `--hub_endpoint` (or
HF_ENDPOINT) picks another Hub server, which must answer before anything is written.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python training/publish.py): import as vaswani_training
    __package__ = "vaswani_training"

from .lib.publishing import check_hub_reachable, push_folder, write_hub_folder  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", "--model", required=True, help="A trained model folder with its tokenizer "
                                                           "(a training output_dir).")
    parser.add_argument("--output_dir", required=True, help="The Hub-ready folder to write.")
    parser.add_argument("--metrics", default=None, help="The run's metrics.json (default: MODEL_DIR/metrics.json).")
    parser.add_argument("--model_card_template", default=None,
                        help="Jinja2 model card template (default: model_card.md at the repository root, installed "
                             "with the commands).")
    parser.add_argument("--license", default=None, help="Hub license id for the card (default: 'other' with the "
                                                        "Multi30k terms for Multi30k runs, else 'unknown').")
    parser.add_argument("--force", action="store_true", help="Replace --output_dir if it exists.")
    parser.add_argument("--space", action="store_true", help="Also write the vaswani-demo page (app.py, "
                        "requirements.txt): pushed as a Space (`hf upload NAME FOLDER --repo-type space`), it runs.")
    parser.add_argument("--push_to_hub", action="store_true", help="Upload the folder to --hub_model_id.")
    parser.add_argument("--hub_model_id", default=None,
                        help="namespace/name of the Hub repository (default: the output_dir's name).")
    parser.add_argument("--hub_token", default=None, help="Hub token (default: HF_TOKEN or the saved login).")
    parser.add_argument("--hub_private_repo", action="store_true", help="Create the repository private.")
    parser.add_argument("--hub_endpoint", default=None, help="Hub server URL (default: HF_ENDPOINT, else "
                                                             "https://huggingface.co).")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.INFO)
    repo_id = args.hub_model_id or Path(args.output_dir).name
    try:
        if args.push_to_hub:  # before anything is written
            check_hub_reachable(args.hub_endpoint)
        folder = write_hub_folder(args.model_dir, args.output_dir, repo_id=repo_id, metrics_file=args.metrics,
                                  template=args.model_card_template, license=args.license, force=args.force,
                                  space=args.space)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as error:
        raise SystemExit(f"error: {error}") from None
    print(f"Hub-ready folder: {folder}")
    if args.push_to_hub:
        try:
            url = push_folder(folder, repo_id, token=args.hub_token, private=args.hub_private_repo or None,
                              endpoint=args.hub_endpoint)
        except RuntimeError as error:
            raise SystemExit(f"error: {error}") from None
        print(f"Uploaded to {repo_id}: {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
