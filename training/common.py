"""What both training loops (`train.py` on Seq2SeqTrainer, `train_no_trainer.py` on accelerate) share: the presets,
the data/tokenizer pipeline up to token-budget batches, the final BLEU evaluation, and atomic writes.

Everything here is a thin layer over `vaswani_hf` (data, tokenizer, schedule, BLEU) so that no step is written twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vaswani_hf import VaswaniConfig, train_joint_bpe
from vaswani_hf.data import (
    DataError,
    TokenBudgetBatchSampler,
    example_lengths,
    load_multi30k,
    load_parallel_dataset,
    multi30k_file,
    tokenize_dataset,
)

logger = logging.getLogger("vaswani_hf.training")

# Model and recipe presets. `base` and `big` are the paper's (Table 3, §5.1-5.4; the paper's batch is ~25000 source
# + 25000 target tokens over 8 GPUs); `cpu` is sized so the default run on a 2-core machine trains and evaluates in
# under 30 minutes; `tiny` is for tests.
PRESETS: dict[str, dict[str, Any]] = {
    "base": {
        "model": {},
        "max_tokens": 4096, "warmup_steps": 4000, "lr_factor": 1.0, "max_steps": 100_000, "vocab_size": 37000,
    },
    "big": {
        "model": {"d_model": 1024, "num_heads": 16, "d_ff": 4096, "dropout": 0.3},
        "max_tokens": 4096, "warmup_steps": 4000, "lr_factor": 1.0, "max_steps": 300_000, "vocab_size": 37000,
    },
    "cpu": {
        "model": {"d_model": 256, "encoder_layers": 3, "decoder_layers": 3, "num_heads": 4, "d_ff": 1024},
        "max_tokens": 4096, "warmup_steps": 400, "lr_factor": 0.5, "max_steps": 1400, "vocab_size": 8000,
    },
    "tiny": {
        "model": {"d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "num_heads": 2, "d_ff": 64},
        "max_tokens": 512, "warmup_steps": 10, "lr_factor": 1.0, "max_steps": 20, "vocab_size": 500,
    },
}


@dataclass
class DataArguments:
    """Where the parallel text comes from and how it is cut into batches."""

    source_lang: str = field(default="de", metadata={"help": "Source language code (default de)."})
    target_lang: str = field(default="en", metadata={"help": "Target language code (default en)."})
    train_file: str | None = field(default=None, metadata={
        "help": "Training data: a prefix of parallel files PREFIX.{src,tgt}[.gz] or a JSON-lines file of "
                "{\"translation\": {...}} records. Default: the shipped Multi30k."})
    validation_file: str | None = field(default=None, metadata={"help": "Validation data, as --train_file."})
    test_file: str | None = field(default=None, metadata={"help": "Test data, as --train_file."})
    dataset_name: str | None = field(default=None, metadata={
        "help": "A Hub dataset name (needs the network), e.g. wmt14 with --dataset_config_name de-en."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Config of --dataset_name."})
    empty_lines: str = field(default="skip", metadata={
        "help": "Pairs with an empty side: skip (counted and reported), error, or keep."})
    max_source_length: int = field(default=256, metadata={"help": "Truncate source sentences to this many tokens."})
    max_target_length: int = field(default=256, metadata={"help": "Truncate target sentences to this many tokens."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training pairs."})
    max_eval_samples: int | None = field(default=None, metadata={
        "help": "Validation pairs scored during training (default: the preset's)."})
    max_test_samples: int | None = field(default=None, metadata={"help": "Use only the first N test pairs."})
    max_tokens: int | None = field(default=None, metadata={
        "help": "Token budget per batch per device, padded tokens counted (fairseq --max-tokens). Default: the "
                "preset's."})

    def __post_init__(self):
        # Refused when the flags are parsed, not after an hour of training (0 samples used to mean "all").
        for name in ("max_source_length", "max_target_length", "max_train_samples", "max_eval_samples",
                     "max_test_samples", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise DataError(f"--{name} must be >= 1 (leave the flag out for the default), got {value}.")


@dataclass
class ModelArguments:
    """Which model and tokenizer to train."""

    preset: str = field(default="cpu", metadata={"help": "cpu (default run), base or big (the paper's), or tiny."})
    config_overrides: str | None = field(default=None, metadata={
        "help": "Override config fields: 'd_model=512,encoder_layers=6,dropout=0.2'."})
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "Continue from a saved model folder instead of a fresh preset model."})
    tokenizer_name: str | None = field(default=None, metadata={
        "help": "A saved tokenizer folder to use instead of training the joint BPE."})
    vocab_size: int | None = field(default=None, metadata={
        "help": "Joint BPE vocabulary size (default: the preset's; 8000 fits Multi30k)."})
    cache_dir: str | None = field(default=None, metadata={
        "help": "Where trained tokenizers are cached (default ~/.cache/vaswani_hf)."})


@dataclass
class RecipeArguments:
    """The paper's optimizer schedule (§5.3) and the end-of-run steps."""

    lr_factor: float | None = field(default=None, metadata={
        "help": "lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (§5.3). Default: the preset's."})
    average_last: int = field(default=0, metadata={
        "help": "At the end, average the last N checkpoints (§6.1: 5 for base, 20 for big) into the output model."})
    max_train_minutes: float | None = field(default=None, metadata={
        "help": "Stop training after this many minutes (checkpoint saved), then evaluate as usual."})
    num_samples: int = field(default=5, metadata={"help": "Sample translations printed at the end."})
    cpu_bf16: str = field(default="auto", metadata={
        "help": "Training on a CPU: auto (bf16 autocast where the CPU computes bf16 natively, AVX512-BF16 or AMX), "
                "yes, or no (fp32)."})


