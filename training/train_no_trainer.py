"""Train the Transformer with a plain `accelerate` loop, without Trainer (as transformers' run_translation_no_trainer.py).

    python training/train_no_trainer.py --preset tiny --max_steps 100 --output_dir /tmp/nt      # one process
    accelerate launch training/train_no_trainer.py --preset base --mixed_precision bf16          # N GPUs / nodes
    accelerate launch --config_file training/accelerate_configs/multi_gpu_ddp_bf16.yaml \\
        training/train_no_trainer.py --preset base --max_tokens 3125   # 8 GPUs x 3125 ~ the paper's 25000 tokens
    ACCELERATE_USE_CPU=true accelerate launch --config_file training/accelerate_configs/cpu_2proc.yaml \\
        training/train_no_trainer.py --preset tiny --max_steps 20      # 2 CPU processes over gloo

The data, tokenizer, presets, model, schedule and test-set BLEU are those of train.py (training/common.py and
vaswani_hf); only the loop is written here, and every flag of training/common.py works the same way.

- One update = `--gradient_accumulation_steps` token-budget batches (§5.1) on every process. accelerate shards the
  batches over the processes (rank r takes batches r, r + N, ...; `even_batches` repeats at most N - 1 batches from
  the start of an epoch so that all ranks step together).
- The loss of an update is exact: the label-smoothed cross-entropy (§5.4) summed over every target token of the
  update's global batch (all micro-batches, all processes) divided by the number of those tokens, whatever the
  batches' sizes; an update on N processes equals one on a single process that accumulates the same N batches.
- Adam(0.9, 0.98, 1e-9) and lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (§5.3), one schedule
  step per update (not one per process, as accelerate would otherwise do).
- Checkpoints `output_dir/checkpoint-<step>` (`accelerator.save_state`: optimizer, scheduler, RNG states; the model
  as `save_pretrained` writes it, so `--average_last` and `from_pretrained` read them) every `--checkpointing_steps`
  and at the last step. Each is written as `.tmp-checkpoint-<step>` and renamed when complete, so a half-written one
  is never resumed from. `--resume_from_checkpoint PATH|latest` continues exactly where the run stopped.
- At the end: the model and tokenizer in output_dir, optionally the average of the last N checkpoints (§6.1), test
  BLEU (beam 4, length penalty 0.6), `metrics.json`, and `trainer_state.json` with the loss curve
  (`vaswani-plot curve` reads it); `--push_to_hub` uploads the Hub-ready export (training/export.py).

Data parallel only (one process per device, DDP): for FSDP use train.py with training/accelerate_configs/fsdp_big.yaml.
There is no validation during training; use train.py for validation BLEU every --eval_steps.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `training` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.utils.data import DataLoader
from transformers import DataCollatorForSeq2Seq, HfArgumentParser, set_seed

from training.common import (
    DataArguments,
    ModelArguments,
    RecipeArguments,
    bound_onednn_caches,
    build_model,
    check_distributed,
    cpu_precision,
    finish_run,
    keep_freed_memory,
    prepare_data,
    resolve_preset,
    setup_logging,
    token_budget_sampler,
    write_json_atomic,
)
from training.guards import average_current_run, check_average_last, check_model_inputs, check_run_output_dir
from vaswani_hf import VaswaniForConditionalGeneration
from vaswani_hf.averaging import find_checkpoints
from vaswani_hf.checks import CheckError, RunLock, check_output_dir, read_json
from vaswani_hf.schedule import paper_optimizer_and_schedule

logger = logging.getLogger("vaswani_hf.train_no_trainer")

STATE_NAME = "trainer_state.json"  # the loop's state in a checkpoint; the name and shape of Trainer's, for plots
TMP_PREFIX = ".tmp-"


@dataclass
class LoopArguments:
    """The loop's own flags (everything else comes from training/common.py, as for train.py)."""

    output_dir: str = field(default="outputs/multi30k-de-en-no-trainer", metadata={
        "help": "Model, tokenizer, checkpoints, metrics.json and trainer_state.json go here."})
    max_steps: int | None = field(default=None, metadata={"help": "Parameter updates (default: the preset's)."})
    warmup_steps: int | None = field(default=None, metadata={"help": "Warmup updates (§5.3; default: the preset's)."})
    gradient_accumulation_steps: int = field(default=1, metadata={
        "help": "Token-budget batches per process in one update (default 1)."})
    mixed_precision: str | None = field(default=None, metadata={
        "help": "no, fp16 or bf16. Default: what `accelerate launch` or its config says; a plain `python` run on "
                "the CPU follows --cpu_bf16."})
    cpu: bool = field(default=False, metadata={
        "help": "Run on the CPU even where a GPU is present; launched processes then join over gloo."})
    seed: int = field(default=1, metadata={"help": "Seed of the model init, dropout and batch order (default 1)."})
    logging_steps: int = field(default=25, metadata={"help": "Log the loss every N updates (default 25)."})
    checkpointing_steps: int = field(default=200, metadata={
        "help": "Write a checkpoint every N updates (default 200); 0: only the last update's."})
    save_total_limit: int | None = field(default=5, metadata={
        "help": "Keep at most this many checkpoints (default 5, at least --average_last); none: keep all."})
    resume_from_checkpoint: str | None = field(default=None, metadata={
        "help": "A checkpoint-<step> folder of this script, or 'latest' (the highest step in --output_dir; "
                "folders being written have another name, so it is complete)."})
    per_device_eval_batch_size: int = field(default=64, metadata={"help": "Test sentences per generate() call."})
    num_beams: int | None = field(default=None, metadata={
        "help": "Beam size for the test set (default: the model's generation config, 4)."})
    max_grad_norm: float = field(default=0.0, metadata={"help": "Clip gradients to this norm; 0 (default, the "
                                                                "paper): no clipping."})
    dataloader_num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes (default 0)."})
    push_to_hub: bool = field(default=False, metadata={
        "help": "At the end, export a Hub-ready folder (training/export.py) and upload it to --hub_model_id."})
    hub_model_id: str | None = field(default=None, metadata={
        "help": "The Hub repository (namespace/name; default: the output_dir's name in your namespace)."})
    hub_token: str | None = field(default=None, metadata={"help": "Hub token (default: HF_TOKEN or the login)."})
    hub_private_repo: bool | None = field(default=None, metadata={"help": "Create the repository private."})


