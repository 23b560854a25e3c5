"""Train the Transformer with a plain `accelerate` loop, without Trainer (as transformers'
run_translation_no_trainer.py).

    python training/train_no_trainer.py --preset tiny --max_steps 100 --output_dir /tmp/nt      # one process
    accelerate launch training/train_no_trainer.py --preset base --mixed_precision bf16          # N GPUs / nodes
    accelerate launch --config_file training/accelerate_configs/multi_gpu_ddp_bf16.yaml \\
        training/train_no_trainer.py --preset base --max_tokens 3125   # 8 GPUs x 3125 ~ the paper's 25000 tokens
    ACCELERATE_USE_CPU=true accelerate launch --config_file training/accelerate_configs/cpu_2proc.yaml \\
        training/train_no_trainer.py --preset tiny --max_steps 20      # 2 CPU processes over gloo

The minimal reference loop, as transformers' `*_no_trainer.py` examples are: the recipe written out in one loop that
a reader can follow update by update. Set-up, checks, lock, averaging, test-set BLEU, metrics and upload are train.py's
(the run scaffold of training/lib/run.py); the data, tokenizer, presets, model and schedule too
(training/lib/prepare.py, training/lib/presets.py and vaswani_hf), and every shared flag works the same way.

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
  and at the last step. Each is written as `.tmp-checkpoint-<step>` and renamed when complete.
  `--resume_from_checkpoint PATH|last` continues exactly where the run stopped, from the newest complete checkpoint.
- At the end: the model and tokenizer in output_dir, optionally the average of the last N checkpoints (§6.1), test
  BLEU (beam 4, length penalty 0.6), `metrics.json`, and `trainer_state.json` with the loss curve
  (`vaswani-plot curve` reads it); `--push_to_hub` uploads the Hub-ready export (training/export.py).

What it does not do, and train.py does:
- plan its updates to a time budget: with a budget (--time_budget_minutes, or the cpu and gpu presets' without
  --max_steps) it stops training by the clock, early enough for the test translation to end within the budget,
  with the paper's schedule and no cooldown, so a budget-stopped run ends at a high learning rate (and without a
  plan, the cpu preset's `long_run_dropout` is not used);
- validation BLEU every --eval_steps;
- FSDP or DeepSpeed: data parallel only (one process per device, DDP); for FSDP use train.py with
  training/accelerate_configs/fsdp_big.yaml.
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

if __package__ in (None, ""):  # run as a file (python training/train_no_trainer.py): import as vaswani_training
    __package__ = "vaswani_training"

import torch
from torch.utils.data import DataLoader
from transformers import HfArgumentParser, set_seed

from vaswani_hf import VaswaniForConditionalGeneration
from vaswani_hf.averaging import find_checkpoints
from vaswani_hf.checks import CheckError, follow_umask, read_json, weight_files
from vaswani_hf.data import PaddedBatches
from vaswani_hf.fast_paths_vaswani import training_fast_paths
from vaswani_hf.schedule import paper_optimizer_and_schedule

from .lib.arguments import DataArguments, ModelArguments, RecipeArguments
from .lib.checkpoints import RUN_SETTINGS, average_into, run_settings
from .lib.choose import write_given_decoding
from .lib.output_dir import claim_output_dir, retire_previous_results, write_json_atomic
from .lib.precision import cpu_precision
from .lib.prepare import token_budget_sampler
from .lib.presets import resolve_preset
from .lib.run import (
    HubPush,
    Run,
    check_distributed,
    check_inputs,
    check_positions,
    command_cli,
    count_test_sentences,
    finish,
    new_run,
    prepare,
    run_metrics,
    start_process,
    training_deadline,
)

logger = logging.getLogger("vaswani_hf.train_no_trainer")

STATE_NAME = "trainer_state.json"  # the loop's state in a checkpoint; the name and shape of Trainer's, for plots
TMP_PREFIX = ".tmp-"


@dataclass
class LoopArguments:
    """The loop's own flags (the shared ones are training/lib/arguments.py's, as for train.py)."""

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
        "help": "A checkpoint-<step> folder of this script, a run folder holding them, or 'last'/'latest' (the "
                "newest complete checkpoint in --output_dir)."})
    per_device_eval_batch_size: int = field(default=64, metadata={"help": "Test sentences per generate() call."})
    num_beams: int | None = field(default=None, metadata={
        "help": "Beam size for the test set (default: the model's generation config, 4)."})
    max_grad_norm: float = field(default=0.0, metadata={"help": "Clip gradients to this norm; 0 (default, the "
                                                                "paper): no clipping."})
    label_smoothing_factor: float = field(default=0.1, metadata={
        "help": "Label smoothing epsilon_ls of the training loss (default 0.1, §5.4), as Trainer's flag of this name."})
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
    """Refuse a loop flag out of range.

    Raises:
        CheckError: naming the flag.
    """
    for name in ("gradient_accumulation_steps", "logging_steps", "per_device_eval_batch_size"):
        if getattr(loop, name) < 1:
            raise CheckError(f"--{name} must be >= 1, got {getattr(loop, name)}.")
    for name in ("max_steps", "warmup_steps", "num_beams", "save_total_limit"):
        if getattr(loop, name) is not None and getattr(loop, name) < 1:
            raise CheckError(f"--{name} must be >= 1, got {getattr(loop, name)}.")
    if loop.checkpointing_steps < 0 or loop.max_grad_norm < 0 or loop.dataloader_num_workers < 0:
        raise CheckError("--checkpointing_steps, --max_grad_norm and --dataloader_num_workers must be >= 0.")
    if not 0.0 <= loop.label_smoothing_factor < 1.0:
        raise CheckError(f"--label_smoothing_factor must be in [0, 1), got {loop.label_smoothing_factor}.")
    if loop.mixed_precision not in (None, "no", "fp16", "bf16"):
        raise CheckError(f"--mixed_precision must be no, fp16 or bf16, got {loop.mixed_precision!r}.")


def save_checkpoint(accelerator, output_dir: Path, step: int, state: dict, tokenizer, *, keep: int | None,
                    settings: dict | None = None) -> Path:
    """`accelerator.save_state` into `.tmp-checkpoint-<step>`, plus the tokenizer, the loop state and the run's
    `settings` (`checkpoints.RUN_SETTINGS`, read when it is resumed), then rename it `checkpoint-<step>` (so a folder of
    that name is always complete) and delete all but the `keep` newest. Every process must call it (each writes its
    RNG state); output_dir must be on a filesystem all nodes share."""
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
        if settings is not None:
            write_json_atomic(tmp / RUN_SETTINGS, settings)
        follow_umask(tmp)
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
        CheckError: a bad flag or input, a --resume_from_checkpoint that names no complete checkpoint, or an
            accelerate setup this loop does not do (FSDP, DeepSpeed).
        RuntimeError: launched processes that did not join one job (see `training.run.check_distributed`).
    """
    start_process()
    model_args, data_args, recipe, loop = build_parser().parse_args_into_dataclasses(args=argv)
    check_loop_arguments(loop)
    preset = resolve_preset(model_args)
    job = new_run(model_args, data_args, recipe, preset=preset, output_dir=loop.output_dir,
                  max_steps=loop.max_steps or preset["max_steps"],
                  warmup_steps=loop.warmup_steps or preset["warmup_steps"], max_steps_given=loop.max_steps is not None,
                  device_type="cpu" if loop.cpu or not _has_accelerator_device() else "cuda",
                  resume_value=loop.resume_from_checkpoint)
    push = HubPush(loop.hub_model_id, loop.hub_token, loop.hub_private_repo, recipe.hub_endpoint) \
        if loop.push_to_hub else None
    check_inputs(job, save_total_limit=loop.save_total_limit, save_total_limit_given=False, saving=True,
                 save_steps=loop.checkpointing_steps or (None if recipe.save_every_minutes else job.plan.max_steps),
                 layout="accelerate", push=push)
    with claim_output_dir(job, main_process=int(os.environ.get("RANK", "0")) == 0):
        return _run(job, loop, push=push)