def cpu_has_native_bf16() -> bool:
    """True where the CPU has bf16 instructions (Linux /proc/cpuinfo flags avx512_bf16 or amx_bf16). Elsewhere bf16
    on the CPU is emulated and slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def parse_overrides(text: str | None) -> dict[str, Any]:
    """'d_model=512,dropout=0.2,normalize_before=true' -> {'d_model': 512, 'dropout': 0.2, ...}.

    Raises:
        ValueError: an item without '=' or a field VaswaniConfig does not have.
    """
    if not text:
        return {}
    known = VaswaniConfig().to_dict()
    out: dict[str, Any] = {}
    for item in text.split(","):
        if "=" not in item:
            raise ValueError(f"--config_overrides: expected key=value, got {item!r}.")
        key, value = (s.strip() for s in item.split("=", 1))
        if key not in known:
            raise ValueError(f"--config_overrides: VaswaniConfig has no field {key!r}.")
        try:
            out[key] = json.loads(value.lower() if value.lower() in ("true", "false", "null") else value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def resolve_preset(model_args: ModelArguments) -> dict[str, Any]:
    if model_args.preset not in PRESETS:
        raise ValueError(f"--preset {model_args.preset!r} is unknown; choose one of {', '.join(PRESETS)}.")
    return PRESETS[model_args.preset]


def load_raw_datasets(data_args: DataArguments):
    """`DatasetDict` with train/validation/test `{"translation": {...}}` records (Multi30k by default)."""
    if data_args.dataset_name:
        return load_parallel_dataset(hub_dataset=data_args.dataset_name, hub_config=data_args.dataset_config_name,
                                     source_lang=data_args.source_lang, target_lang=data_args.target_lang,
                                     empty_lines=data_args.empty_lines)
    files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    if not any(files.values()):
        return load_multi30k(data_args.source_lang, data_args.target_lang, empty_lines=data_args.empty_lines)
    if not files["train"]:
        raise DataError("--validation_file/--test_file given without --train_file; give all three (or none for "
                        "the shipped Multi30k).")
    return load_parallel_dataset({k: v for k, v in files.items() if v}, data_args.source_lang,
                                 data_args.target_lang, empty_lines=data_args.empty_lines)


def select(dataset, n: int | None):
    """The first `n` examples of `dataset`; all of them for None.

    Raises:
        DataError: `n` < 1 (0 used to mean "all", silently).
    """
    if n is None:
        return dataset
    if isinstance(n, bool) or n < 1:
        raise DataError(f"--max_train_samples, --max_eval_samples and --max_test_samples take a number of examples "
                        f">= 1 (leave the flag out for all of them), got {n}.")
    return dataset.select(range(min(n, len(dataset))))


def get_tokenizer(model_args: ModelArguments, train_dataset, data_args: DataArguments, vocab_size: int):
    """The joint BPE of §5.1, trained on source and target side of the training split, or loaded.

    Trained tokenizers are cached under `cache_dir/tokenizers/<hash of the training text and settings>`, so a second
    run on the same data reuses it.
    """
    from transformers import AutoTokenizer

    if model_args.tokenizer_name or model_args.model_name_or_path:
        return AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    src = [t[data_args.source_lang] for t in train_dataset["translation"]]
    tgt = [t[data_args.target_lang] for t in train_dataset["translation"]]
    digest = hashlib.sha256()
    digest.update(f"bpe-v1|{vocab_size}|".encode())
    for line in src + tgt:
        digest.update(line.encode("utf-8") + b"\n")
    cache_root = Path(model_args.cache_dir or os.environ.get("VASWANI_CACHE",
                                                             Path.home() / ".cache" / "vaswani_hf"))
    cached = cache_root / "tokenizers" / digest.hexdigest()[:16]
    if (cached / "tokenizer.json").is_file():
        logger.info("Reusing the joint BPE cached at %s", cached)
        return AutoTokenizer.from_pretrained(cached)
    logger.info("Training a joint BPE of %d entries on %d sentence pairs", vocab_size, len(src))
    tokenizer = train_joint_bpe([src, tgt], vocab_size=vocab_size)
    tmp = Path(tempfile.mkdtemp(dir=cached.parent if cached.parent.exists() else None))
    tokenizer.save_pretrained(tmp)
    cached.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, cached)
    except OSError:  # another process cached it first
        pass
    return tokenizer


def token_budget_sampler(dataset, max_tokens: int, *, shuffle: bool, seed: int, num_replicas: int = 1,
                         rank: int = 0) -> TokenBudgetBatchSampler:
    """Length-bucketed batches of at most `max_tokens` padded tokens (fairseq's --max-tokens)."""
    src_lengths, tgt_lengths = example_lengths(dataset)
    return TokenBudgetBatchSampler(src_lengths, tgt_lengths, max_tokens=max_tokens, shuffle=shuffle, seed=seed,
                                   num_replicas=num_replicas, rank=rank)


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write JSON so that a reader never sees a half-written file (temp file in the same folder, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, ensure_ascii=False)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_lines_atomic(path: str | os.PathLike, lines: list[str]) -> None:
    """Write one line per item atomically (as `write_json_atomic`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.writelines(line + "\n" for line in lines)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def evaluate_test_set(model, tokenizer, test_dataset, data_args: DataArguments, *, batch_size: int = 64,
                      num_beams: int = 4, length_penalty: float = 0.6, is_multi30k: bool = True) -> dict[str, Any]:
    """Translate the test split (beam 4, length penalty 0.6 by default) and score it with detokenized sacreBLEU and,
    on the shipped Multi30k, lowercased tokenized BLEU against the official `tok/` references.

    Returns:
        metrics dict (`bleu`, `signature`, `tok_bleu`, `tok_signature`, `test_sentences`, `test_seconds`,
        `sentences_per_second`) and the hypotheses under `hypotheses`.
    """
    from vaswani_hf.bleu import compute_bleu
    from vaswani_hf.inference import translate_sentences

    sources = [t[data_args.source_lang] for t in test_dataset["translation"]]
    references = [t[data_args.target_lang] for t in test_dataset["translation"]]
    start = time.perf_counter()
    hypotheses = translate_sentences(model, tokenizer, sources, batch_size=batch_size, num_beams=num_beams,
                                     length_penalty=length_penalty)
    seconds = time.perf_counter() - start
    tok_refs = None
    if is_multi30k and data_args.target_lang in ("de", "en"):
        from vaswani_hf.data import read_lines

        tok_refs = read_lines(multi30k_file("test", data_args.target_lang, tokenized_lowercased=True))
        tok_refs = tok_refs[: len(hypotheses)]
    scores = compute_bleu(hypotheses, references, tok_refs, target_lang=data_args.target_lang)
    metrics = {
        "test_bleu": round(scores["bleu"], 2),
        "test_bleu_signature": scores["signature"],
        "test_sentences": len(sources),
        "test_seconds": round(seconds, 1),
        "test_sentences_per_second": round(len(sources) / seconds, 2),
        "num_beams": num_beams,
        "length_penalty": length_penalty,
    }
    if "tok_bleu" in scores:
        metrics["test_tok_bleu"] = round(scores["tok_bleu"], 2)
        metrics["test_tok_bleu_signature"] = scores["tok_signature"]
    return {"metrics": metrics, "hypotheses": hypotheses, "sources": sources, "references": references}


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=level)
    torch.set_num_threads(max(1, torch.get_num_threads()))
