"""What `vaswani-publish` and `vaswani-train --push_to_hub` do: the Hub-ready folder of a trained model (weights, the
model code files, tokenizer, the rendered model card) and its upload; the command's help (training/publish.py) says
what the folder holds.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

logger = logging.getLogger("vaswani_hf.publish")

HUB_CODE_FILES = ("configuration_vaswani.py", "fast_paths_vaswani.py", "generation_vaswani.py", "inputs_vaswani.py",
                  "kernels_vaswani.py", "loading_vaswani.py", "modeling_vaswani.py")
# training/model_card.md is a link to the template at the repository root, declared package data of vaswani_training:
# the wheel holds its content.
DEFAULT_TEMPLATE_NAME = "model_card.md"
HUB_SUBFOLDER = "hub"  # where the training scripts write the folder before pushing: <output_dir>/hub
LANGUAGE_NAMES = {"de": "German", "en": "English", "fr": "French", "cs": "Czech", "ro": "Romanian", "ru": "Russian",
                  "es": "Spanish", "it": "Italian", "nl": "Dutch", "tr": "Turkish", "zh": "Chinese", "ja": "Japanese"}
EXAMPLE_SOURCES = {"de": "Zwei Hunde spielen im Schnee.", "en": "Two dogs are playing in the snow.",
                   "fr": "Deux chiens jouent dans la neige."}
MULTI30K_TERMS_URL = "https://github.com/multi30k/dataset"
# Seconds a metrics.json may be older than the weights it was written after (file systems' time granularity, copies).
MTIME_SLACK = 2.0


def default_template() -> Path:
    """The model card template installed with the commands (`model_card.md`, package data of vaswani_training)."""
    return Path(str(resources.files("vaswani_training") / DEFAULT_TEMPLATE_NAME))


def _language_name(code: str) -> str:
    return LANGUAGE_NAMES.get(code, code)


def card_data_for(metrics: dict[str, Any], *, model_name: str, source_lang: str, target_lang: str,
                  license: str | None = None):
    """The model card's YAML metadata as a `huggingface_hub.ModelCardData`.

    Languages, dataset and BLEU come from the run's `metrics` (as `training/lib/run.py:finish` writes them); the
    model-index lists the detokenized sacreBLEU and, on Multi30k, the lowercased tokenized BLEU of the test split.
    Without a test BLEU in `metrics` there is no model-index. `license` defaults to "other" (the Multi30k terms:
    non-commercial research and education) for Multi30k runs and models fine-tuned from one, and "unknown"
    otherwise. `datasets` lists Hub dataset ids only (Multi30k's, a Hub dataset's), never a local file's or folder's
    name or path (`local_folder`); `base_model` the Hub id a fine-tuned model started from.
    """
    from huggingface_hub import EvalResult, ModelCardData

    dataset = metrics.get("dataset")
    multi30k = dataset == "multi30k"
    terms = multi30k or _base_trained_on_multi30k(metrics)
    license = license or ("other" if terms else "unknown")
    # The Hub's `datasets` field holds dataset ids: Multi30k's or a Hub dataset's, never a local file's or folder's.
    data = metrics.get("data") or {}
    hub_dataset = dataset if (multi30k or (data.get("kind") == "hub" and local_folder(data) is None)) else None
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
            dataset_type=hub_dataset or "custom", dataset_split="test", dataset_config=pair,
            dataset_name="Multi30k (task 1, test2016 Flickr)" if multi30k else _test_set_name(metrics),
            metric_type="bleu", metric_value=float(metrics[key]), metric_name=name,
            metric_config=metrics.get(signature_key), verified=False))
    base = metrics.get("base_model")
    return ModelCardData(
        language=[source_lang, target_lang],
        license=license,
        license_name="multi30k-terms" if (terms and license == "other") else None,
        license_link=MULTI30K_TERMS_URL if (terms and license == "other") else None,
        library_name="transformers",
        pipeline_tag="translation",
        tags=["translation", "transformer", "vaswani", "seq2seq"],
        base_model=base if base and not metrics.get("base_model_local") else None,
        datasets=[hub_dataset] if hub_dataset else None,
        metrics=["bleu"],
        model_name=model_name if results else None,
        eval_results=results or None,
    )


def _base_trained_on_multi30k(metrics: dict[str, Any]) -> bool:
    return (metrics.get("base_model_history") or {}).get("dataset") == "multi30k"


def _files_phrase(files: list[str]) -> str:
    names = [f"`{name}`" for name in files]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def local_folder(data: dict[str, Any] | None) -> str | None:
    """The name (never the path) of the local folder a run's data came from (metrics.json's `data`, kind "local"; or
    kind "hub" with a name that is a path, as runs recorded a local --dataset_name before there was a "local" kind),
    or None for data from elsewhere."""
    data = data or {}
    if data.get("kind") == "local":
        return Path(str(data.get("path") or data.get("name") or "")).name or "data"
    name = data.get("name")
    if data.get("kind") == "hub" and isinstance(name, str) and (
            os.path.isabs(name) or name.startswith((".", "~")) or Path(name).expanduser().exists()):
        return Path(name).name
    return None


def _test_set_name(metrics: dict[str, Any]) -> str:
    data = metrics.get("data") or {}
    if data.get("kind") == "files" and data.get("test"):
        return "test set: " + ", ".join(Path(name).name for name in data["test"])
    if local_folder(data) is not None:
        return f"local folder {local_folder(data)} (test split)"
    if data.get("kind") == "hub":
        return f"{data.get('name')} (test split)"
    return str(metrics.get("dataset") or "test set")


def describe_data(data: dict[str, Any] | None, dataset: str | None, split: str = "train") -> str:
    """Words for the data of one split, from metrics.json's `data` (`training.prepare.data_sources`): "Multi30k (task 1,
    image captions)", "the Hub dataset `wmt14` (config `de-en`)", "a local folder (`wmt`)" (its name, never its path)
    or "the files `a.de` and `a.en`"; from the older `dataset` label where there is no `data`; "" where nothing is
    known."""
    if data:
        kind = data.get("kind")
        if kind == "multi30k":
            return "Multi30k (task 1, image captions)"
        if local_folder(data) is not None:
            return f"a local folder (`{local_folder(data)}`)"
        if kind == "hub":
            config = f" (config `{data['config']}`)" if data.get("config") else ""
            return f"the Hub dataset `{data.get('name')}`{config}"
        if kind == "files" and data.get(split):
            return "the files " + _files_phrase(data[split])
    if dataset == "multi30k":
        return "Multi30k (task 1, image captions)"
    return f"`{dataset}`" if dataset else ""


def describe_history(metrics: dict[str, Any]) -> dict[str, str]:
    """The model's history in words, for the card: `origin` ("trained from scratch", or "fine-tuned from `X`", with
    what X was trained on where its metrics.json was read), `data` (the training data, `describe_data`) and
    `test_data`; each "" where metrics.json does not tell (a folder published without one)."""
    if "train_steps" not in metrics:
        origin = ""
    elif metrics.get("base_model"):
        origin = f"fine-tuned from `{metrics['base_model']}`"
        earlier = metrics.get("base_model_history") or {}
        earlier_data = describe_data(earlier.get("data"), earlier.get("dataset")).replace(
            "Multi30k (task 1, image captions)", "Multi30k")  # no parentheses inside parentheses
        if earlier.get("train_steps") is not None and earlier_data:
            origin += f" (itself trained for {earlier['train_steps']:,} updates on {earlier_data})"
    else:
        origin = "trained from scratch"
    return {"origin": origin, "data": describe_data(metrics.get("data"), metrics.get("dataset")),
            "test_data": describe_data(metrics.get("data"), None, "test")}


def describe_decoding(generation) -> str:
    """The decoding `generate()` takes from a folder's `generation_config.json`, in words: "beam 4, length penalty 1.6
    in the paper's GNMT form" (what the run chose on validation, or the default: beam 4, 0.6 in transformers' form)."""
    beams = getattr(generation, "num_beams", None) or 1
    if beams == 1:
        return "greedy"
    alpha = getattr(generation, "length_penalty", None)
    alpha = 1.0 if alpha is None else alpha
    style = "the paper's GNMT form, ((5 + |Y|) / 6)^alpha" if getattr(generation, "length_penalty_style", None) == \
        "gnmt" else "transformers' form, |Y|^alpha"
    return f"beam {beams}, length penalty {alpha:g} in {style}"


def render_model_card(model, metrics: dict[str, Any], *, repo_id: str, template: str | os.PathLike | None = None,
                      license: str | None = None, source_lang: str | None = None,
                      target_lang: str | None = None) -> str:
    """README.md text: `template` (default: model_card.md at the repository root, `default_template`) rendered with
    the metadata of `card_data_for` and the facts of the run (config of `model`, `metrics`, its history in words:
    `describe_history`).

    Raises:
        FileNotFoundError: the template does not exist.
    """
    from huggingface_hub import ModelCard

    template = Path(template) if template else default_template()
    if not template.is_file():
        raise FileNotFoundError(f"model card template {template} not found; pass --model_card_template.")
    source_lang = source_lang or metrics.get("source_lang", "de")
    target_lang = target_lang or metrics.get("target_lang", "en")
    model_name = repo_id.split("/")[-1]
    card_data = card_data_for(metrics, model_name=model_name, source_lang=source_lang, target_lang=target_lang,
                              license=license)
    config = model.config
    history = describe_history(metrics)
    card = ModelCard.from_template(
        card_data, template_path=str(template),
        model_id=repo_id, model_name=model_name, run=metrics, config=config.to_dict(),
        source_lang=source_lang, target_lang=target_lang,
        source_name=_language_name(source_lang), target_name=_language_name(target_lang),
        multi30k=metrics.get("dataset") == "multi30k", base_multi30k=_base_trained_on_multi30k(metrics),
        origin=history["origin"], data_description=history["data"], test_data_description=history["test_data"],
        num_parameters=sum(p.numel() for p in model.parameters()),
        example_source=EXAMPLE_SOURCES.get(source_lang, "..."), decoding=describe_decoding(model.generation_config),
    )
    return str(card)


def _read_metrics(path: Path | None, model_dir: Path) -> dict[str, Any]:
    """The run's metrics for the card, checked to describe the weights in `model_dir` (`check_metrics_match`); {}
    where there is no file."""
    from vaswani_hf.checks import CheckError, read_json

    if path is None or not path.is_file():
        logger.warning("No metrics.json at %s: the model card will have no test BLEU and no training history.", path)
        return {}
    metrics = read_json(path)  # an error naming the file if it does not parse
    if not isinstance(metrics, dict):
        raise CheckError(f"{path}: expected a JSON object of metrics, got {type(metrics).__name__}.")
    check_metrics_match(metrics, path, model_dir)
    return metrics


def check_metrics_match(metrics: dict[str, Any], path: Path, model_dir: Path) -> None:
    """Refuse metrics of other weights: `weights_sha256` (written by the training commands and vaswani-evaluate) must be
    the fingerprint of `model_dir`'s weights; a file without it must not be older than the weights.

    Raises:
        CheckError: naming both files and how to get metrics of these weights.
    """
    from vaswani_hf.checks import CheckError, weight_files, weights_fingerprint

    recorded = metrics.get("weights_sha256")
    files = weight_files(model_dir)
    if recorded:
        if weights_fingerprint(model_dir) == recorded:
            return
        why = f"it records the fingerprint of other weights ({recorded[:19]}...)"
    elif files and path.stat().st_mtime < max(f.stat().st_mtime for f in files) - MTIME_SLACK:
        why = "it is older than the weights"
    else:
        return
    raise CheckError(
        f"{path} does not describe the weights in {model_dir} ({why}): a run stopped after writing its model but "
        f"before its metrics, or weights replaced since. Its BLEU would be published for another model. Score these "
        f"weights with `vaswani-evaluate --model {model_dir} --output {model_dir / 'test_metrics.json'}` and pass "
        f"--metrics {model_dir / 'test_metrics.json'}.")


def check_hub_folder(folder: str | os.PathLike) -> None:
    """Check what a Hub-ready folder promises: the model code files (`HUB_CODE_FILES`) and no other code, config.json
    with auto_map, safetensors weights holding a shared embedding once, a tokenizer, generation config and README.

    Raises:
        RuntimeError: naming what is wrong.
    """
    from safetensors import safe_open

    folder = Path(folder)
    code = sorted(p.name for p in folder.rglob("*.py"))
    if code != sorted(HUB_CODE_FILES):
        raise RuntimeError(f"{folder}: the code files are {code}, expected exactly {list(HUB_CODE_FILES)} (did "
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


def write_hub_folder(model_dir: str | os.PathLike, output_dir: str | os.PathLike, *, repo_id: str | None = None,
                     metrics_file: str | os.PathLike | None = None, template: str | os.PathLike | None = None,
                     license: str | None = None, force: bool = False, allow_inside: bool = False,
                     space: bool = False) -> Path:
    """Write the Hub-ready folder of the trained model in `model_dir` (a `save_pretrained` folder with its tokenizer,
    e.g. a training output_dir) to `output_dir`.

    Args:
        repo_id: the Hub name used in the card (default: `output_dir`'s name).
        metrics_file: the run's metrics.json (default: `model_dir/metrics.json`; missing: a card without BLEU).
        template: the model card template (default: model_card.md at the repository root).
        license: Hub license id for the card (default: see `card_data_for`).
        force: replace an existing `output_dir`. Never one that is, contains or lies inside `model_dir`.
        allow_inside: accept an `output_dir` inside `model_dir` (the training scripts' own `<output_dir>/hub`).
        space: also write the demo page as a Hugging Face Space (`app.py`, `requirements.txt`, the page's code in
            `vaswani_demo/`, Space metadata in the card; `vaswani_training.lib.space.space_files`).

    Returns:
        `output_dir` as a Path.

    Raises:
        CheckError (a ValueError): `model_dir` fails `check_model_folder` (no config.json, another kind of model, a
            missing or damaged file, no tokenizer or one of another model, ...); the metrics describe other weights.
        FileNotFoundError: the template is missing.
        FileExistsError: `output_dir` exists and `force` is False.
    """
    from transformers import AutoTokenizer

    import vaswani_hf  # noqa: F401  (registers the Auto classes; saved folders get auto_map and the code files)
    from vaswani_hf import VaswaniForConditionalGeneration
    from vaswani_hf.checks import check_model_folder, check_output_dir, check_output_not_in_inputs, swap_in_folder

    model_dir, output_dir = Path(model_dir), Path(output_dir)
    check_model_folder(model_dir)  # config, every JSON file, weights, tokenizer of the model's size
    # Replacing output_dir must never remove the model folder (a training run: checkpoints, metrics), --force or not.
    check_output_not_in_inputs(output_dir, [model_dir], allow_inside=allow_inside)
    check_output_dir(output_dir)
    if output_dir.exists() and not force:
        raise FileExistsError(f"{output_dir} exists; pass --force to replace it.")
    metrics = _read_metrics(Path(metrics_file) if metrics_file else model_dir / "metrics.json", model_dir)

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
        if space:  # the demo page beside the model: the folder also runs as a Space (training/lib/space.py)
            from .space import space_card, space_files

            (tmp / "README.md").write_text(space_card(readme), encoding="utf-8")  # the Space's metadata added
            for name, text in space_files(source_lang=metrics.get("source_lang", "de")).items():
                (tmp / name).parent.mkdir(exist_ok=True)
                (tmp / name).write_text(text, encoding="utf-8")
        swap_in_folder(tmp, output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output_dir


def check_hub_reachable(endpoint: str | None = None, *, timeout: float = 10.0) -> str:
    """Before any work that ends in an upload: the Hub server answers. Uploading is not offline
    (`HF_HUB_OFFLINE`), `endpoint` (else HF_ENDPOINT, else huggingface.co) is an http(s) URL, and its host (or the
    proxy the environment names for it) accepts a connection within `timeout` seconds. Nothing is sent.

    Returns:
        the endpoint URL checked.

    Raises:
        CheckError: naming the endpoint (and where it came from) and what to do.
    """
    import urllib.parse
    import urllib.request

    from huggingface_hub import constants

    from vaswani_hf.checks import CheckError

    if constants.HF_HUB_OFFLINE:
        raise CheckError("--push_to_hub: HF_HUB_OFFLINE is set, so nothing could be uploaded. Unset it, or drop "
                         "--push_to_hub and upload later with vaswani-publish --push_to_hub.")
    if endpoint:
        url, source = endpoint, "--hub_endpoint"
    elif os.environ.get("HF_ENDPOINT"):
        url, source = os.environ["HF_ENDPOINT"], "HF_ENDPOINT"
    else:
        url, source = constants.ENDPOINT, "the Hub"
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise CheckError(f"{source} {url!r} is not an http(s) URL; give one like https://huggingface.co.")
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:
        raise CheckError(f"{source} {url!r} has an invalid port.") from None
    host, via = parsed.hostname, ""
    proxy = urllib.request.getproxies().get(parsed.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        proxied = urllib.parse.urlparse(proxy if "://" in proxy else f"http://{proxy}")
        if proxied.hostname:
            host, port, via = proxied.hostname, proxied.port or 80, f" through the proxy {proxy}"
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as error:
        raise CheckError(f"{source} {url}: cannot be reached{via} ({error.strerror or error}). Check the URL and the "
                         f"network, or drop --push_to_hub; nothing was written.") from None
    return url


def push_folder(folder: str | os.PathLike, repo_id: str, *, token: str | None = None, private: bool | None = None,
                endpoint: str | None = None, commit_message: str = "Upload Vaswani Transformer") -> str:
    """Create the model repository `repo_id` if needed and upload `folder` to it in one commit.

    `endpoint` defaults to HF_ENDPOINT, else huggingface.co; `token` to HF_TOKEN or the saved login.

    Returns:
        The commit's URL.

    Raises:
        RuntimeError: HF_HUB_OFFLINE is set (nothing can be uploaded), or the push failed midway (a refusal of the
            server, a broken connection): naming the cause and saying that `folder` is unchanged for a retry.
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
    except Exception as error:  # huggingface_hub wraps a failed LFS upload, losing its cause from the message
        causes, cause = [], error
        while cause is not None:
            if (text := str(cause).strip()) and not any(text in earlier for earlier in causes):
                causes.append(text)
            cause = cause.__cause__
        retry = f"hf upload {repo_id} {folder}"
        if api.endpoint.rstrip("/") != "https://huggingface.co":
            retry = f"HF_ENDPOINT={api.endpoint} {retry}"
        raise RuntimeError(f"uploading {folder} to {repo_id} ({api.endpoint}) failed: {' <- '.join(causes)}\nThe "
                           f"push did not complete; {folder} is complete and unchanged: push it again to retry "
                           f"(`{retry}`).") from error
    logger.info("Uploaded %s to %s: %s", folder, repo.repo_id, commit.commit_url)
    return commit.commit_url


def write_and_push(model_dir: str | os.PathLike, *, repo_id: str | None, token: str | None = None,
                   private: bool | None = None, endpoint: str | None = None) -> str:
    """What `--push_to_hub` of the training scripts does at the end: write the Hub-ready folder of `model_dir` to
    `model_dir/hub` (replacing an earlier one) and upload that folder to `repo_id` (default: `model_dir`'s name, in the
    token's namespace). Returns the commit URL."""
    model_dir = Path(model_dir)
    repo_id = repo_id or model_dir.resolve().name
    folder = write_hub_folder(model_dir, model_dir / HUB_SUBFOLDER, repo_id=repo_id, force=True, allow_inside=True)
    return push_folder(folder, repo_id, token=token, private=private, endpoint=endpoint)