def build_parser() -> HfArgumentParser:
    return HfArgumentParser((ModelArguments, DataArguments, RecipeArguments, LoopArguments))


def check_loop_arguments(loop: LoopArguments) -> None:
    """Raises ValueError for a flag out of range."""
    for name in ("gradient_accumulation_steps", "logging_steps", "per_device_eval_batch_size"):
        if getattr(loop, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(loop, name)}.")
    for name in ("max_steps", "warmup_steps", "num_beams", "save_total_limit"):
        if getattr(loop, name) is not None and getattr(loop, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(loop, name)}.")
    if loop.checkpointing_steps < 0 or loop.max_grad_norm < 0 or loop.dataloader_num_workers < 0:
        raise ValueError("--checkpointing_steps, --max_grad_norm and --dataloader_num_workers must be >= 0.")
    if loop.mixed_precision not in (None, "no", "fp16", "bf16"):
        raise ValueError(f"--mixed_precision must be no, fp16 or bf16, got {loop.mixed_precision!r}.")


def resolve_checkpoint(value: str, output_dir: Path) -> Path:
    """The folder --resume_from_checkpoint names: a path, or 'latest' (also 'last', 'true'; the highest
    checkpoint-<step> in output_dir).

    Raises:
        FileNotFoundError: no such checkpoint, or the folder is not a complete checkpoint of this script.
    """
    if value in ("latest", "last", "true"):
        found = find_checkpoints(output_dir) if output_dir.is_dir() else []
        if not found:
            raise FileNotFoundError(f"--resume_from_checkpoint latest: no checkpoint-<step> folder in {output_dir}.")
        path = found[-1]
    else:
        path = Path(value)
    if not (path / STATE_NAME).is_file():
        raise FileNotFoundError(f"--resume_from_checkpoint: {path} is not a checkpoint (no {STATE_NAME}).")
    if not (path / "optimizer.bin").is_file():
        raise FileNotFoundError(f"--resume_from_checkpoint: {path} has no optimizer.bin, so it is not a checkpoint of "
                                f"train_no_trainer.py (a Trainer checkpoint resumes with train.py).")
    return path


