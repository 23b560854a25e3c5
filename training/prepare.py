"""What both training loops (`train.py` on Seq2SeqTrainer, `train_no_trainer.py` on accelerate) share: the presets,
the data/tokenizer pipeline up to token-budget batches, the final BLEU evaluation, and atomic writes.

Everything here is a thin layer over `vaswani_hf` (data, tokenizer, schedule, BLEU) so that no step is written twice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vaswani_hf import VaswaniConfig, train_joint_bpe
from vaswani_hf.checks import read_json
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
        "trainer": {"eval_steps": 5000, "save_steps": 1000},
    },
    "big": {
        "model": {"d_model": 1024, "num_heads": 16, "d_ff": 4096, "dropout": 0.3},
        "max_tokens": 4096, "warmup_steps": 4000, "lr_factor": 1.0, "max_steps": 300_000, "vocab_size": 37000,
        "trainer": {"eval_steps": 5000, "save_steps": 1000},
    },
    "cpu": {
        "model": {"d_model": 256, "encoder_layers": 3, "decoder_layers": 3, "num_heads": 4, "d_ff": 1024},
        # 2,048-token batches: at the same compute, 1,300 steps of 2,048 tokens scored 36.33 test BLEU where 650-700
        # steps of 4,096 scored 33.0-33.5 (README, "The cpu preset's departures").
        "max_tokens": 2048, "warmup_steps": 400, "lr_factor": 0.5, "max_steps": 2600, "vocab_size": 8000,
        # The whole command (start to BLEU printed) plans its steps to end within this budget (training/planner.py):
        # up to max_steps, fewer on a slower machine, the schedule always ending in a linear cooldown to lr 0 over
        # the last `cooldown_fraction` of the planned steps (a departure from §5.3, cpu preset only; README). The
        # budget is 26 minutes, and 18 on a CPU with native bf16 (unless --cpu_bf16 no), whichever precision the run
        # then measures faster there: with set-up (venv, pip) the README's one-line command stays under 30 and 20
        # minutes.
        "time_budget_minutes": 26, "time_budget_minutes_native_bf16": 18, "cooldown_fraction": 0.2,
        "max_eval_samples": 200, "trainer": {"eval_steps": 500, "save_steps": 500},
    },
    "gpu": {
        # The paper's base model (Table 3: d_model 512, 6+6 layers, 8 heads, d_ff 2048, dropout 0.1) on Multi30k on one
        # GPU within a time budget, as the cpu preset on a CPU: the planner fits the steps to the budget and ends the
        # schedule in a linear cooldown. The departures: 4,096-token batches (the paper's 25,000 would be ~5 epochs of
        # Multi30k's 29,000 pairs per 100 steps) with a 1,000-step warmup and lr factor 0.5 (the paper's peak lr,
        # 7e-4), the budget and the cooldown. Dropout stays at 0.1: with 0.3, an H100 run scored 25.1 test BLEU where
        # 0.1 scored 37.7 in the same 8 minutes (README, "The main job on a GPU").
        "model": {},
        "max_tokens": 4096, "warmup_steps": 1000, "lr_factor": 0.5, "max_steps": 20_000, "vocab_size": 8000,
        "time_budget_minutes": 6, "cooldown_fraction": 0.2,
        # The planner's guess for the final test translation until a validation run has timed decoding (the cpu
        # presets' guess, 0.15 s a sentence, is a CPU's; an H100 decoded the test set at 43-54 sentences/s).
        "seconds_per_test_sentence": 0.03,
        "max_eval_samples": 200,
        # Two loader processes collate the next batches while the GPU computes (padding ~300 sentences a step in
        # Python would otherwise leave the GPU waiting).
        "trainer": {"eval_steps": 1000, "save_steps": 1000, "dataloader_num_workers": 2,
                    "per_device_eval_batch_size": 128},
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

    preset: str = field(default="cpu", metadata={
        "help": "cpu (default run), base or big (the paper's), gpu (base size on Multi30k in 6 minutes on one GPU), "
                "or tiny."})
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
    time_budget_minutes: float | None = field(default=None, metadata={
        "help": "Plan the number of steps from the measured speed of the first ones so that the whole command "
                "(start to test BLEU) ends within this many minutes; the schedule ends with a linear lr cooldown. "
                "Default: the preset's (cpu: 26; 18 on a CPU with native bf16 unless --cpu_bf16 no), unless "
                "--max_steps is given."})
    num_samples: int = field(default=5, metadata={"help": "Sample translations printed at the end."})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "Start a new run in an --output_dir that holds an earlier run: its checkpoint-<step> folders are "
                "removed, its model and metrics replaced. Without it such a folder is refused."})
    cpu_bf16: str = field(default="auto", metadata={
        "help": "Training on a CPU: auto (bf16 autocast where the CPU computes bf16 natively, AVX512-BF16 or AMX, "
                "and a training step measured at the start is at least 1.15x faster in bf16 than in fp32), yes, "
                "or no (fp32)."})

    def __post_init__(self):
        if self.cpu_bf16 not in ("auto", "yes", "no"):  # refused when the flags are parsed
            raise ValueError(f"--cpu_bf16 must be auto, yes or no, got {self.cpu_bf16!r}.")


# oneDNN ISA limits (ONEDNN_MAX_CPU_ISA) below which it has no bf16 instructions.
_ONEDNN_ISAS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}


def cpu_has_native_bf16() -> bool:
    """True where torch can compute bf16 natively on this CPU: /proc/cpuinfo (Linux) has avx512_bf16 or amx_bf16, and
    neither torch's kernels (ATEN_CPU_CAPABILITY, e.g. avx2) nor oneDNN (ONEDNN_MAX_CPU_ISA, e.g. AVX2) are limited
    below them. Elsewhere bf16 on the CPU is emulated and hundreds of times slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    if "avx512_bf16" not in flags and "amx_bf16" not in flags:
        return False
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper() in _ONEDNN_ISAS_WITHOUT_BF16:
        return False
    return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "NO AVX", "AVX2")


