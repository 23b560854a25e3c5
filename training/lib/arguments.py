"""The flags both training commands share, as dataclasses for `HfArgumentParser`: the model (`ModelArguments`), the
data (`DataArguments`) and the recipe (`RecipeArguments`). train.py adds `Seq2SeqTrainingArguments`, train_no_trainer.py
its `LoopArguments`. Values out of range are refused when the flags are parsed (`CheckError`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vaswani_hf.checks import CheckError


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
        "help": "A Hub dataset name (needs the network), e.g. wmt14 with --dataset_config_name de-en, or a local "
                "folder in the Hub's layout (train.jsonl, validation.jsonl, test.jsonl of {\"translation\": {...}})."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Config of --dataset_name."})
    empty_lines: str = field(default="skip", metadata={
        "help": "Pairs with an empty side: skip (counted and reported), error, or keep."})
    max_source_length: int = field(default=256, metadata={"help": "Truncate source sentences to this many tokens."})
    max_target_length: int = field(default=256, metadata={"help": "Truncate target sentences to this many tokens."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training pairs."})
    max_eval_samples: int | None = field(default=None, metadata={
        "help": "Validation pairs scored during training (default: the preset's) and decoded by the choice of the "
                "checkpoints to average and of the length penalty at the end (default: all)."})
    max_test_samples: int | None = field(default=None, metadata={"help": "Use only the first N test pairs."})
    max_tokens: int | None = field(default=None, metadata={
        "help": "Token budget per batch per device, padded tokens counted (fairseq --max-tokens). Default: the "
                "preset's."})
    preprocessing_num_workers: int | None = field(default=None, metadata={
        "help": "Processes that clean and tokenize the data (datasets' num_proc; default: this one)."})
    streaming: bool = field(default=False, metadata={
        "help": "Read the training split as a stream, tokenized and batched a pool at a time (memory flat in the "
                "corpus size, nothing written to disk), for corpora larger than memory. vaswani-train only; needs "
                "--max_steps."})
    drop_long_pairs: bool = field(default=False, metadata={
        "help": "Leave out training pairs longer than --max_source_length/--max_target_length tokens (counted and "
                "reported), as fairseq and tensor2tensor filter, instead of truncating them."})

    def __post_init__(self):
        # Refused when the flags are parsed, not after an hour of training; 0 is not "all".
        for name in ("max_source_length", "max_target_length", "max_train_samples", "max_eval_samples",
                     "max_test_samples", "max_tokens", "preprocessing_num_workers"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < 1):
                raise CheckError(f"--{name} must be >= 1 (leave the flag out for the default), got {value}.")
        from vaswani_hf.bleu import bleu_tokenizer

        try:  # the BLEU of the output: refused now where it is undefined, not after the translations
            bleu_tokenizer(self.target_lang)
        except ValueError as error:
            raise CheckError(f"--target_lang {self.target_lang}: {error}") from None


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
    average_last: int | None = field(default=None, metadata={
        "help": "At the end, average the last N checkpoints (§6.1: 5 for base, 20 for big) into the output model; 0: "
                "none. Default: where the preset plans a cooldown (cpu, gpu), N is chosen on the validation set among "
                "the checkpoints saved over the cooldown (1: the last alone); otherwise none."})
    max_train_minutes: float | None = field(default=None, metadata={
        "help": "Stop training after this many minutes (checkpoint saved), then evaluate as usual."})
    save_every_minutes: float | None = field(default=None, metadata={
        "help": "Save a checkpoint every this many minutes of training, as the paper did (§6.1: checkpoints written "
                "at 10-minute intervals, the last 5 or 20 averaged), besides any --save_steps ones (for the clock "
                "alone: --save_strategy no, or --checkpointing_steps 0 without Trainer); all processes save at the "
                "same step."})
    time_budget_minutes: float | None = field(default=None, metadata={
        "help": "Plan the number of steps from the measured speed of the first ones so that the whole command "
                "(start to test BLEU) ends within this many minutes; the schedule ends with a linear lr cooldown. "
                "Default: the preset's (cpu: 26, gpu: 6), unless "
                "--max_steps is given."})
    num_samples: int = field(default=5, metadata={"help": "Sample translations printed at the end."})
    length_penalty: float | None = field(default=None, metadata={
        "help": "The length penalty alpha of the final translations (§6.1; the paper's 0.6), written into the model's "
                "generation_config.json. Default: chosen on the validation set at the end of the run (§6.1: "
                "\"chosen after experimentation on the development set\"), among 0.6 to 2.5 in both forms of "
                "--length_penalty_style."})
    length_penalty_style: str | None = field(default=None, metadata={
        "help": "How the length penalty divides a hypothesis' log-probability: hf (transformers' generate(): "
                "|Y|^alpha) or gnmt (the paper's ((5 + |Y|) / 6)^alpha, §6.1). Default: chosen on validation with "
                "the alpha; hf where --length_penalty is given alone."})
    skip_test: bool = field(default=False, metadata={
        "help": "End without translating the test split, and leave the time budget no time for it: for runs whose "
                "choices are made on the validation set (vaswani-ablate). Score the model later with "
                "vaswani-evaluate."})
    overwrite_output_dir: bool = field(default=False, metadata={
        "help": "Start a new run in an --output_dir that holds an earlier run: its checkpoint-<step> folders are "
                "removed, its model and metrics replaced. Without it such a folder is refused."})
    hub_endpoint: str | None = field(default=None, metadata={
        "help": "With --push_to_hub: the Hub server's URL (default: HF_ENDPOINT, else https://huggingface.co); it "
                "must answer before training starts."})
    cpu_bf16: str = field(default="auto", metadata={
        "help": "Training on a CPU: auto (bf16 autocast where the CPU computes bf16 natively, AVX512-BF16 or AMX, "
                "and a training step measured at the start is at least 1.15x faster in bf16 than in fp32), yes, "
                "or no (fp32)."})

    def __post_init__(self):
        # Refused when the flags are parsed; 0 is not "the preset's" (leave the flag out for that).
        if self.cpu_bf16 not in ("auto", "yes", "no"):
            raise CheckError(f"--cpu_bf16 must be auto, yes or no, got {self.cpu_bf16!r}.")
        if self.length_penalty_style not in (None, "hf", "gnmt"):
            raise CheckError(f"--length_penalty_style must be hf (transformers' generate(): |Y|^alpha) or gnmt (the "
                             f"paper's, §6.1: ((5 + |Y|) / 6)^alpha), got {self.length_penalty_style!r}.")
        if self.length_penalty is not None and (isinstance(self.length_penalty, bool)
                                                or not math.isfinite(self.length_penalty) or self.length_penalty < 0):
            raise CheckError(f"--length_penalty must be a number >= 0 (the paper's 0.6; leave the flag out to choose "
                             f"it on the validation set), got {self.length_penalty}.")
        if self.average_last is not None and self.average_last < 0:
            raise CheckError(f"--average_last must be >= 0 (0: no averaging; leave the flag out to choose it on the "
                             f"validation set), got {self.average_last}.")
        for name in ("lr_factor", "max_train_minutes", "save_every_minutes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not math.isfinite(value) or value <= 0):
                raise CheckError(f"--{name} must be a positive number (leave the flag out for the preset's), got "
                                 f"{value}.")
