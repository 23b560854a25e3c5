"""What a training run prepares before its first step, the same for both loops: the data (the shipped Multi30k, local
files or a Hub dataset), the joint BPE (trained and cached, or loaded), the token ids, the token-budget batches and
the model (a preset's, or a saved one).

Each step is a thin layer over `vaswani_hf` (data, tokenizer, model).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from vaswani_hf import VaswaniConfig, train_joint_bpe
from vaswani_hf.checks import CheckError, swap_in_folder
from vaswani_hf.data import (
    MULTI30K_SPLITS,
    TokenBudgetBatchSampler,
    check_parallel_data,
    check_splits,
    content_key,
    example_lengths,
    iter_sentences,
    load_multi30k,
    load_parallel_dataset,
    multi30k_dir,
    parallel_files,
    stream_parallel_pairs,
    tokenize_dataset,
)
from vaswani_hf.data.caches import manifest_problem, remove_damaged, write_manifest

from .arguments import DataArguments, ModelArguments
from .presets import parse_overrides

logger = logging.getLogger("vaswani_hf.training")


def check_data(data_args: DataArguments) -> None:
    """The run's data, checked before any work (`check_parallel_data`): a training split; every split's first record a
    `{"translation": ...}` object holding --source_lang and --target_lang as strings; at least one pair with both
    sides non-empty in each split. For --train_file/--validation_file/--test_file, and for --dataset_name where it is
    a local folder or read with --streaming; a Hub dataset read into memory is checked by the same functions as it
    loads (`load_parallel_dataset`), the shipped Multi30k needs none.

    Raises:
        CheckError: naming the flag, file and line, or dataset, split and row, and what to do.
    """
    files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    if not files["train"] and not data_args.dataset_name and any(files.values()):
        raise CheckError("--validation_file/--test_file given without --train_file; give all three (or none for "
                         "the shipped Multi30k).")
    if is_multi30k(data_args):
        return
    if data_args.dataset_name:
        if data_args.streaming or Path(data_args.dataset_name).is_dir():
            check_parallel_data(hub_dataset=data_args.dataset_name, hub_config=data_args.dataset_config_name,
                                source_lang=data_args.source_lang, target_lang=data_args.target_lang,
                                required=("train",), empty_lines=data_args.empty_lines)
        return
    check_parallel_data({split: source for split, source in files.items() if source}, data_args.source_lang,
                        data_args.target_lang, empty_lines=data_args.empty_lines,
                        flags={split: f"--{split}_file" for split in files})


def load_raw_datasets(data_args: DataArguments):
    """`DatasetDict` with train/validation/test `{"translation": {...}}` records (Multi30k by default); with
    --streaming, validation and test only (the training split is read by `training_stream`)."""
    if data_args.streaming:
        return _evaluation_splits(data_args)
    if data_args.dataset_name:
        raw = load_parallel_dataset(hub_dataset=data_args.dataset_name, hub_config=data_args.dataset_config_name,
                                    source_lang=data_args.source_lang, target_lang=data_args.target_lang,
                                    empty_lines=data_args.empty_lines, num_proc=data_args.preprocessing_num_workers)
        check_splits(raw, ("train",), f"--dataset_name {data_args.dataset_name}")
        return raw
    files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    if not any(files.values()):
        return load_multi30k(data_args.source_lang, data_args.target_lang, empty_lines=data_args.empty_lines)
    check_splits([split for split, source in files.items() if source], ("train",), "the data",
                 hint="give --train_file with --validation_file/--test_file (or none for the shipped Multi30k)")
    return load_parallel_dataset({k: v for k, v in files.items() if v}, data_args.source_lang,
                                 data_args.target_lang, empty_lines=data_args.empty_lines)


def _evaluation_splits(data_args: DataArguments):
    import datasets

    if is_multi30k(data_args):
        return load_multi30k(data_args.source_lang, data_args.target_lang, splits=("validation", "test"),
                             empty_lines=data_args.empty_lines)
    if data_args.dataset_name:
        present = datasets.get_dataset_split_names(data_args.dataset_name, data_args.dataset_config_name)
        return datasets.DatasetDict({
            split: load_parallel_dataset(hub_dataset=data_args.dataset_name, hub_config=data_args.dataset_config_name,
                                         source_lang=data_args.source_lang, target_lang=data_args.target_lang,
                                         empty_lines=data_args.empty_lines, hub_kwargs={"split": split})["train"]
            for split in ("validation", "test") if split in present})
    files = {"validation": data_args.validation_file, "test": data_args.test_file}
    return datasets.DatasetDict({split: load_parallel_dataset(source, data_args.source_lang, data_args.target_lang,
                                                              empty_lines=data_args.empty_lines)
                                 for split, source in files.items() if source})


def training_stream(data_args: DataArguments):
    """--streaming: a callable that reads the training pairs afresh at each call (`stream_parallel_pairs`: the shipped
    Multi30k, --train_file, or --dataset_name opened with `streaming=True`), the first --max_train_samples of them."""
    if data_args.dataset_name:
        pairs = stream_parallel_pairs(source_lang=data_args.source_lang, target_lang=data_args.target_lang,
                                      empty_lines=data_args.empty_lines, hub_dataset=data_args.dataset_name,
                                      hub_config=data_args.dataset_config_name)
    else:
        source = data_args.train_file or multi30k_dir() / MULTI30K_SPLITS["train"]
        pairs = stream_parallel_pairs(source, data_args.source_lang, data_args.target_lang,
                                      empty_lines=data_args.empty_lines)
    limit = data_args.max_train_samples
    return pairs if limit is None else (lambda: itertools.islice(pairs(), limit))


def _stream_key(data_args: DataArguments) -> str:
    """What names a training stream's content, for the BPE cache."""
    if data_args.dataset_name:
        return f"hub|{data_args.dataset_name}|{data_args.dataset_config_name}"
    source = data_args.train_file or multi30k_dir() / MULTI30K_SPLITS["train"]
    return f"files|{content_key(parallel_files(source, data_args.source_lang, data_args.target_lang))}"