# On a CPU with native bf16, --cpu_bf16 auto takes bf16 autocast only when a training step measured in both
# precisions is at least this much faster in bf16; closer than that, fp32 (exact, and noise cannot flip the choice).
BF16_MIN_SPEEDUP = 1.15


def time_training_precisions(config: VaswaniConfig, *, rows: int = 32, length: int = 32,
                             repetitions: int = 3) -> tuple[float, float]:
    """Median wall-clock seconds of one CPU training step's forward and backward pass, `(fp32, bf16 autocast)`.

    The step is that of a fresh model of `config`'s widths (d_model, heads, d_ff, vocabulary, activation, layer
    norm placement) with one layer per stack, on a random batch of `rows` x `length` source and target tokens
    (the last quarter of half the source rows padding; at most `max_position_embeddings` tokens with learned
    positions), in train mode with dropout: the ratio of the two times, not the times, is what it is for, and a
    layer's products and the output projection keep their shapes. The two precisions alternate, after one untimed
    step each, so that load from other processes hits both alike. The global random state is restored afterwards.
    About 2 s at the `cpu` preset's widths on 2 cores.
    """
    import copy

    from vaswani_hf import VaswaniForConditionalGeneration

    probe = copy.deepcopy(config)
    probe.encoder_layers = probe.decoder_layers = 1
    if probe.position_embedding_type == "learned":  # a learned table refuses longer input
        length = min(length, probe.max_position_embeddings)
    times: dict[bool, list[float]] = {False: [], True: []}
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        torch.manual_seed(0)
        model = VaswaniForConditionalGeneration(probe).train()
        ids = torch.randint(4, probe.vocab_size, (rows, length))
        labels = torch.randint(4, probe.vocab_size, (rows, length))
        mask = torch.ones(rows, length, dtype=torch.long)
        mask[: rows // 2, length - length // 4:] = 0
        for repetition in range(repetitions + 1):
            for bf16 in (False, True):
                started = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
                loss.backward()
                if repetition:
                    times[bf16].append(time.perf_counter() - started)
                model.zero_grad(set_to_none=True)
    return statistics.median(times[False]), statistics.median(times[True])


def precision_probe_config(model_args: ModelArguments, preset: dict[str, Any]) -> VaswaniConfig:
    """The config whose widths `time_training_precisions` measures: a local --model_name_or_path's, else the preset's
    with --config_overrides and the preset's (or --vocab_size's) vocabulary."""
    path = model_args.model_name_or_path
    if path and Path(path).is_dir():
        return VaswaniConfig.from_pretrained(path)
    return VaswaniConfig(vocab_size=model_args.vocab_size or preset["vocab_size"],
                         **{**preset["model"], **parse_overrides(model_args.config_overrides)})


def cpu_precision(recipe: RecipeArguments, model_args: ModelArguments, preset: dict[str, Any]) -> tuple[bool, str]:
    """Whether a training run on the CPU computes in bf16 autocast, and why in words, per --cpu_bf16.

    `yes` and `no` are taken as given. `auto`: fp32 where the CPU has no native bf16 (`cpu_has_native_bf16`; there
    torch emulates bf16 matmuls, hundreds of times slower). Where it has, native bf16 is not always faster: a Zen 5
    EPYC trains the `cpu` preset 1.5-1.8x faster in bf16, but a 2-core Xeon with AVX512-BF16 and no AMX (CPU family 6,
    model 207) multiplies bf16 at half its fp32 rate (MKL's AVX-512 fp32 GEMMs) and trains 1.5x *slower* in bf16.
    So the two are measured (`time_training_precisions`, about 2 s) and bf16 is taken when it is at least
    `BF16_MIN_SPEEDUP` (1.15) times faster. Several processes (WORLD_SIZE > 1) do not measure, since each would
    time its own step and they could choose differently: native bf16 means bf16 there.
    """
    native = cpu_has_native_bf16()
    if recipe.cpu_bf16 == "yes":
        return True, "--cpu_bf16 yes" + ("" if native else "; this CPU has no native bf16, expect it slow")
    if recipe.cpu_bf16 == "no":
        return False, "--cpu_bf16 no"
    if not native:
        return False, ("no native bf16 here (no avx512_bf16/amx_bf16 CPU flag, or torch limited below it by "
                       "ATEN_CPU_CAPABILITY/ONEDNN_MAX_CPU_ISA): bf16 matmuls would be emulated, far slower than fp32")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return True, "the CPU has native bf16 (avx512_bf16/amx_bf16; not measured with several processes); " \
                     "--cpu_bf16 no for fp32"
    fp32, bf16 = time_training_precisions(precision_probe_config(model_args, preset))
    measured = (f"a one-layer training step at the model's widths took {bf16 * 1e3:.0f} ms in bf16 autocast "
                f"against {fp32 * 1e3:.0f} ms in fp32")
    if fp32 >= BF16_MIN_SPEEDUP * bf16:
        return True, f"the CPU has native bf16 and {measured}; --cpu_bf16 no for fp32"
    return False, (f"the CPU has native bf16, but {measured} (bf16 is taken when at least {BF16_MIN_SPEEDUP}x "
                   f"faster); --cpu_bf16 yes for bf16")


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


def prepare_data(model_args: ModelArguments, data_args: DataArguments, preset: dict[str, Any]):
    """Data -> joint BPE -> token ids: load the splits (the shipped Multi30k by default), keep the first
    --max_train_samples training pairs, get the tokenizer (`get_tokenizer`: trained on the training split and cached,
    or loaded) and tokenize every split, truncated to --max_source_length / --max_target_length.

    Returns:
        `(raw, tokenizer, tokenized)`: the `DatasetDict` of `{"translation": ...}` records, the tokenizer, and the
        `DatasetDict` of `input_ids` / `attention_mask` / `labels`.
    """
    raw = load_raw_datasets(data_args)
    raw["train"] = select(raw["train"], data_args.max_train_samples)
    tokenizer = get_tokenizer(model_args, raw["train"], data_args, model_args.vocab_size or preset["vocab_size"])
    tokenized = tokenize_dataset(raw, tokenizer, data_args.source_lang, data_args.target_lang,
                                 max_length=data_args.max_source_length,
                                 max_target_length=data_args.max_target_length, keep_translation=False)
    return raw, tokenizer, tokenized


def is_multi30k(data_args: DataArguments) -> bool:
    """True when the run reads the shipped Multi30k (neither --train_file nor --dataset_name given)."""
    return not (data_args.train_file or data_args.dataset_name)


def dataset_label(data_args: DataArguments) -> str:
    """What the run trained on, for metrics.json and the model card: "multi30k", the Hub dataset name, or the
    training file's name."""
    if is_multi30k(data_args):
        return "multi30k"
    if data_args.dataset_name:
        return data_args.dataset_name
    return Path(data_args.train_file).name


def build_model(model_args: ModelArguments, preset: dict[str, Any], tokenizer):
    """The model to train: the saved one of --model_name_or_path, else a fresh model of `preset` (fields overridden by
    --config_overrides) whose vocabulary size and special ids are the tokenizer's.

    Raises:
        ValueError: the tokenizer's size differs from the model's vocabulary, or a bad --config_overrides item.
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
        raise ValueError(f"The tokenizer has {len(tokenizer)} entries but the model's vocabulary has "
                         f"{model.config.vocab_size}; pass the tokenizer saved with the model (--tokenizer_name).")
    logger.info("Model: %s parameters, d_model=%d, %d+%d layers, %d heads, d_ff=%d",
                f"{sum(p.numel() for p in model.parameters()):,}", model.config.d_model,
                model.config.encoder_layers, model.config.decoder_layers, model.config.num_heads, model.config.d_ff)
    return model


def check_distributed(num_processes: int) -> None:
    """Refuse a launch whose processes did not join one job.

    `torchrun` or `accelerate launch` with several processes on a machine without GPUs, but without the CPU switch
    (`--use_cpu` for train.py, `--cpu` for train_no_trainer.py, or the environment variable ACCELERATE_USE_CPU=true),
    leaves every process training alone on all the data and writing the same output_dir.

    Raises:
        RuntimeError: the launcher's WORLD_SIZE differs from the `num_processes` that accelerate set up.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and num_processes != world_size:
        raise RuntimeError(
            f"Launched as {world_size} processes (WORLD_SIZE) but accelerate set up {num_processes}: the processes "
            f"would each train alone. Without GPUs, launch with ACCELERATE_USE_CPU=true (or pass --use_cpu to "
            f"train.py, --cpu to train_no_trainer.py) so that they join over gloo.")


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
        try:
            for path in sorted(cached.glob("*.json")):
                read_json(path)
            tokenizer = AutoTokenizer.from_pretrained(cached)
        except Exception as error:  # a damaged cache entry is rebuilt, not a failed run
            logger.warning("The cached joint BPE at %s is damaged (%s); training it again.", cached, error)
            shutil.rmtree(cached, ignore_errors=True)
        else:
            logger.info("Reusing the joint BPE cached at %s", cached)
            return tokenizer
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
                      num_beams: int = 4, length_penalty: float = 0.6, is_multi30k: bool = True,
                      length_penalty_style: str = "hf") -> dict[str, Any]:
    """Translate the test split (beam 4, length penalty 0.6 by default) and score it with detokenized sacreBLEU and,
    on the shipped Multi30k, lowercased tokenized BLEU against the official `tok/` references.

    `length_penalty_style`: "hf" (`model.generate`: score / |Y|^alpha) or "gnmt" (the paper's
    ((5 + |Y|) / 6)^alpha and at most input length + 50 tokens, `vaswani_hf.decoding.paper_generate`).

    Returns:
        metrics dict (`bleu`, `signature`, `tok_bleu`, `tok_signature`, `test_sentences`, `test_seconds`,
        `sentences_per_second`) and the hypotheses under `hypotheses`.
    """
    from vaswani_hf.bleu import compute_bleu
    from vaswani_hf.inference import translate_sentences

    sources = [t[data_args.source_lang] for t in test_dataset["translation"]]
    references = [t[data_args.target_lang] for t in test_dataset["translation"]]
    start = time.perf_counter()
    generate_fn = None
    if length_penalty_style == "gnmt":
        from vaswani_hf.decoding import paper_generate

        def generate_fn(m, input_ids, attention_mask=None, **_):
            return paper_generate(m, input_ids, attention_mask, num_beams=num_beams, alpha=length_penalty)
    elif length_penalty_style != "hf":
        raise ValueError(f"length_penalty_style must be 'hf' or 'gnmt', got {length_penalty_style!r}.")
    hypotheses = translate_sentences(model, tokenizer, sources, batch_size=batch_size, num_beams=num_beams,
                                     length_penalty=length_penalty, generate_fn=generate_fn)
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
        "length_penalty_style": length_penalty_style,
    }
    if "tok_bleu" in scores:
        metrics["test_tok_bleu"] = round(scores["tok_bleu"], 2)
        metrics["test_tok_bleu_signature"] = scores["tok_signature"]
    return {"metrics": metrics, "hypotheses": hypotheses, "sources": sources, "references": references}


