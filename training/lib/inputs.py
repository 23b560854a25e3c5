"""The inputs a command is given, checked before any work: the device it runs on (`check_device`), the model and
tokenizer a training run starts from (`check_model_inputs`), and sentences that fit the positions of the model that
translates them (`check_sentence_lengths`).

Every check raises `vaswani_hf.checks.CheckError` (a `ValueError`) naming the flag at fault, what is wrong and what to
do.
"""

from __future__ import annotations

import re
from pathlib import Path

from vaswani_hf.checks import CheckError, check_model_folder, read_json

__all__ = ["TOKENIZER_FIELDS", "check_device", "check_model_inputs", "check_sentence_lengths"]

# Config fields that the tokenizer sets (its size and special ids); --config_overrides cannot change them.
TOKENIZER_FIELDS = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")


def check_device(name: str | None) -> str:
    """The torch device for `--device name` (default: cuda where available, else cpu).

    Raises:
        CheckError: an unknown device name, the meta device (no values to compute with), or a CUDA/MPS device this
            torch or machine does not have.
    """
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as error:
        raise CheckError(f"--device {name}: not a device name ({error}); use cpu, cuda, cuda:1 or mps.") from None
    if device.type == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise CheckError(f"--device {name}: this torch ({torch.__version__}) is built without CUDA. Use --device "
                             f"cpu, or install a CUDA build of torch (https://pytorch.org/get-started/locally/).")
        if not torch.cuda.is_available():
            raise CheckError(f"--device {name}: no CUDA GPU is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES), "
                             f"or use --device cpu.")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CheckError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible.")
    elif device.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise CheckError(f"--device {name}: MPS is not available on this machine; use --device cpu.")
    elif device.type == "meta":
        raise CheckError(f"--device {name}: a meta device cannot translate here (a meta tensor holds no values); use "
                         f"cpu, cuda, cuda:1 or mps.")
    return name


def check_model_inputs(model_name_or_path: str | None, tokenizer_name: str | None,
                       config_overrides: str | None, *, preset_model: dict | None = None,
                       vocab_size: int | None = None) -> None:
    """Before data preparation: --config_overrides cannot apply to a saved model (refused, not ignored) nor set what
    the tokenizer sets (`TOKENIZER_FIELDS`), and with the preset's model fields (`preset_model`) it makes a valid
    `VaswaniConfig`; --vocab_size leaves room for the BPE's special and byte tokens and is refused where no BPE is
    trained (with --tokenizer_name or --model_name_or_path); a local
    --model_name_or_path is a complete vaswani folder (`check_model_folder`); every JSON file of a local
    --tokenizer_name parses (errors name the file).

    Raises:
        CheckError: naming the flag and what to do.
    """
    if config_overrides and model_name_or_path:
        raise CheckError(f"--config_overrides {config_overrides!r} cannot apply to --model_name_or_path "
                         f"{model_name_or_path}: a saved model keeps the config it was trained with. Drop "
                         f"--config_overrides to continue that model, or drop --model_name_or_path to train a new one.")
    from .presets import parse_overrides

    fixed = sorted(set(parse_overrides(config_overrides)) & set(TOKENIZER_FIELDS))
    if fixed:
        raise CheckError(f"--config_overrides {', '.join(fixed)}: set by the joint BPE (its size and the ids of <pad>, "
                         f"<s> and </s>), so that the model and its tokenizer agree. Drop {', '.join(fixed)} from "
                         f"--config_overrides; --vocab_size sets the vocabulary's size.")
    if vocab_size is not None and (model_name_or_path or tokenizer_name):
        flag = "--tokenizer_name" if tokenizer_name else "--model_name_or_path"
        raise CheckError(f"--vocab_size {vocab_size} would do nothing with {flag}: no joint BPE is trained, the "
                         f"vocabulary is the given tokenizer's. Leave --vocab_size out.")
    if vocab_size is not None:
        from vaswani_hf.tokenization_vaswani import BYTE_TOKENS, SPECIAL_TOKENS

        reserved = len(SPECIAL_TOKENS) + len(BYTE_TOKENS)
        if vocab_size <= reserved:
            raise CheckError(f"--vocab_size must exceed {reserved} (the joint BPE's special and byte tokens), got "
                             f"{vocab_size}; the cpu preset uses 8000 on Multi30k.")
    if not model_name_or_path and preset_model is not None:
        from vaswani_hf import VaswaniConfig

        try:  # the model the run would build, refused now rather than after the data and the BPE
            VaswaniConfig(**{**preset_model, **parse_overrides(config_overrides)})
        except (TypeError, ValueError) as error:
            raise CheckError(f"--config_overrides {config_overrides or ''!r}: {error}") from None
    if model_name_or_path and (Path(model_name_or_path).exists() or not _looks_like_hub_id(model_name_or_path)):
        check_model_folder(model_name_or_path, need_tokenizer=not tokenizer_name)
    if tokenizer_name and (Path(tokenizer_name).exists() or not _looks_like_hub_id(tokenizer_name)):
        folder = Path(tokenizer_name)
        if not folder.is_dir():
            raise CheckError(f"--tokenizer_name {tokenizer_name}: no such folder.")
        if not (folder / "tokenizer.json").is_file():
            raise CheckError(f"--tokenizer_name {tokenizer_name}: no tokenizer.json in it; pass a folder saved with "
                             f"tokenizer.save_pretrained().")
        for path in sorted(folder.glob("*.json")):
            read_json(path)


def check_sentence_lengths(model, tokenizer, sentences: list[str], *, names: list[str]) -> None:
    """Before the first sentence is translated: every non-empty sentence fits the positions the model takes
    (`VaswaniConfig.max_positions`: the learned table, or the longest attention it computes), so that a long line near
    the end does not fail the command after the batches before it were translated and thrown away.

    `names`: where each sentence comes from ("file:line"), for the message.

    Raises:
        CheckError: naming the first sentence too long, its length and the limit.
    """
    limit = getattr(model.config, "max_positions", None)
    if limit is None or getattr(model.config, "model_type", None) != "vaswani":
        return
    index = [i for i, sentence in enumerate(sentences) if sentence.strip()]
    if not index:
        return
    lengths = [len(ids) for ids in tokenizer([sentences[i] for i in index])["input_ids"]]
    too_long = [(i, n) for i, n in zip(index, lengths) if n > limit]
    if too_long:
        i, n = too_long[0]
        what = ("learned positions, max_position_embeddings" if model.config.position_embedding_type == "learned"
                else "the longest attention it computes")
        others = f" ({len(too_long)} sentences are too long)" if len(too_long) > 1 else ""
        raise CheckError(f"{names[i]}: the sentence is {n} tokens long, more than the {limit} positions this model "
                         f"takes ({what}){others}. Nothing was translated. Split such lines into sentences, or shorten "
                         f"them.")


def _looks_like_hub_id(name: str) -> bool:
    return bool(re.fullmatch(r"[\w.-]+/[\w.-]+", name)) and not name.startswith((".", "/"))