def select(dataset, n: int | None):
    """The first `n` examples of `dataset`; all of them for None.

    Raises:
        CheckError: `n` < 1 (0 is not "all").
    """
    if n is None:
        return dataset
    if isinstance(n, bool) or n < 1:
        raise CheckError(f"--max_train_samples, --max_eval_samples and --max_test_samples take a number of examples "
                        f">= 1 (leave the flag out for all of them), got {n}.")
    return dataset.select(range(min(n, len(dataset))))


def prepare_data(model_args: ModelArguments, data_args: DataArguments, preset: dict[str, Any]):
    """Data -> joint BPE -> token ids: load the splits (the shipped Multi30k by default), keep the first
    --max_train_samples training pairs, get the tokenizer (`get_tokenizer`: trained on the training split and cached,
    or loaded) and tokenize every split, truncated to --max_source_length / --max_target_length.

    With --streaming, `raw` and `tokenized` hold validation and test only, and the BPE learns from one pass over the
    training stream (`training_stream`).

    Returns:
        `(raw, tokenizer, tokenized)`: the `DatasetDict` of `{"translation": ...}` records, the tokenizer, and the
        `DatasetDict` of `input_ids` / `attention_mask` / `labels`.
    """
    import datasets

    raw = load_raw_datasets(data_args)
    if data_args.streaming:
        train = training_stream(data_args)
    else:
        train = raw["train"] = select(raw["train"], data_args.max_train_samples)
    tokenizer = get_tokenizer(model_args, train, data_args, model_args.vocab_size or preset["vocab_size"])
    truncated = {"max_length": data_args.max_source_length, "max_target_length": data_args.max_target_length}
    dropping = data_args.drop_long_pairs and "train" in raw  # a stream leaves long pairs out itself
    tokenized = datasets.DatasetDict({
        split: tokenize_dataset(dataset, tokenizer, data_args.source_lang, data_args.target_lang,
                                **({} if dropping and split == "train" else truncated),
                                num_proc=data_args.preprocessing_num_workers)
        for split, dataset in raw.items()})
    if dropping:
        tokenized["train"] = drop_long_pairs(tokenized["train"], data_args)
    return raw, tokenizer, tokenized