def finish_run(model, tokenizer, raw_datasets, data_args: DataArguments, recipe: RecipeArguments, metrics: dict,
               output_dir: str | os.PathLike, *, batch_size: int, num_beams: int) -> dict:
    """The end of a training run, on the main process only: translate and score the test split if the data has one
    (`evaluate_test_set`: beam search, §6.1; BLEU two ways), print `recipe.num_samples` sample translations and the
    scores, and write `test_translations.txt` and `metrics.json` (atomically) into `output_dir`.

    `metrics` is updated in place and returned, with `source_lang`, `target_lang` and `dataset` added (the model card
    of `training/export.py` reads them).
    """
    output_dir = Path(output_dir)
    metrics.update(source_lang=data_args.source_lang, target_lang=data_args.target_lang,
                   dataset=dataset_label(data_args))
    if "test" in raw_datasets:
        test = select(raw_datasets["test"], data_args.max_test_samples)
        result = evaluate_test_set(model, tokenizer, test, data_args, batch_size=batch_size, num_beams=num_beams,
                                   is_multi30k=is_multi30k(data_args))
        metrics.update(result["metrics"])
        write_lines_atomic(output_dir / "test_translations.txt", result["hypotheses"])
        print("\nSample translations (test set):")
        for src, hyp, ref in list(zip(result["sources"], result["hypotheses"], result["references"]))[
                : recipe.num_samples]:
            print(f"  source:    {src}\n  output:    {hyp}\n  reference: {ref}\n")
    write_json_atomic(output_dir / "metrics.json", metrics)
    print(f"Test BLEU (sacreBLEU, detokenized): {metrics.get('test_bleu')}   "
          f"{metrics.get('test_bleu_signature', '')}")
    if "test_tok_bleu" in metrics:
        print(f"Test BLEU (lowercased, tokenized, as Multi30k papers report): {metrics['test_tok_bleu']}")
    print(f"Model, tokenizer and metrics.json written to {output_dir}")
    return metrics


MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of returning it to the OS at once (Linux only).

    By default glibc serves large allocations with mmap and gives them back on free, so every training step
    page-faults its activations in again: the CPU main job took 218 M minor page faults and 397 s of system time in
    18 minutes. With mmap threshold 2 GiB, trim threshold 2 GiB and top pad 1 GiB (the same as the environment
    variables MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_) a training step of the base model on 2
    cores page-faults ~0 times instead of ~100,000 and runs about 7-12 % faster, and the main job trains in 14.1
    instead of 19.0 minutes. The price: freed memory stays in the process (main job peak RSS 7.4 instead of 5.2
    GiB). Skipped when any MALLOC_* variable above is set (the user's choice wins), when
    VASWANI_KEEP_FREED_MEMORY=0, or where the C library is not glibc.

    Returns:
        True if all three settings were applied.
    """
    if os.environ.get("VASWANI_KEEP_FREED_MEMORY", "1") == "0" or any(name in os.environ for name in MALLOC_ENV):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: musl and others have no mallopt with these meanings
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        settings = ((m_mmap_threshold, 2**31 - 1), (m_trim_threshold, 2**31 - 1), (m_top_pad, 2**30))
        return all(libc.mallopt(option, ctypes.c_int(value)) == 1 for option, value in settings)
    except (OSError, AttributeError):
        return False


ONEDNN_CACHE_ENV = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY")


def bound_onednn_caches(capacity: int = 64) -> bool:
    """Keep at most `capacity` oneDNN computations in each of torch's two caches of them (default 64; torch's and
    oneDNN's default is 1,024). Call it before the process's first oneDNN product.

    torch caches a oneDNN computation, with its buffers, for every input shape it meets: ideep's cache
    (`LRU_CACHE_CAPACITY`) and oneDNN's primitive cache (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`). A CPU training step of
    this project multiplies its linears in oneDNN (bf16 autocast, or fp32 where `cpu_training_matmul()` chose it),
    and with token-budget batches and only the real tokens computed (`RealTokens`) nearly every step brings new row
    counts, so both caches fill to 1,024 entries of a few MiB each. Bounded to 64, a 150-step `vaswani-train` run
    on a 2-core Zen 5 EPYC peaked at 1.57 instead of 3.50 GiB in bf16 (1.64 instead of 3.57 GiB in fp32), and the
    whole bf16 main job at 1.7 instead of 6.2 GiB, training in 10.5 instead of 12.1 minutes: a step's layers share
    their shapes, so a step's own computations still fit. Skipped when the user set any of those variables (the
    user's choice wins).

    Returns:
        True if the capacities were set.
    """
    if any(name in os.environ for name in ONEDNN_CACHE_ENV):
        return False
    os.environ["LRU_CACHE_CAPACITY"] = os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(capacity)
    return True


def setup_logging(level: int = logging.INFO) -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=level)
    torch.set_num_threads(max(1, torch.get_num_threads()))