def _accelerator(job: Run, loop: LoopArguments):
    """The `Accelerator` of the loop, in the precision of --mixed_precision, else of `accelerate launch`, else (a
    plain run on the CPU) of --cpu_bf16 (`cpu_precision`, as train.py); records the precision in `job.plan`."""
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin

    mixed_precision, reason = loop.mixed_precision, f"--mixed_precision {loop.mixed_precision}"
    if mixed_precision is None:
        reason = f"ACCELERATE_MIXED_PRECISION={os.environ.get('ACCELERATE_MIXED_PRECISION')}"
        if "ACCELERATE_MIXED_PRECISION" not in os.environ:
            reason = "no --mixed_precision given"
            if loop.cpu or not _has_accelerator_device():
                bf16, reason = cpu_precision(job.recipe, job.model_args, job.preset)  # measured where bf16 is native
                mixed_precision = "bf16" if bf16 else None
    accelerator = Accelerator(
        mixed_precision=mixed_precision,
        cpu=loop.cpu,
        # Updates are formed below from exactly `accumulation` batches, across epoch ends, so that accelerate's
        # count of micro-steps (when to all-reduce, when the optimizer steps) never drifts from ours.
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=loop.gradient_accumulation_steps,
                                                                sync_with_dataloader=False),
        # One schedule step per update: accelerate would otherwise step it once per process.
        step_scheduler_with_optimizer=False,
    )
    job.plan.precision = {"bf16": "bf16 autocast", "fp16": "fp16 autocast"}.get(accelerator.mixed_precision, "fp32")
    job.plan.precision_reason = reason
    logger.info("Precision: %s (%s).", job.plan.precision, reason)
    return accelerator