def drop_long_pairs(full, data_args: DataArguments):
    """The pairs of `full` (tokenized, not truncated) whose source and target both fit --max_source_length /
    --max_target_length, found on their lengths with numpy; the others are counted and left out.

    Raises:
        CheckError: no training pair fits.
    """
    src_lengths, tgt_lengths = example_lengths(full)
    keep = np.nonzero((src_lengths <= data_args.max_source_length) & (tgt_lengths <= data_args.max_target_length))[0]
    if len(keep) == 0:
        raise CheckError(f"No training pair fits --max_source_length {data_args.max_source_length} and "
                         f"--max_target_length {data_args.max_target_length}; raise them.")
    dropped = len(full) - len(keep)
    if dropped:
        logger.info("Left out %d of %d training pairs longer than %d/%d tokens (--drop_long_pairs)", dropped,
                    len(full), data_args.max_source_length, data_args.max_target_length)
        return full.select(keep)
    return full


def is_multi30k(data_args: DataArguments) -> bool:
    """True when the run reads the shipped Multi30k (neither --train_file nor --dataset_name given)."""
    return not (data_args.train_file or data_args.dataset_name)


def is_local_dataset(data_args: DataArguments) -> bool:
    """True when --dataset_name is a local folder (or file), which `datasets.load_dataset` reads as such: local data,
    never a Hub dataset id."""
    return bool(data_args.dataset_name) and Path(data_args.dataset_name).expanduser().exists()


def dataset_label(data_args: DataArguments) -> str:
    """What the run trained on, for metrics.json and the model card: "multi30k", the Hub dataset name, or the name
    (never the path) of the local folder or training file."""
    if is_multi30k(data_args):
        return "multi30k"
    if data_args.dataset_name:
        return Path(data_args.dataset_name).name if is_local_dataset(data_args) else data_args.dataset_name
    return Path(data_args.train_file).name


def data_sources(data_args: DataArguments) -> dict[str, Any]:
    """Where the run's data came from, by name, for metrics.json and the model card:
    `{"kind": "multi30k"}` (the shipped copy), `{"kind": "hub", "name": ..., "config": ...}`, `{"kind": "local",
    "path": ..., "config": ...}` for a --dataset_name that is a local folder, or `{"kind": "files", "train": [...],
    "validation": [...], "test": [...]}` with the files each split read, as given on the command line (a prefix
    expanded to its two language files)."""
    if is_multi30k(data_args):
        return {"kind": "multi30k"}
    if is_local_dataset(data_args):
        return {"kind": "local", "path": data_args.dataset_name, "config": data_args.dataset_config_name}
    if data_args.dataset_name:
        return {"kind": "hub", "name": data_args.dataset_name, "config": data_args.dataset_config_name}
    files: dict[str, Any] = {"kind": "files"}
    for split, source in (("train", data_args.train_file), ("validation", data_args.validation_file),
                          ("test", data_args.test_file)):
        if source:
            files[split] = [str(path) for path in parallel_files(source, data_args.source_lang,
                                                                 data_args.target_lang)]
    return files


def build_model(model_args: ModelArguments, preset: dict[str, Any], tokenizer):
    """The model to train: the saved one of --model_name_or_path, else a fresh model of `preset` (fields overridden by
    --config_overrides) whose vocabulary size and special ids are the tokenizer's.

    Raises:
        CheckError: the tokenizer's size differs from the model's vocabulary, or a bad --config_overrides item.
    """
    from vaswani_hf import VaswaniForConditionalGeneration

    if model_args.model_name_or_path:
        model = VaswaniForConditionalGeneration.from_pretrained(model_args.model_name_or_path)
    else:
        overrides = {**preset["model"], **parse_overrides(model_args.config_overrides)}
        config = VaswaniConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                               bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                               decoder_start_token_id=tokenizer.bos_token_id, **overrides)
        model = VaswaniForConditionalGeneration(config)
    if len(tokenizer) != model.config.vocab_size:
        raise CheckError(f"The tokenizer has {len(tokenizer)} entries but the model's vocabulary has "
                         f"{model.config.vocab_size}; pass the tokenizer saved with the model (--tokenizer_name).")
    logger.info("Model: %s parameters, d_model=%d, %d+%d layers, %d heads, d_ff=%d",
                f"{sum(p.numel() for p in model.parameters()):,}", model.config.d_model,
                model.config.encoder_layers, model.config.decoder_layers, model.config.num_heads, model.config.d_ff)
    return model