def save_checkpoint(accelerator, output_dir: Path, step: int, state: dict, tokenizer, keep: int | None) -> Path:
    """`accelerator.save_state` into `.tmp-checkpoint-<step>`, plus the tokenizer and the loop state, then rename it
    `checkpoint-<step>` (so a folder of that name is always complete) and delete all but the `keep` newest. Every
    process must call it (each writes its RNG state); output_dir must be on a filesystem all nodes share."""
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f"{TMP_PREFIX}checkpoint-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # what an interrupted save left
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / STATE_NAME, state)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():  # a run over the same output_dir
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep:
            for old in find_checkpoints(output_dir)[:-keep]:
                shutil.rmtree(old)
        logger.info("Saved %s", final)
    accelerator.wait_for_everyone()
    return final


def _has_accelerator_device() -> bool:
    devices = getattr(torch, "accelerator", None)  # torch >= 2.6
    return devices.is_available() if devices is not None else torch.cuda.is_available()


def run(argv: list[str] | None = None):
    """Parse `argv` (default: sys.argv), train, evaluate and write everything to --output_dir.

    Returns:
        `(metrics, model)`: the metrics dict (as in metrics.json on the main process; the other processes get the
        training part) and the trained, unwrapped model.

    Raises:
        ValueError: a bad flag, or an accelerate setup this loop does not do (FSDP, DeepSpeed).
        FileNotFoundError: --resume_from_checkpoint does not name a complete checkpoint.
        RuntimeError: launched processes that did not join one job (see `training.common.check_distributed`).
    """
    setup_logging()
    keep_freed_memory()
    bound_onednn_caches()
    model_args, data_args, recipe, loop = build_parser().parse_args_into_dataclasses(args=argv)
    check_loop_arguments(loop)
    preset = resolve_preset(model_args)
    max_steps = loop.max_steps or preset["max_steps"]
    warmup = loop.warmup_steps or preset["warmup_steps"]
    max_tokens = data_args.max_tokens or preset["max_tokens"]
    lr_factor = recipe.lr_factor or preset["lr_factor"]
    output_dir = Path(loop.output_dir)
    # Everything that can be checked is checked now, before the data, the tokenizer and the training run.
    resuming = bool(loop.resume_from_checkpoint)
    check_average_last(recipe.average_last, save_total_limit=loop.save_total_limit, save_total_limit_given=False,
                       saving=True, max_steps=max_steps, save_steps=loop.checkpointing_steps or max_steps,
                       resuming=resuming)
    check_model_inputs(model_args.model_name_or_path, model_args.tokenizer_name, model_args.config_overrides)
    check_output_dir(output_dir, flag="--output_dir")
    lock = RunLock(output_dir).acquire() if int(os.environ.get("RANK", "0")) == 0 else None
    try:
        if lock is not None:
            try:
                check_run_output_dir(output_dir, resuming=resuming, overwrite=recipe.overwrite_output_dir,
                                     inputs={"--model_name_or_path": model_args.model_name_or_path,
                                             "--tokenizer_name": model_args.tokenizer_name})
            except CheckError:
                lock.release(remove=True)  # refused: the folder is left as it was found
                raise
        return _run(model_args, data_args, recipe, loop, preset, max_steps, warmup, max_tokens, lr_factor,
                    output_dir, resuming)
    finally:
        if lock is not None:
            lock.release()