def _run(job: Run, loop: LoopArguments, *, push: HubPush | None):
    from accelerate import DistributedType

    plan, output_dir, accumulation = job.plan, job.output_dir, loop.gradient_accumulation_steps
    accelerator = _accelerator(job, loop)
    check_distributed(accelerator.num_processes)
    if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED,
                                        DistributedType.MEGATRON_LM):
        raise CheckError(f"train_no_trainer.py runs data parallel only, not {accelerator.distributed_type}; use "
                         f"train.py (e.g. with training/accelerate_configs/fsdp_big.yaml).")
    set_seed(loop.seed)

    raw, tokenizer, tokenized, model = prepare(job, main_process_first=accelerator.main_process_first())
    check_positions(model.config, job.data_args)
    sampler = token_budget_sampler(tokenized["train"], plan.max_tokens, shuffle=True, seed=loop.seed,
                                    num_processes=accelerator.num_processes)
    # Its own generator, so that starting an epoch draws nothing from the global RNG (dropout): resuming is exact.
    # the rows DataCollatorForSeq2Seq would pad, padded from Arrow with numpy: the same tensors, 7x faster
    batches = PaddedBatches(tokenized["train"], tokenizer.pad_token_id)
    loader = DataLoader(batches, batch_sampler=sampler, collate_fn=batches.collate,
                        num_workers=loop.dataloader_num_workers, generator=torch.Generator())
    optimizer, scheduler = paper_optimizer_and_schedule(model.parameters(), model.config.d_model, plan.warmup_steps,
                                                        plan.lr_factor)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

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
    # "last"/"latest" or a run folder: its newest complete checkpoint of this loop, as `check_inputs` found.
    checkpoint = plan.resume_from
    if checkpoint is not None:
        accelerator.load_state(checkpoint)
        saved_state = read_json(Path(checkpoint) / STATE_NAME)
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
    max_steps = plan.max_steps
    # No planner here: with a time budget, training stops by the clock, early enough for the test translation.
    deadline = training_deadline(job, test_sentences=count_test_sentences(job, raw))
    keep = max(loop.save_total_limit, job.recipe.average_last or 0) if loop.save_total_limit else None
    target_tokens = torch.zeros((), dtype=torch.long, device=accelerator.device)
    start = time.perf_counter()
    saved_at = time.monotonic()  # --save_every_minutes counts from the last checkpoint
    model.train()
    # the label-smoothed loss of §5.4 and, on a CPU, the fast paths of a training step (fast_paths_vaswani.py)
    with training_fast_paths(accelerator.unwrap_model(model), loop.label_smoothing_factor):
        while completed < max_steps:
            micro_batches = [next(batches) for _ in range(accumulation)]
            # Target tokens in the whole update: every micro-batch on every process.
            num_items = accelerator.reduce(sum(b["labels"].ne(-100).sum() for b in micro_batches), reduction="sum")
            learning_rate = optimizer.param_groups[0]["lr"]
            update_loss = torch.zeros((), device=accelerator.device)
            for batch in micro_batches:
                with accelerator.accumulate(model):
                    # label-smoothed (training_fast_paths): the sum over this batch / num_items
                    loss = model(**batch, num_items_in_batch=num_items).loss
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
            due = False
            if job.recipe.save_every_minutes:  # every process saves at the same update (the clocks differ a little)
                late = torch.tensor(float(time.monotonic() - saved_at >= job.recipe.save_every_minutes * 60),
                                    device=accelerator.device)
                due = accelerator.reduce(late, reduction="sum").item() > 0
            if stop or due or completed == max_steps or (loop.checkpointing_steps
                                                         and completed % loop.checkpointing_steps == 0):
                save_checkpoint(accelerator, output_dir, completed,
                                {"global_step": completed, "max_steps": max_steps, "log_history": log_history},
                                tokenizer, keep=keep, settings=run_settings(job))
                saved_at = time.monotonic()
            if stop:
                break
    batches.close()
    train_seconds = time.perf_counter() - start

    unwrapped = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    metrics = {"train_loss": log_history[-1]["loss"] if log_history else math.nan}
    metrics.update(run_metrics(job, unwrapped, steps=completed, epochs=completed * accumulation / batches_per_epoch,
                               train_seconds=train_seconds, device=accelerator.device,
                               distributed_type=accelerator.distributed_type.value,
                               world_size=accelerator.num_processes, mixed_precision=accelerator.mixed_precision,
                               label_smoothing=loop.label_smoothing_factor))
    metrics["train_target_tokens"] = int(target_tokens.item())  # labelled target tokens, all processes
    metrics["gradient_accumulation_steps"] = accumulation
    if accelerator.is_main_process:
        retire_previous_results(job)  # an earlier run's metrics never stand beside these weights
        unwrapped.save_pretrained(output_dir)
        for path in weight_files(output_dir):
            follow_umask(path)
        tokenizer.save_pretrained(output_dir)
        write_json_atomic(output_dir / STATE_NAME,
                          {"global_step": completed, "max_steps": max_steps, "log_history": log_history})
        average_into(job, unwrapped)
        write_given_decoding(job, unwrapped)  # --length_penalty into generation_config.json (nothing is searched here)
        finish(job, unwrapped, tokenizer, raw, metrics, batch_size=loop.per_device_eval_batch_size,
               num_beams=loop.num_beams or unwrapped.generation_config.num_beams, push=push)
    return metrics, unwrapped


def main(argv: list[str] | None = None) -> dict:
    """`run(argv)`, returning the metrics."""
    return run(argv)[0]


def cli() -> int:
    """Console entry `vaswani-train-no-trainer` (`command_cli`: exit status 0 after a run, a bad input as one line)."""
    return command_cli(main)


if __name__ == "__main__":
    sys.exit(cli())
