"""Write a Hub-ready folder from a trained model folder, and optionally upload it to the Hugging Face Hub.

    vaswani-export --model_dir outputs/multi30k-de-en --output_dir outputs/hub/multi30k-de-en
    vaswani-export --model_dir outputs/multi30k-de-en --output_dir outputs/hub/multi30k-de-en \\
        --push_to_hub --hub_model_id you/vaswani-multi30k-de-en

(`vaswani-train --push_to_hub --hub_model_id you/NAME` does both at the end of training, into `output_dir/hub`.)

The folder holds what `AutoModelForSeq2SeqLM.from_pretrained(repo, trust_remote_code=True)` needs, and nothing else:

- `model.safetensors` (the embedding shared by encoder, decoder and output projection stored once, §3.4),
  `config.json` with the `auto_map` that points the Auto classes at the code below, `generation_config.json`
  (beam 4, length penalty 0.6, §6.1);
- `configuration_vaswani.py`, `modeling_vaswani.py` and `kernels_vaswani.py`: the only code, importing nothing but
  torch and transformers;
- `tokenizer.json` and `tokenizer_config.json`: the joint BPE as a plain fast tokenizer (no tokenizer code);
- `README.md`: the model card, rendered (Jinja2, `huggingface_hub.ModelCard.from_template`) from `model_card.md` at
  the repository root: Hub metadata (languages, license, dataset, BLEU, tags, a model-index with the run's test BLEU
  read from its `metrics.json`), usage with `trust_remote_code=True`, training details and citations.

The folder is written under a temporary name beside `--output_dir` and renamed when complete. Uploading uses
`huggingface_hub.HfApi.create_repo` and `upload_folder`; `--hub_endpoint` (or HF_ENDPOINT) picks another Hub server.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file (python training/export.py): import as vaswani_training
    __package__ = "vaswani_training"

logger = logging.getLogger("vaswani_hf.export")

EXPORTED_CODE = ("configuration_vaswani.py", "generation_vaswani.py", "kernels_vaswani.py", "loading_vaswani.py",
                 "modeling_vaswani.py")
DEFAULT_TEMPLATE = Path(__file__).resolve().parent.parent / "model_card.md"
HUB_SUBFOLDER = "hub"  # where the training scripts export before pushing: <output_dir>/hub
LANGUAGE_NAMES = {"de": "German", "en": "English", "fr": "French", "cs": "Czech", "ro": "Romanian", "ru": "Russian",
                  "es": "Spanish", "it": "Italian", "nl": "Dutch", "tr": "Turkish", "zh": "Chinese", "ja": "Japanese"}
EXAMPLE_SOURCES = {"de": "Zwei Hunde spielen im Schnee.", "en": "Two dogs are playing in the snow.",
                   "fr": "Deux chiens jouent dans la neige."}
MULTI30K_TERMS_URL = "https://github.com/multi30k/dataset"


def _language_name(code: str) -> str:
    return LANGUAGE_NAMES.get(code, code)


def card_data_for(metrics: dict[str, Any], *, model_name: str, source_lang: str, target_lang: str,
                  license: str | None = None):
    """The model card's YAML metadata as a `huggingface_hub.ModelCardData`.

    Languages, dataset and BLEU come from the run's `metrics` (as `training/run.py:finish` writes them); the
    model-index lists the detokenized sacreBLEU and, on Multi30k, the lowercased tokenized BLEU of the test split.
    Without a test BLEU in `metrics` there is no model-index. `license` defaults to "other" (the Multi30k terms:
    non-commercial research and education) for Multi30k runs and "unknown" otherwise.
    """
    from huggingface_hub import EvalResult, ModelCardData

    dataset = metrics.get("dataset")
    multi30k = dataset == "multi30k"
    license = license or ("other" if multi30k else "unknown")
    pair = f"{source_lang}-{target_lang}"
    results = []
    scores = [("test_bleu", "test_bleu_signature", "SacreBLEU (detokenized)"),
              ("test_tok_bleu", "test_tok_bleu_signature", "BLEU (lowercased, tokenized references)")]
    for key, signature_key, name in scores:
        if metrics.get(key) is None:
            continue
        results.append(EvalResult(
            task_type="translation", task_name=f"Translation {_language_name(source_lang)} to "
                                               f"{_language_name(target_lang)}",
            dataset_type=dataset or "custom", dataset_split="test", dataset_config=pair,
            dataset_name="Multi30k (task 1, test2016 Flickr)" if multi30k else str(dataset or "test set"),
            metric_type="bleu", metric_value=float(metrics[key]), metric_name=name,
            metric_config=metrics.get(signature_key), verified=False))
    return ModelCardData(
        language=[source_lang, target_lang],
        license=license,
        license_name="multi30k-terms" if (multi30k and license == "other") else None,
        license_link=MULTI30K_TERMS_URL if (multi30k and license == "other") else None,
        library_name="transformers",
        pipeline_tag="translation",
        tags=["translation", "transformer", "vaswani", "seq2seq"],
        datasets=[dataset] if dataset else None,
        metrics=["bleu"],
        model_name=model_name if results else None,
        eval_results=results or None,
    )


def render_model_card(model, metrics: dict[str, Any], *, repo_id: str, template: str | os.PathLike | None = None,
                      license: str | None = None, source_lang: str | None = None,
                      target_lang: str | None = None) -> str:
    """README.md text: `template` (default: model_card.md at the repository root) rendered with the metadata of
    `card_data_for` and the facts of the run (config of `model`, `metrics`).

    Raises:
        FileNotFoundError: the template does not exist.
    """
    from huggingface_hub import ModelCard

    template = Path(template) if template else DEFAULT_TEMPLATE
    if not template.is_file():
        raise FileNotFoundError(f"model card template {template} not found; pass --model_card_template.")
    source_lang = source_lang or metrics.get("source_lang", "de")
    target_lang = target_lang or metrics.get("target_lang", "en")
    model_name = repo_id.split("/")[-1]
    card_data = card_data_for(metrics, model_name=model_name, source_lang=source_lang, target_lang=target_lang,
                              license=license)
    config = model.config
    card = ModelCard.from_template(
        card_data, template_path=str(template),
        model_id=repo_id, model_name=model_name, run=metrics, config=config.to_dict(),
        source_lang=source_lang, target_lang=target_lang,
        source_name=_language_name(source_lang), target_name=_language_name(target_lang),
        multi30k=metrics.get("dataset") == "multi30k",
        num_parameters=sum(p.numel() for p in model.parameters()),
        example_source=EXAMPLE_SOURCES.get(source_lang, "..."),
    )
    return str(card)


def _read_metrics(path: Path | None) -> dict[str, Any]:
    from vaswani_hf.checks import CheckError, read_json

    if path is None or not path.is_file():
        logger.warning("No metrics.json at %s: the model card will have no test BLEU.", path)
        return {}
    metrics = read_json(path)  # an error naming the file if it does not parse
    if not isinstance(metrics, dict):
        raise CheckError(f"{path}: expected a JSON object of metrics, got {type(metrics).__name__}.")
    return metrics


def check_hub_folder(folder: str | os.PathLike) -> None:
    """Check what the export promises: the five model code files and no other code, config.json with auto_map,
    safetensors weights holding a shared embedding once, a tokenizer, generation config and README.

    Raises:
        RuntimeError: naming what is wrong.
    """
    from safetensors import safe_open

    folder = Path(folder)
    code = sorted(p.name for p in folder.rglob("*.py"))
    if code != sorted(EXPORTED_CODE):
        raise RuntimeError(f"{folder}: the code files are {code}, expected exactly {list(EXPORTED_CODE)} (did "
                           f"the model code start importing another module?).")
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "README.md"):
        if not (folder / name).is_file():
            raise RuntimeError(f"{folder}: {name} is missing.")
    config = json.loads((folder / "config.json").read_text())
    if set(config.get("auto_map", {})) != {"AutoConfig", "AutoModel", "AutoModelForSeq2SeqLM"}:
        raise RuntimeError(f"{folder}/config.json: auto_map is {config.get('auto_map')}.")
    shared = config.get("share_encoder_decoder_embeddings", True) and config.get("tie_word_embeddings", True)
    if shared and not config.get("target_vocab_size"):
        with safe_open(str(folder / "model.safetensors"), framework="pt") as weights:
            embeddings = [k for k in weights.keys()
                          if weights.get_slice(k).get_shape() == [config["vocab_size"], config["d_model"]]]
        if len(embeddings) != 1:
            raise RuntimeError(f"{folder}/model.safetensors: expected the shared embedding once, found {embeddings}.")


def export_for_hub(model_dir: str | os.PathLike, output_dir: str | os.PathLike, *, repo_id: str | None = None,
                   metrics_file: str | os.PathLike | None = None, template: str | os.PathLike | None = None,
                   license: str | None = None, force: bool = False, allow_inside: bool = False) -> Path:
    """Write the Hub-ready folder of the trained model in `model_dir` (a `save_pretrained` folder with its tokenizer,
    e.g. a training output_dir) to `output_dir`.

    Args:
        repo_id: the Hub name used in the card (default: `output_dir`'s name).
        metrics_file: the run's metrics.json (default: `model_dir/metrics.json`; missing: a card without BLEU).
        template: the model card template (default: model_card.md at the repository root).
        license: Hub license id for the card (default: see `card_data_for`).
        force: replace an existing `output_dir`. Never one that is, contains or lies inside `model_dir`.
        allow_inside: accept an `output_dir` inside `model_dir` (the training scripts' own `<output_dir>/hub`).

    Returns:
        `output_dir` as a Path.

    Raises:
        FileNotFoundError: `model_dir` has no config.json or no tokenizer; the template is missing.
        ValueError: `model_dir` holds another kind of model.
        FileExistsError: `output_dir` exists and `force` is False.
    """
    from transformers import AutoTokenizer

    import vaswani_hf  # noqa: F401  (registers the Auto classes; saved folders get auto_map and the code files)
    from vaswani_hf import VaswaniForConditionalGeneration
    from vaswani_hf.checks import check_model_folder, check_output_dir, check_output_not_in_inputs

    model_dir, output_dir = Path(model_dir), Path(output_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a saved model folder (no config.json).")
    # Replacing output_dir must never remove the model folder (a training run: checkpoints, metrics), --force or not.
    check_output_not_in_inputs(output_dir, [model_dir], allow_inside=allow_inside)
    check_model_folder(model_dir)  # config, every JSON file, weights, tokenizer of the model's size
    check_output_dir(output_dir)
    if output_dir.exists() and not force:
        raise FileExistsError(f"{output_dir} exists; pass --force to replace it.")
    metrics = _read_metrics(Path(metrics_file) if metrics_file else model_dir / "metrics.json")

    model = VaswaniForConditionalGeneration.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    readme = render_model_card(model, metrics, repo_id=repo_id or output_dir.name, template=template,
                               license=license)
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=output_dir.parent, prefix=f".{output_dir.name}.tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "README.md").write_text(readme, encoding="utf-8")
        check_hub_folder(tmp)
        if output_dir.exists():
            old = output_dir.with_name(f".{output_dir.name}.old-{os.getpid()}")
            os.replace(output_dir, old)
            os.replace(tmp, output_dir)
            shutil.rmtree(old)
        else:
            os.replace(tmp, output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output_dir


def push_folder(folder: str | os.PathLike, repo_id: str, *, token: str | None = None, private: bool | None = None,
                endpoint: str | None = None, commit_message: str = "Upload Vaswani Transformer") -> str:
    """Create the model repository `repo_id` if needed and upload `folder` to it in one commit.

    `endpoint` defaults to HF_ENDPOINT, else huggingface.co; `token` to HF_TOKEN or the saved login.

    Returns:
        The commit's URL.

    Raises:
        RuntimeError: HF_HUB_OFFLINE is set (nothing can be uploaded).
        huggingface_hub errors (e.g. `HfHubHTTPError`) for refusals of the server.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import OfflineModeIsEnabled

    api = HfApi(endpoint=endpoint or os.environ.get("HF_ENDPOINT") or None, token=token)
    try:
        repo = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        commit = api.upload_folder(repo_id=repo.repo_id, folder_path=str(folder), repo_type="model",
                                   commit_message=commit_message)
    except OfflineModeIsEnabled as error:
        raise RuntimeError(f"HF_HUB_OFFLINE is set, so nothing was uploaded; unset it and push again ({folder} "
                           f"is ready).") from error
    logger.info("Uploaded %s to %s: %s", folder, repo.repo_id, commit.commit_url)
    return commit.commit_url


def export_and_push(model_dir: str | os.PathLike, *, repo_id: str | None, token: str | None = None,
                    private: bool | None = None, endpoint: str | None = None) -> str:
    """What `--push_to_hub` of the training scripts does at the end: export `model_dir` to `model_dir/hub`
    (replacing an earlier export) and upload that folder to `repo_id` (default: `model_dir`'s name, in the token's
    namespace). Returns the commit URL."""
    model_dir = Path(model_dir)
    repo_id = repo_id or model_dir.resolve().name
    folder = export_for_hub(model_dir, model_dir / HUB_SUBFOLDER, repo_id=repo_id, force=True, allow_inside=True)
    return push_folder(folder, repo_id, token=token, private=private, endpoint=endpoint)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", required=True, help="A trained model folder with its tokenizer "
                                                           "(a training output_dir).")
    parser.add_argument("--output_dir", required=True, help="The Hub-ready folder to write.")
    parser.add_argument("--metrics", default=None, help="The run's metrics.json (default: MODEL_DIR/metrics.json).")
    parser.add_argument("--model_card_template", default=None,
                        help="Jinja2 model card template (default: model_card.md at the repository root).")
    parser.add_argument("--license", default=None, help="Hub license id for the card (default: 'other' with the "
                                                        "Multi30k terms for Multi30k runs, else 'unknown').")
    parser.add_argument("--force", action="store_true", help="Replace --output_dir if it exists.")
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
        folder = export_for_hub(args.model_dir, args.output_dir, repo_id=repo_id, metrics_file=args.metrics,
                                template=args.model_card_template, license=args.license, force=args.force)
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