def get_tokenizer(model_args: ModelArguments, train_dataset, data_args: DataArguments, vocab_size: int):
    """The joint BPE of §5.1, trained on source and target side of the training split (a `Dataset`, or with
    --streaming the callable of `training_stream`), or loaded.

    Trained tokenizers are cached under `cache_dir/tokenizers/<hash of the training text and settings>`, so a second
    run on the same data reuses it. An entry is written into a temporary folder beside it with a manifest of its files'
    SHA-256 (`vaswani_hf.data.caches.write_manifest`) and renamed into place; an entry without the manifest, with a
    file missing or changed, or that does not load is named in a warning, removed and trained again.
    """
    from transformers import AutoTokenizer

    if model_args.tokenizer_name or model_args.model_name_or_path:
        return AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    src_lang, tgt_lang = data_args.source_lang, data_args.target_lang
    digest = hashlib.sha256()
    digest.update(f"bpe-v1|{vocab_size}|".encode())
    if callable(train_dataset):  # --streaming: the pairs afresh at each call
        digest.update(f"{src_lang}|{tgt_lang}|{_stream_key(data_args)}|{data_args.max_train_samples}".encode())
    elif train_dataset.cache_files:  # memory-mapped: its fingerprint names its content, nothing to read
        digest.update(f"{src_lang}|{tgt_lang}|{train_dataset._fingerprint}".encode())
    else:
        for line in itertools.chain(iter_sentences(train_dataset, src_lang), iter_sentences(train_dataset, tgt_lang)):
            digest.update(line.encode("utf-8") + b"\n")
    cache_root = Path(model_args.cache_dir or os.environ.get("VASWANI_CACHE",
                                                             Path.home() / ".cache" / "vaswani_hf"))
    cached = cache_root / "tokenizers" / digest.hexdigest()[:16]
    if cached.exists() or cached.is_symlink():
        problem = manifest_problem(cached)  # every file there, with the SHA-256 it was written with
        if problem is None:
            try:
                tokenizer = AutoTokenizer.from_pretrained(cached)
            except Exception as error:  # tokenizers raises a bare Exception for a malformed file
                problem = f"cannot be loaded: {type(error).__name__}: {error}"
            else:
                logger.info("Reusing the joint BPE cached at %s", cached)
                return tokenizer
        remove_damaged(cached, problem, "training the joint BPE again")  # a damaged entry is rebuilt, not loaded
    if callable(train_dataset):
        logger.info("Training a joint BPE of %d entries on one pass over the training stream", vocab_size)
        texts = [itertools.chain.from_iterable(train_dataset())]
    else:
        logger.info("Training a joint BPE of %d entries on %d sentence pairs", vocab_size, len(train_dataset))
        texts = [iter_sentences(train_dataset, src_lang), iter_sentences(train_dataset, tgt_lang)]
    tokenizer = train_joint_bpe(texts, vocab_size=vocab_size)
    cached.parent.mkdir(parents=True, exist_ok=True)
    # written whole beside the entry, its manifest last, then renamed: a crash leaves no entry a later run loads
    staging = Path(tempfile.mkdtemp(dir=cached.parent, prefix=f".{cached.name}.", suffix=".tmp"))
    try:
        tokenizer.save_pretrained(staging)
        write_manifest(staging)
        swap_in_folder(staging, cached)  # replaces an entry another process wrote meanwhile
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # there only when the save failed
    # the tokenizer as every later run loads it, so that the tokenized splits' cache (keyed by it) is theirs too
    return AutoTokenizer.from_pretrained(cached)


def token_budget_sampler(dataset, max_tokens: int, *, shuffle: bool, seed: int, num_processes: int = 1):
    """Length-bucketed batches of at most `max_tokens` padded tokens (fairseq's --max-tokens), as many as a multiple
    of `num_processes`, for accelerate to shard: every process then gets the same number of batches and no example
    twice (`TokenBudgetBatchSampler(num_batches_multiple=...)`)."""
    src_lengths, tgt_lengths = example_lengths(dataset)
    return TokenBudgetBatchSampler(src_lengths, tgt_lengths, max_tokens=max_tokens, shuffle=shuffle, seed=seed,
                                   num_batches_multiple=num_processes)
