"""Train the Transformer with the paper's recipe on Seq2SeqTrainer, score BLEU, translate samples.

    python training/train.py                       # the default run: Multi30k De->En, CPU preset, < 30 min
    python training/train.py --preset base --bf16  # the paper's base model on a GPU
    accelerate launch training/train.py --preset base --bf16   # the same on N GPUs / nodes

Every Seq2SeqTrainingArguments flag works (--output_dir, --max_steps, --gradient_accumulation_steps, --save_steps,
--resume_from_checkpoint, --push_to_hub, --report_to, ...), plus the flags of `training/common.py`.

The recipe (§5.3-5.4): Adam(0.9, 0.98, 1e-9); lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5);
label smoothing 0.1 (in the model's loss, exact under gradient accumulation); dropout 0.1; token-budget batches.
Validation BLEU during training through `predict_with_generate` (beam 4, length penalty 0.6); at the end the test
set is translated and scored (sacreBLEU and lowercased tokenized BLEU) and `<output_dir>/metrics.json` is written.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `training` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.utils.data import DataLoader
from transformers import (
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    TrainerCallback,
    set_seed,
)

from training.checkpoints import resolve_resume_value
from training.common import (
    DataArguments,
    ModelArguments,
    RecipeArguments,
    bound_onednn_caches,
    build_model,
    check_distributed,
    cpu_has_native_bf16,
    cpu_precision,
    finish_run,
    keep_freed_memory,
    prepare_data,
    resolve_preset,
    select,
    setup_logging,
    token_budget_sampler,
)
from training.guards import (
    average_current_run,
    check_average_last,
    check_model_inputs,
    check_run_output_dir,
    given_flags,
    strip_hub_token,
)
from vaswani_hf import VaswaniForConditionalGeneration
from vaswani_hf.checks import CheckError, RunLock, check_output_dir
from vaswani_hf.data import example_lengths
from vaswani_hf.schedule import get_inverse_sqrt_schedule, paper_adam

logger = logging.getLogger("vaswani_hf.train")

# Defaults of the Trainer flags for this script; anything given on the command line wins.
TRAINER_DEFAULTS = {
    "output_dir": "outputs/multi30k-de-en",
    "per_device_eval_batch_size": 64,
    "predict_with_generate": True,
    "eval_strategy": "steps",
    "eval_steps": 500,
    "save_strategy": "steps",
    "save_steps": 200,
    "save_total_limit": 5,
    "logging_steps": 25,
    "logging_first_step": True,
    "report_to": "none",
    "dataloader_num_workers": 0,
    "seed": 1,
    "weight_decay": 0.0,
    "max_grad_norm": 0.0,
}


class PaperTrainer(Seq2SeqTrainer):
    """Seq2SeqTrainer with the paper's optimizer and schedule (§5.3) and token-budget training batches (§5.1)."""

    def __init__(self, *args, max_tokens: int, d_model: int, warmup: int, lr_factor: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_tokens, self.d_model, self.warmup, self.lr_factor = max_tokens, d_model, warmup, lr_factor

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Seq2SeqTrainer's loss, label-smoothed by `config.label_smoothing` (0.1, §5.4) in training steps only; the
        model's own loss is the plain cross-entropy, so `eval_loss` (and its perplexity) is unsmoothed. With
        `--label_smoothing_factor` Trainer smooths instead, as for any transformers model."""
        if model.training and self.label_smoother is None and "labels" in inputs:
            smoothing = self.accelerator.unwrap_model(model).config.label_smoothing
            if smoothing:
                inputs = {**inputs, "label_smoothing": smoothing}
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            params = [p for p in (model or self.model).parameters() if p.requires_grad]
            # One fused kernel for the whole Adam update where torch has it (CPU and CUDA, plain tensors): 5 % less
            # CPU time a step than the multi-tensor (foreach) Adam on the cpu preset (benchmarks/cpu_levers.py).
            # FSDP and DeepSpeed keep torch's default.
            fused = (self.args.device.type in ("cpu", "cuda") and not self.is_fsdp_enabled
                     and not self.is_deepspeed_enabled)
            self.optimizer = paper_adam(params, lr=1.0, fused=fused or None)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            self.lr_scheduler = get_inverse_sqrt_schedule(optimizer or self.optimizer, self.d_model, self.warmup,
                                                          self.lr_factor)
        return self.lr_scheduler

    def get_train_dataloader(self) -> DataLoader:
        sampler = token_budget_sampler(self.train_dataset, self.max_tokens, shuffle=True, seed=self.args.seed)
        # Pinned memory speeds up copies to an accelerator only; on a CPU torch warns that it is unused.
        pin_memory = self.args.dataloader_pin_memory and self.args.device.type != "cpu"
        loader = DataLoader(self.train_dataset, batch_sampler=sampler, collate_fn=self.data_collator,
                            num_workers=self.args.dataloader_num_workers, pin_memory=pin_memory)
        return self.accelerator.prepare(loader)


class TimeLimit(TrainerCallback):
    """Stops training (after a checkpoint) once `minutes` have passed, and on SIGINT/SIGTERM; always saves the last
    step."""

    def __init__(self, minutes: float | None):
        self.deadline = time.monotonic() + minutes * 60 if minutes else None
        self.interrupted = False

    def on_train_begin(self, args, state, control, **kwargs):
        def stop(signum, frame):
            if self.interrupted:  # the second signal: stop at once, without a checkpoint
                raise KeyboardInterrupt(f"signal {signum} received twice")
            logger.warning("Signal %d received: saving a checkpoint and stopping after this step (send it again to "
                           "stop at once, without saving).", signum)
            self.interrupted = True

        signals = [signal.SIGINT] + ([signal.SIGTERM] if hasattr(signal, "SIGTERM") else [])
        self._previous_handlers = {signum: signal.signal(signum, stop) for signum in signals}

    def on_train_end(self, args, state, control, **kwargs):
        # The final evaluation after training is interrupted by Ctrl-C as usual again.
        for signum, handler in getattr(self, "_previous_handlers", {}).items():
            signal.signal(signum, handler)

    def on_step_end(self, args, state, control, **kwargs):
        if state.max_steps and state.global_step >= state.max_steps:
            control.should_save = True  # the last step is always a checkpoint (for averaging and resuming)
        if self.interrupted or (self.deadline and time.monotonic() > self.deadline):
            if not self.interrupted:
                logger.info("Time limit reached at step %d: saving and stopping.", state.global_step)
            control.should_save = True
            control.should_training_stop = True
        return control


def precision_choice(training_args: Seq2SeqTrainingArguments, recipe, model_args, preset) -> tuple[str, str]:
    """What a run computes in and why: ("bf16 autocast" | "fp16 autocast" | "fp32", the reason in words).

    --bf16 / --fp16 as given; on a GPU fp32 without them; on the CPU per --cpu_bf16
    (`training.common.cpu_precision`: under auto, bf16 autocast where the CPU has native bf16 and a training step
    measured in both precisions is at least 1.15x faster in it). Sets `training_args.bf16` when it picks bf16 autocast
    on the CPU, and logs the choice.
    """
    precision, reason = "fp32", "no --bf16/--fp16 given"
    if training_args.bf16:
        precision, reason = "bf16 autocast", "--bf16 given"
    elif training_args.fp16:
        precision, reason = "fp16 autocast", "--fp16 given"
    elif training_args.device.type == "cpu":
        bf16, reason = cpu_precision(recipe, model_args, preset)
        if bf16:
            precision = "bf16 autocast"
            training_args.bf16 = True  # autocast on the CPU
            training_args.mixed_precision = "bf16"  # what Trainer hands to accelerate
    logger.info("Precision: %s (%s).", precision, reason)
    return precision, reason


def default_budget_minutes(preset: dict, recipe, device_type: str) -> float | None:
    """The preset's time budget for the whole command: `time_budget_minutes_native_bf16` on a CPU with native bf16
    (whichever precision `cpu_precision` then finds faster there) unless --cpu_bf16 no, else `time_budget_minutes`;
    `None` where the preset has none (base, big, tiny)."""
    native = device_type == "cpu" and recipe.cpu_bf16 != "no" and cpu_has_native_bf16()
    return preset.get("time_budget_minutes_native_bf16" if native else "time_budget_minutes")


def build_parser() -> HfArgumentParser:
    parser = HfArgumentParser((ModelArguments, DataArguments, RecipeArguments, Seq2SeqTrainingArguments))
    parser.set_defaults(**TRAINER_DEFAULTS)
    parser.allow_abbrev = False  # "--max_st 3" would set max_steps without counting as given (the preset would win)
    return parser


def main(argv: list[str] | None = None) -> dict:
    setup_logging()
    keep_freed_memory()
    bound_onednn_caches()
    parser = build_parser()
    model_args, data_args, recipe, training_args = parser.parse_args_into_dataclasses(args=argv)
    preset = resolve_preset(model_args)
    given = given_flags(parser, argv)  # --max-steps and --max_steps alike
    if "max_steps" not in given and "num_train_epochs" not in given:
        training_args.max_steps = preset["max_steps"]
    if "warmup_steps" not in given:
        training_args.warmup_steps = preset["warmup_steps"]
    # transformers parses --warmup_steps as a float (< 1: a fraction of max_steps); the schedule takes whole steps.
    warmup = training_args.get_warmup_steps(training_args.max_steps) if training_args.max_steps > 0 else int(
        training_args.warmup_steps)
    if warmup < 1:
        raise ValueError(f"--warmup_steps {training_args.warmup_steps} gives {warmup} warmup steps; Eq. 3 of the paper "
                         f"needs at least 1 (the paper uses 4000, the cpu preset 400).")
    for key, value in preset.get("trainer", {}).items():  # the preset's Trainer settings, unless given
        if key not in given:
            setattr(training_args, key, value)
    if recipe.max_train_minutes is None:
        recipe.max_train_minutes = preset.get("max_train_minutes")
    if data_args.max_eval_samples is None:
        data_args.max_eval_samples = preset.get("max_eval_samples")
    max_tokens = data_args.max_tokens or preset["max_tokens"]
    lr_factor = recipe.lr_factor or preset["lr_factor"]
    budget = recipe.time_budget_minutes
    if budget is None and "max_steps" not in given:
        budget = default_budget_minutes(preset, recipe, training_args.device.type)
    if budget is not None and (isinstance(budget, bool) or not budget > 0):
        raise ValueError(f"--time_budget_minutes must be a positive number of minutes, got {budget}.")
    plan = {"budget": budget, "warmup": warmup}
    check_distributed(training_args.world_size)
    # Everything that can be checked is checked now, before the data, the tokenizer and the training run.
    resuming = bool(resolve_resume_value(training_args.resume_from_checkpoint))
    training_args.save_total_limit = check_average_last(
        recipe.average_last, save_total_limit=training_args.save_total_limit,
        save_total_limit_given="save_total_limit" in given,
        saving=getattr(training_args.save_strategy, "value", training_args.save_strategy) != "no",
        max_steps=training_args.max_steps, save_steps=training_args.save_steps, resuming=resuming)
    check_model_inputs(model_args.model_name_or_path, model_args.tokenizer_name, model_args.config_overrides)
    hub_token = strip_hub_token(training_args)  # Trainer pickles its arguments into training_args.bin
    lock = None
    if training_args.process_index == 0:
        check_output_dir(training_args.output_dir, flag="--output_dir")  # writable, not a file
        lock = RunLock(training_args.output_dir).acquire()  # a second run into this folder is refused
    try:
        if lock is not None:
            try:
                check_run_output_dir(training_args.output_dir, resuming=resuming,
                                     overwrite=recipe.overwrite_output_dir,
                                     inputs={"--model_name_or_path": model_args.model_name_or_path,
                                             "--tokenizer_name": model_args.tokenizer_name})
            except CheckError:
                lock.release(remove=True)  # refused: the folder is left as it was found
                raise
        # Chosen once the run is accepted: on a CPU with native bf16 it times both precisions (about 2 s).
        plan["precision"], plan["precision_reason"] = precision_choice(training_args, recipe, model_args, preset)
        return _train(model_args, data_args, recipe, training_args, preset, max_tokens, lr_factor, hub_token,
                      resuming, plan)
    finally:
        if lock is not None:
            lock.release()


def _train(model_args, data_args, recipe, training_args, preset, max_tokens, lr_factor, hub_token,
           resuming, plan: dict) -> dict:
    run_started = time.time()
    # --push_to_hub: the Trainer's own pushes (a commit per checkpoint, its own model card) are off; at the end the
    # run is exported as a Hub-ready folder (training/export.py: remote code, model card with the test BLEU) and that
    # folder is uploaded.
    push_to_hub, training_args.push_to_hub = training_args.push_to_hub, False
    set_seed(training_args.seed)

    # Data -> joint BPE -> token ids (the main process first: it trains and caches the BPE, the others load it).
    with training_args.main_process_first(desc="data and tokenizer"):
        raw, tokenizer, tokenized = prepare_data(model_args, data_args, preset)

    # Model: the preset (the paper's base/big, or the CPU size), any field overridable.
    model = build_model(model_args, preset, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())

    eval_dataset = select(tokenized["validation"], data_args.max_eval_samples) if "validation" in tokenized else None
    if eval_dataset is None:
        training_args.eval_strategy = "no"
    training_args.generation_num_beams = training_args.generation_num_beams or model.generation_config.num_beams
    # Validation translations during training stop at 128 tokens (far above Multi30k's longest sentences), so that
    # an early model that has not learnt to stop costs little; the final test uses input length + 50 (§6.1).
    training_args.generation_max_length = training_args.generation_max_length or 128

    from vaswani_hf.bleu import load_bleu_metric

    bleu = load_bleu_metric()

    def compute_metrics(prediction):
        preds = prediction.predictions
        labels = prediction.label_ids
        preds = [[t for t in row if 0 <= t < len(tokenizer)] for row in preds]
        labels = [[t for t in row if t != -100] for row in labels]
        hyps = [s.strip() for s in tokenizer.batch_decode(preds, skip_special_tokens=True)]
        refs = [[s.strip()] for s in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        return {"bleu": round(bleu.compute(predictions=hyps, references=refs)["score"], 2)}

    time_limit = TimeLimit(recipe.max_train_minutes)
    callbacks = [time_limit]
    budget = plan["budget"]
    if budget:
        from training.planner import BudgetPlanner

        test_sentences = 0
        if "test" in raw:
            test_sentences = len(raw["test"]) if data_args.max_test_samples is None else min(
                len(raw["test"]), data_args.max_test_samples)
        callbacks.append(BudgetPlanner(
            budget, training_args.max_steps, cooldown_fraction=preset.get("cooldown_fraction", 0.0),
            test_sentences=test_sentences, eval_sentences=len(eval_dataset) if eval_dataset is not None else 0,
            precision=plan["precision"], precision_reason=plan["precision_reason"],
            seconds_per_test_sentence=preset.get("seconds_per_test_sentence", 0.15)))
    trainer = PaperTrainer(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=eval_dataset,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100),
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
        callbacks=callbacks,
        max_tokens=max_tokens,
        d_model=model.config.d_model,
        warmup=plan["warmup"],
        lr_factor=lr_factor,
    )

    start = time.perf_counter()
    from training.checkpoints import resolve_resume_checkpoint

    if model.config.position_embedding_type == "learned":  # they cannot extrapolate: refuse now, not at some batch
        lengths = {"--max_source_length": data_args.max_source_length,
                   "--max_target_length": data_args.max_target_length}
        if training_args.eval_strategy != "no":
            lengths["--generation_max_length"] = training_args.generation_max_length
        too_long = {flag: n for flag, n in lengths.items() if n > model.config.max_position_embeddings}
        if too_long:
            raise ValueError(
                f"The model has learned positions for {model.config.max_position_embeddings} tokens "
                f"(max_position_embeddings), fewer than {', '.join(f'{k} {v}' for k, v in too_long.items())}. Lower "
                f"these flags, raise max_position_embeddings, or use position_embedding_type=sinusoidal.")
    # "last"/"true" or a run folder: its newest *complete* checkpoint (a kill while saving leaves incomplete ones).
    resume = resolve_resume_checkpoint(training_args.resume_from_checkpoint, training_args.output_dir)
    train_result = trainer.train(resume_from_checkpoint=resume)
    train_seconds = time.perf_counter() - start
    output_dir = Path(training_args.output_dir)
    if recipe.average_last and trainer.is_world_process_zero():
        trainer.save_model()  # the final step as a checkpoint-free copy first
        # Only this run's checkpoints (or the resumed run's), never an earlier run's left in the folder.
        average_current_run(output_dir, recipe.average_last, started=run_started, resuming=resuming)
        trainer.model.load_state_dict(
            VaswaniForConditionalGeneration.from_pretrained(output_dir).state_dict(), strict=True)
        logger.info("Averaged the last %d checkpoints into %s", recipe.average_last, output_dir)
    else:
        trainer.save_model()
    if trainer.is_world_process_zero():  # one writer: the processes may share the filesystem
        tokenizer.save_pretrained(output_dir)

    metrics: dict = {k: v for k, v in train_result.metrics.items()}
    state = trainer.state
    src_lengths, tgt_lengths = example_lengths(tokenized["train"])
    tokens_per_epoch = int(src_lengths.sum() + tgt_lengths.sum())
    metrics.update({
        "preset": model_args.preset,
        "parameters": n_params,
        "train_steps": state.global_step,
        "train_epochs": round(state.epoch or 0.0, 2),
        "train_minutes": round(train_seconds / 60, 2),
        # Source + target tokens without padding: epochs (fractional) x tokens in one pass over the data.
        "train_tokens_per_second": round((state.epoch or 0.0) * tokens_per_epoch / train_seconds, 1),
        "max_tokens": max_tokens,
        "device": str(trainer.args.device),
        "device_name": torch.cuda.get_device_name(trainer.args.device) if trainer.args.device.type == "cuda" else None,
        "distributed_type": trainer.accelerator.distributed_type.value,
        "world_size": training_args.world_size,
        "mixed_precision": training_args.mixed_precision,
        "torch_threads": torch.get_num_threads(),
        "averaged_checkpoints": recipe.average_last,
        "precision": plan["precision"],
    })
    planner = next((c for c in callbacks if type(c).__name__ == "BudgetPlanner"), None)
    if planner is not None and planner.plans:
        metrics["plan"] = planner.plans[-1]

    # Test set: beam 4, length penalty 0.6 (§6.1), BLEU two ways; metrics.json.
    if trainer.is_world_process_zero():
        finish_run(trainer.model, tokenizer, raw, data_args, recipe, metrics, output_dir,
                   batch_size=training_args.per_device_eval_batch_size,
                   num_beams=training_args.generation_num_beams)
        from training.common import write_json_atomic
        from training.planner import process_start_monotonic

        metrics["command_minutes"] = round((time.monotonic() - process_start_monotonic()) / 60, 2)
        write_json_atomic(output_dir / "metrics.json", metrics)
        print(f"Whole command: {metrics['command_minutes']} min"
              + (f" (time budget {planner.budget / 60:g} min)" if planner is not None else ""))
    if push_to_hub and trainer.is_world_process_zero():
        from training.export import export_and_push

        export_and_push(output_dir, repo_id=training_args.hub_model_id, token=hub_token,
                        private=training_args.hub_private_repo)
    return metrics


def cli() -> int:
    """Console entry `vaswani-train`: runs `main` and exits 0 (`main` returns the metrics dict, which `sys.exit` would
    print and turn into exit status 1)."""
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