def _run(model_args, data_args, recipe, loop, preset, max_steps, warmup, max_tokens, lr_factor, output_dir,
         resuming):
    from accelerate import Accelerator, DistributedType
    from accelerate.utils import GradientAccumulationPlugin

    run_started = time.time()
    accumulation = loop.gradient_accumulation_steps
    mixed_precision = loop.mixed_precision
    if (mixed_precision is None and "ACCELERATE_MIXED_PRECISION" not in os.environ
            and (loop.cpu or not _has_accelerator_device())):
        bf16, reason = cpu_precision(recipe, model_args, preset)  # as train.py: measured where bf16 is native
        mixed_precision = "bf16" if bf16 else None
        logger.info("Precision: %s (%s).", "bf16 autocast" if bf16 else "fp32", reason)
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        cpu=loop.cpu,
        # Updates are formed below from exactly `accumulation` batches, across epoch ends, so that accelerate's
        # count of micro-steps (when to all-reduce, when the optimizer steps) never drifts from ours.
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=accumulation, sync_with_dataloader=False),
        # One schedule step per update: accelerate would otherwise step it once per process.
        step_scheduler_with_optimizer=False,
    )
    check_distributed(accelerator.num_processes)
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED,
                                        DistributedType.MEGATRON_LM):
        raise ValueError(f"train_no_trainer.py runs data parallel only, not {accelerator.distributed_type}; use "
                         f"train.py (e.g. with training/accelerate_configs/fsdp_big.yaml).")
    set_seed(loop.seed)

    with accelerator.main_process_first():  # the main process trains and caches the BPE, the others load it
        raw, tokenizer, tokenized = prepare_data(model_args, data_args, preset)
    model = build_model(model_args, preset, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    sampler = token_budget_sampler(tokenized["train"], max_tokens, shuffle=True, seed=loop.seed)
    # Its own generator, so that starting an epoch draws nothing from the global RNG (dropout): resuming is exact.
    loader = DataLoader(tokenized["train"], batch_sampler=sampler, collate_fn=collator,
                        num_workers=loop.dataloader_num_workers, generator=torch.Generator())
    optimizer, scheduler = paper_optimizer_and_schedule(model.parameters(), model.config.d_model, warmup, lr_factor)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    unwrapped_config = accelerator.unwrap_model(model).config

    # Checkpoints hold the model as save_pretrained writes it (config, model code, safetensors with the shared
    # embedding once), so that averaging (§6.1) and from_pretrained read them; accelerate saves the rest.
    def save_model_hook(models, weights, folder):
        if accelerator.is_main_process:
            accelerator.unwrap_model(models[0]).save_pretrained(folder)
        weights.clear()

    def load_model_hook(models, folder):
        saved = VaswaniForConditionalGeneration.from_pretrained(folder)
        accelerator.unwrap_model(models.pop()).load_state_dict(saved.state_dict())

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)

    completed, log_history = 0, []
    if loop.resume_from_checkpoint:
        checkpoint = resolve_checkpoint(loop.resume_from_checkpoint, output_dir)
        accelerator.load_state(str(checkpoint))
        saved_state = read_json(checkpoint / STATE_NAME)
        completed, log_history = saved_state["global_step"], saved_state["log_history"]
        logger.info("Resumed from %s at update %d", checkpoint, completed)

    batches_per_epoch = len(loader)  # per process, the same on every process

    def batch_stream(consumed: int):
        """This process's batches from its micro-batch number `consumed` on, epoch after epoch."""
        epoch, skip = divmod(consumed, batches_per_epoch)
        while True:
            epoch_loader = accelerator.skip_first_batches(loader, skip) if skip else loader
            epoch_loader.set_epoch(epoch)  # the loader hands its epoch to the sampler as it starts, ...
            sampler.set_epoch(epoch)  # ... but not to one it wrapped for sharding (several processes)
            try:
                yield from epoch_loader
            except GeneratorExit:  # closed mid-epoch at the end of training: tell accelerate the loader is done
                epoch_loader.end()
                raise
            epoch, skip = epoch + 1, 0

    batches = batch_stream(completed * accumulation)
    minutes = recipe.max_train_minutes if recipe.max_train_minutes is not None else preset.get("max_train_minutes")
    if minutes is None and preset.get("time_budget_minutes") and not loop.max_steps:
        # This loop has no planner (train.py's BudgetPlanner): it stops by the clock 3 minutes before the preset's
        # budget, leaving that for the test translation, with the paper's schedule (no cooldown).
        minutes = preset["time_budget_minutes"] - 3
    deadline = time.monotonic() + minutes * 60 if minutes else None
    keep = max(loop.save_total_limit, recipe.average_last) if loop.save_total_limit else None
    target_tokens = torch.zeros((), dtype=torch.long, device=accelerator.device)
    start = time.perf_counter()
    model.train()
    while completed < max_steps:
        micro_batches = [next(batches) for _ in range(accumulation)]
        # Target tokens in the whole update: every micro-batch on every process.
        num_items = accelerator.reduce(sum(b["labels"].ne(-100).sum() for b in micro_batches), reduction="sum")
        learning_rate = optimizer.param_groups[0]["lr"]
        update_loss = torch.zeros((), device=accelerator.device)
        for batch in micro_batches:
            with accelerator.accumulate(model):
                # Label smoothing (§5.4) in training only; the model's own loss is plain cross-entropy.
                loss = model(**batch, num_items_in_batch=num_items,  # sum over this batch / num_items
                             label_smoothing=unwrapped_config.label_smoothing).loss
                # DDP averages gradients over the processes and accelerator.backward divides by the accumulation
                # steps; undoing both leaves the gradient of (sum over the update's target tokens) / num_items.
                accelerator.backward(loss * (accelerator.num_processes * accumulation))
                update_loss += loss.detach()
                if loop.max_grad_norm > 0 and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), loop.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
        if not accelerator.optimizer_step_was_skipped:  # fp16 overflow: the update did not happen
            scheduler.step()
        completed += 1
        target_tokens += num_items  # already summed over the processes

        stop = False
        if completed % loop.logging_steps == 0 or completed == max_steps:
            entry = {"epoch": round(completed * accumulation / batches_per_epoch, 4), "step": completed,
                     "loss": accelerator.reduce(update_loss, reduction="sum").item(),
                     "learning_rate": learning_rate, "num_tokens": int(num_items)}
            log_history.append(entry)
            if accelerator.is_main_process:
                logger.info("update %d/%d  loss %.4f  lr %.3g  target tokens %d", completed, max_steps,
                            entry["loss"], learning_rate, entry["num_tokens"])
            if deadline is not None:  # every process stops at the same update
                late = torch.tensor(float(time.monotonic() > deadline), device=accelerator.device)
                stop = accelerator.reduce(late, reduction="sum").item() > 0
                if stop and accelerator.is_main_process:
                    logger.info("Time limit reached at update %d: saving and stopping.", completed)
        if stop or completed == max_steps or (loop.checkpointing_steps and completed % loop.checkpointing_steps == 0):
            save_checkpoint(accelerator, output_dir, completed,
                            {"global_step": completed, "max_steps": max_steps, "log_history": log_history},
                            tokenizer, keep)
        if stop:
            break
    batches.close()
    train_seconds = time.perf_counter() - start

    unwrapped = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    metrics = {
        "train_loss": log_history[-1]["loss"] if log_history else math.nan,
        "preset": model_args.preset,
        "parameters": n_params,
        "train_steps": completed,
        "train_epochs": round(completed * accumulation / batches_per_epoch, 2),
        "train_minutes": round(train_seconds / 60, 2),
        "train_target_tokens": int(target_tokens.item()),  # labelled target tokens, all processes
        "max_tokens": max_tokens,
        "num_processes": accelerator.num_processes,
        "gradient_accumulation_steps": accumulation,
        "device": str(accelerator.device),
        "distributed_type": accelerator.distributed_type.value,
        "mixed_precision": accelerator.mixed_precision,
        "torch_threads": torch.get_num_threads(),
        "averaged_checkpoints": recipe.average_last,
    }
    if accelerator.is_main_process:
        unwrapped.save_pretrained(output_dir)
        tokenizer.save_pretrained(output_dir)
        write_json_atomic(output_dir / STATE_NAME,
                          {"global_step": completed, "max_steps": max_steps, "log_history": log_history})
        if recipe.average_last:
            # Only this run's checkpoints (or the resumed run's), never an earlier run's left in the folder.
            average_current_run(output_dir, recipe.average_last, started=run_started, resuming=resuming)
            unwrapped.load_state_dict(VaswaniForConditionalGeneration.from_pretrained(output_dir).state_dict())
            logger.info("Averaged the last %d checkpoints into %s", recipe.average_last, output_dir)
        finish_run(unwrapped, tokenizer, raw, data_args, recipe, metrics, output_dir,
                   batch_size=loop.per_device_eval_batch_size,
                   num_beams=loop.num_beams or unwrapped.generation_config.num_beams)
        if loop.push_to_hub:
            from training.export import export_and_push

            export_and_push(output_dir, repo_id=loop.hub_model_id, token=loop.hub_token,
                            private=loop.hub_private_repo)
    return metrics, unwrapped


def main(argv: list[str] | None = None) -> dict:
    """Console entry `vaswani-train-no-trainer`: `run(argv)`, returning the metrics."""
    return run(argv)[0]


def cli() -> int:
    """Console entry `vaswani-train-no-trainer`: runs `main` and exits 0 (`main` returns the metrics dict, which
    `sys.exit` would print and turn into exit status 1)."""
    from training.checkpoints import CheckpointError
    from vaswani_hf.checks import CheckError
    from vaswani_hf.data import DataError

    try:
        main()
    except (CheckError, CheckpointError, DataError) as error:  # what was wrong and what to do; no traceback
        raise SystemExit(f"error: {error}") from None
    return 0


if __name__ == "__main__":
    sys.exit(cli())
