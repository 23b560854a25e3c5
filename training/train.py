"""Train the Transformer with the paper's recipe on Seq2SeqTrainer, score BLEU, translate samples.

    python training/train.py                       # the default run: Multi30k De->En, CPU preset, < 30 min
    python training/train.py --preset base --bf16  # the paper's base model on a GPU
    accelerate launch training/train.py --preset base --bf16   # the same on N GPUs / nodes

Every Seq2SeqTrainingArguments flag works (--output_dir, --max_steps, --gradient_accumulation_steps, --save_steps,
--resume_from_checkpoint, --push_to_hub, --report_to, ...), plus the flags of `training/lib/arguments.py`; those the
paper's Adam and schedule replace (--learning_rate, --optim, --adam_*, ...) are refused (`check_trainer_flags`).

The recipe (§5.3-5.4): Adam(0.9, 0.98, 1e-9); lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5);
label smoothing 0.1 (--label_smoothing_factor, exact under gradient accumulation); dropout 0.1; token-budget batches.
Validation BLEU during training through `predict_with_generate` (beam 4, length penalty 0.6); at the end the test
set is translated and scored (sacreBLEU and lowercased tokenized BLEU) and `<output_dir>/metrics.json` is written.

SIGINT or SIGTERM stops training after the current step (or at once during validation, which is cut short) with a
checkpoint. After SIGINT the run ends as usual (averaging, test BLEU, metrics.json); after SIGTERM, which schedulers
follow with SIGKILL, it saves the model and metrics.json without the test translation and exits.
"""

from __future__ import annotations

import logging
import signal
import sys
import time

if __package__ in (None, ""):  # run as a file (python training/train.py): import as vaswani_training
    __package__ = "vaswani_training"

from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from transformers import (
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    StoppingCriteria,
    StoppingCriteriaList,
    TrainerCallback,
    set_seed,
)
from transformers.trainer_utils import TrainOutput

from vaswani_hf.checks import CheckError, follow_umask, weight_files
from vaswani_hf.data import PaddedBatches, StreamingTokenBudgetBatches, example_lengths
from vaswani_hf.fast_paths_vaswani import training_fast_paths
from vaswani_hf.schedule import get_inverse_sqrt_schedule, paper_adam

from .lib.arguments import DataArguments, ModelArguments, RecipeArguments
from .lib.checkpoints import PLAN_FILE, average_into, training_ended_at, write_run_settings
from .lib.choose import (
    COOLDOWN_CHECKPOINTS,
    SEARCH_COST_FACTOR,
    averaging_searched,
    choose_on_validation,
    search_passes,
    write_given_decoding,
)
from .lib.dropout import LongRunDropout, long_run_dropout
from .lib.output_dir import claim_output_dir, finished_metrics, retire_previous_results, write_json_atomic
from .lib.planner import BudgetPlanner
from .lib.precision import cpu_precision
from .lib.prepare import select, token_budget_sampler, training_stream
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
    given_flags,
    new_run,
    prepare,
    run_metrics,
    seconds_per_test_sentence,
    start_process,
    strip_hub_token,
)

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
    "label_smoothing_factor": 0.1,  # §5.4
}


# Trainer flags the paper's optimizer and schedule (§5.3) replace: given, they would do nothing, so they are refused.
REPLACED_TRAINER_FLAGS = {
    "learning_rate": "the rate is the schedule of §5.3, lr = lr_factor * d_model^-0.5 * min(step^-0.5, "
                     "step * warmup^-1.5): scale it with --lr_factor",
    "lr_scheduler_type": "the schedule is the paper's inverse square root (§5.3); --lr_factor and --warmup_steps "
                         "set it",
    "lr_scheduler_kwargs": "the schedule is the paper's inverse square root (§5.3); --lr_factor and --warmup_steps "
                           "set it",
    "optim": "the optimizer is the paper's Adam (§5.3)",
    "optim_args": "the optimizer is the paper's Adam (§5.3)",
    "adam_beta1": "the paper's Adam uses betas (0.9, 0.98) (§5.3)",
    "adam_beta2": "the paper's Adam uses betas (0.9, 0.98) (§5.3)",
    "adam_epsilon": "the paper's Adam uses epsilon 1e-9 (§5.3)",
    "weight_decay": "the paper's Adam has no weight decay (§5.3)",
}


def check_trainer_flags(training_args: Seq2SeqTrainingArguments, given: set[str]) -> None:
    """Before any work: Trainer flags that the paper's recipe replaces (`REPLACED_TRAINER_FLAGS`) are refused rather
    than ignored; `--max_steps` given is a whole number >= 1; `--label_smoothing_factor` lies in [0, 1) (§5.4).

    Raises:
        CheckError: naming the flag, why and what to use.
    """
    replaced = sorted(given & set(REPLACED_TRAINER_FLAGS))
    if replaced:
        name = replaced[0]
        raise CheckError(f"--{name} would do nothing here: {REPLACED_TRAINER_FLAGS[name]}. Leave --{name} out.")
    if "max_steps" in given and training_args.max_steps < 1:
        raise CheckError(f"--max_steps must be >= 1, got {training_args.max_steps}; leave it out for the preset's "
                         f"(or the time budget's).")
    smoothing = training_args.label_smoothing_factor
    if not 0.0 <= smoothing < 1.0:
        raise CheckError(f"--label_smoothing_factor must be in [0, 1) (the paper's 0.1, §5.4), got {smoothing}.")


class ValidationInterrupted(Exception):
    """A stop signal arrived during validation inside training (raised between and inside validation batches)."""


class StopWhen(StoppingCriteria):
    """Ends a `generate()` call at its next token once `requested()` is true (a validation batch cut short)."""

    def __init__(self, requested: Callable[[], bool]):
        self.requested = requested

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.requested(), dtype=torch.bool, device=input_ids.device)

    def for_sentences(self, sentences: torch.LongTensor) -> StopWhen:
        """The same criterion for any sentences of the batch (it stops all or none): what lets generate()'s lean
        searches run it."""
        return self


class PaperTrainer(Seq2SeqTrainer):
    """Seq2SeqTrainer with the paper's optimizer and schedule (§5.3), token-budget training batches (§5.1), and its
    training steps run with `training_fast_paths` (vaswani_hf/fast_paths_vaswani.py): the label-smoothed loss of §5.4
    (`--label_smoothing_factor`, in training steps only, so that `eval_loss` and its perplexity are unsmoothed; exact
    under gradient accumulation) and, on a CPU, the fast paths of a training step.

    `stop_requested`: a callable that turns true when training should stop (a signal, `TimeLimit.stop_requested`);
    validation inside training then ends within one decoding step instead of running to the end of the validation
    set, and the step's checkpoint is saved.
    """

    def __init__(self, *args, max_tokens: int, d_model: int, warmup: int, lr_factor: float,
                 stop_requested: Callable[[], bool] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_tokens, self.d_model, self.warmup, self.lr_factor = max_tokens, d_model, warmup, lr_factor
        self.stop_requested = stop_requested
        self.label_smoother = None  # the model's training forward smooths (training_fast_paths), not Trainer

    def train(self, *args, **kwargs):
        with training_fast_paths(self.model, self.args.label_smoothing_factor):
            return super().train(*args, **kwargs)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval", **gen_kwargs):
        """Seq2SeqTrainer's evaluation; with `stop_requested`, cut short when it turns true: no metrics, and the
        training step's checkpoint is saved before training stops."""
        if self.stop_requested is None:
            return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix,
                                    **gen_kwargs)
        criteria = StoppingCriteriaList([*(gen_kwargs.pop("stopping_criteria", None) or []),
                                         StopWhen(self.stop_requested)])
        try:
            if self.stop_requested():
                raise ValidationInterrupted
            return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix,
                                    stopping_criteria=criteria, **gen_kwargs)
        except ValidationInterrupted:
            logger.warning("Validation cut short by the stop signal: saving a checkpoint of step %d and stopping.",
                           self.state.global_step)
            self.control.should_evaluate = False  # on_evaluate, which would reset it, is not reached
            self.control.should_save = True
            self.control.should_training_stop = True
            return {}

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        if self.stop_requested is not None and self.stop_requested():
            raise ValidationInterrupted
        output = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)
        if self.stop_requested is not None and self.stop_requested():  # its translations were cut short
            raise ValidationInterrupted
        return output

    def _get_grad_norm(self, model, grad_norm=None):
        # Trainer takes the gradient norm at every step only to log it: a pass over every gradient and a host sync
        # (1-2 % of a cpu-preset step); taken at the steps that log, as DefaultFlowCallback decides them.
        step, strategy = self.state.global_step + 1, self.args.logging_strategy
        logs = strategy == "steps" and (step % max(int(self.state.logging_steps or 1), 1) == 0
                                        or (step == 1 and self.args.logging_first_step))
        if grad_norm is None and not logs:
            return None
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def resume_without_training(self, checkpoint: str) -> None:
        """The model and the state of `checkpoint` (the step at which the run's training ended), without a step: what
        `train(resume_from_checkpoint=...)` would load before it trains on."""
        from transformers.trainer_callback import TrainerState

        self._load_from_checkpoint(checkpoint)
        self.state = TrainerState.load_from_json(str(Path(checkpoint) / "trainer_state.json"))

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
        # Pinned memory speeds up copies to an accelerator only; on a CPU torch warns that it is unused.
        pin_memory = self.args.dataloader_pin_memory and self.args.device.type != "cpu"
        if isinstance(self.train_dataset, StreamingTokenBudgetBatches):
            # batches already cut and dealt to this process by the stream itself: not sharded again by accelerate
            return DataLoader(self.train_dataset, batch_size=None, collate_fn=self.data_collator,
                              num_workers=self.args.dataloader_num_workers, pin_memory=pin_memory)
        sampler = token_budget_sampler(self.train_dataset, self.max_tokens, shuffle=True, seed=self.args.seed,
                                       num_processes=self.accelerator.num_processes)
        # the rows the collator would pad, padded from Arrow with numpy: the same tensors, 7x faster
        batches = PaddedBatches(self.train_dataset, self.model.config.pad_token_id)
        loader = DataLoader(batches, batch_sampler=sampler, collate_fn=batches.collate,
                            num_workers=self.args.dataloader_num_workers, pin_memory=pin_memory)
        return self.accelerator.prepare(loader)


def any_process(flag: bool, args) -> bool:
    """True when `flag` is true in any process of the run (an all-reduce MAX on `args.device` where there are several;
    a collective: every process must call it at the same point)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1):
        return flag
    value = torch.tensor(float(flag), device=args.device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


class TimeLimit(TrainerCallback):
    """Stops training (after a checkpoint) once `minutes` have passed, and on SIGINT/SIGTERM; always saves the last
    step. With several processes all stop at the same step (`any_process`), whichever got the signal or reached the
    deadline first."""

    def __init__(self, minutes: float | None):
        self.deadline = time.monotonic() + minutes * 60 if minutes else None
        self.interrupted = False
        self.signal: int | None = None  # the signal that stopped training
        self.training = False

    def stop_requested(self) -> bool:
        """True once a signal has asked training to stop, while training runs (validation is then cut short)."""
        return self.training and self.interrupted

    def on_train_begin(self, args, state, control, **kwargs):
        def stop(signum, frame):
            if self.interrupted:  # the second signal: stop at once, without a checkpoint
                raise KeyboardInterrupt(f"signal {signum} received twice")
            logger.warning("Signal %d received: saving a checkpoint and stopping after this step (send it again to "
                           "stop at once, without saving).", signum)
            self.interrupted = True
            self.signal = signum

        signals = [signal.SIGINT] + ([signal.SIGTERM] if hasattr(signal, "SIGTERM") else [])
        self._previous_handlers = {signum: signal.signal(signum, stop) for signum in signals}
        self.training = True

    def on_train_end(self, args, state, control, **kwargs):
        # The final evaluation after training is interrupted by Ctrl-C as usual again.
        self.training = False
        for signum, handler in getattr(self, "_previous_handlers", {}).items():
            signal.signal(signum, handler)

    def on_step_end(self, args, state, control, **kwargs):
        if state.max_steps and state.global_step >= state.max_steps:
            control.should_save = True  # the last step is always a checkpoint (for averaging and resuming)
        # all processes stop at the same step, whichever got the signal or saw the clock first: one alone would hang
        if any_process(self.interrupted or bool(self.deadline and time.monotonic() > self.deadline), args):
            if not self.interrupted:
                logger.info("Time limit reached at step %d: saving and stopping.", state.global_step)
            control.should_save = True
            control.should_training_stop = True
        return control


class SaveEvery(TrainerCallback):
    """A checkpoint every `minutes` of training (--save_every_minutes; §6.1: the paper's were written at 10-minute
    intervals), besides those of --save_steps; the interval restarts at every save. `clock`: seconds, monotonic.

    Each process reads its own clock; with several, the step is agreed each step (`any_process`), so that all save
    together (a save gathers FSDP shards: one process alone would hang)."""

    def __init__(self, minutes: float, clock: Callable[[], float] = time.monotonic):
        self.seconds, self.clock = minutes * 60, clock
        self.last = clock()

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = self.clock()

    def on_save(self, args, state, control, **kwargs):
        self.last = self.clock()

    def on_step_end(self, args, state, control, **kwargs):
        if any_process(self.clock() - self.last >= self.seconds, args):
            control.should_save = True
        return control


class CheckpointSettings(TrainerCallback):
    """Writes the run's settings into each checkpoint (`checkpoints.RUN_SETTINGS`, read when the run is resumed) and,
    with a planner, its plan there (`checkpoints.PLAN_FILE`: whether training ended at that step), and gives its weights
    the modes of the user's umask."""

    def __init__(self, run: Run, planner: BudgetPlanner | None = None):
        self.run, self.planner = run, planner

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and folder.is_dir():
            write_run_settings(self.run, folder)
            if self.planner is not None:
                write_json_atomic(folder / PLAN_FILE, self.planner.checkpoint_record(state.global_step))
            for path in weight_files(folder):
                follow_umask(path)


def precision_choice(training_args: Seq2SeqTrainingArguments, run: Run) -> tuple[str, str]:
    """What a run computes in and why: ("bf16 autocast" | "fp16 autocast" | "fp32", the reason in words).

    --bf16 / --fp16 as given; on a GPU fp32 without them; on the CPU per --cpu_bf16
    (`training.precision.cpu_precision`: under auto, bf16 autocast where the CPU has native bf16 and a training step
    measured in both precisions is at least 1.15x faster in it). Sets `training_args.bf16` when it picks bf16 autocast
    on the CPU, and logs the choice.
    """
    precision, reason = "fp32", "no --bf16/--fp16 given"
    if training_args.bf16:
        precision, reason = "bf16 autocast", "--bf16 given"
    elif training_args.fp16:
        precision, reason = "fp16 autocast", "--fp16 given"
    elif training_args.device.type == "cpu":
        bf16, reason = cpu_precision(run.recipe, run.model_args, run.preset)
        if bf16:
            precision = "bf16 autocast"
            training_args.bf16 = True  # autocast on the CPU
            training_args.mixed_precision = "bf16"  # what Trainer hands to accelerate
    logger.info("Precision: %s (%s).", precision, reason)
    return precision, reason


def build_parser() -> HfArgumentParser:
    parser = HfArgumentParser((ModelArguments, DataArguments, RecipeArguments, Seq2SeqTrainingArguments))
    parser.set_defaults(**TRAINER_DEFAULTS)
    parser.allow_abbrev = False  # "--max_st 3" would set max_steps without counting as given (the preset would win)
    return parser


def main(argv: list[str] | None = None) -> dict:
    start_process()
    parser = build_parser()
    try:
        model_args, data_args, recipe, training_args = parser.parse_args_into_dataclasses(args=argv)
    except CheckError:
        raise
    except ValueError as error:  # TrainingArguments' own checks of its flags (e.g. --warmup_steps -3)
        raise CheckError(f"the command line: {error}") from None
    preset = resolve_preset(model_args)
    given = given_flags(parser, argv)  # --max-steps and --max_steps alike
    check_trainer_flags(training_args, given)
    if "max_steps" not in given and "num_train_epochs" not in given:
        training_args.max_steps = preset["max_steps"]
    if "warmup_steps" not in given:
        training_args.warmup_steps = preset["warmup_steps"]
    # transformers parses --warmup_steps as a float (< 1: a fraction of max_steps); the schedule takes whole steps.
    warmup = training_args.get_warmup_steps(training_args.max_steps) if training_args.max_steps > 0 else int(
        training_args.warmup_steps)
    if warmup < 1:
        raise CheckError(f"--warmup_steps {training_args.warmup_steps} gives {warmup} warmup steps; Eq. 3 of the paper "
                         f"needs at least 1 (the paper uses 4000, the cpu preset 400).")
    for key, value in preset.get("trainer", {}).items():  # the preset's Trainer settings, unless given
        if key not in given:
            setattr(training_args, key, value)
    run = new_run(model_args, data_args, recipe, preset=preset, output_dir=training_args.output_dir,
                  max_steps=training_args.max_steps, warmup_steps=warmup, max_steps_given="max_steps" in given,
                  device_type=training_args.device.type, resume_value=training_args.resume_from_checkpoint)
    if training_args.device.type == "cpu":  # pinned memory speeds copies to a GPU only; on a CPU torch warns
        training_args.dataloader_pin_memory = False
    check_distributed(training_args.world_size)
    # --push_to_hub: the Trainer's own pushes (a commit per checkpoint, its own model card) are off; at the end the
    # run is exported as a Hub-ready folder (training/export.py: remote code, model card with the test BLEU) and that
    # folder is uploaded. The token is kept out of the arguments Trainer pickles into training_args.bin.
    hub_token = strip_hub_token(training_args)
    push = HubPush(training_args.hub_model_id, hub_token, training_args.hub_private_repo, recipe.hub_endpoint) \
        if training_args.push_to_hub else None
    training_args.push_to_hub = False
    step_saving = getattr(training_args.save_strategy, "value", training_args.save_strategy) != "no"
    training_args.save_total_limit = check_inputs(
        run, save_total_limit=training_args.save_total_limit, save_total_limit_given="save_total_limit" in given,
        saving=step_saving or bool(recipe.save_every_minutes),
        save_steps=training_args.save_steps if step_saving else None, push=push)
    with claim_output_dir(run, main_process=training_args.process_index == 0):
        # Chosen once the run is accepted: on a CPU with native bf16 it times both precisions (about 2 s).
        run.plan.precision, run.plan.precision_reason = precision_choice(training_args, run)
        return _train(run, training_args, push=push, max_eval_samples_given="max_eval_samples" in given)


def _train(run: Run, training_args: Seq2SeqTrainingArguments, *, push: HubPush | None,
           max_eval_samples_given: bool = False) -> dict:
    set_seed(training_args.seed)
    data_args, plan = run.data_args, run.plan
    # the choice on validation reads the whole split, or --max_eval_samples pairs where the command line gives it
    search_limit = data_args.max_eval_samples if max_eval_samples_given else None
    raw, tokenizer, tokenized, model = prepare(
        run, main_process_first=training_args.main_process_first(desc="data and tokenizer"))

    eval_dataset = select(tokenized["validation"], data_args.max_eval_samples) if "validation" in tokenized else None
    if eval_dataset is None:
        training_args.eval_strategy = "no"
    training_args.generation_num_beams = training_args.generation_num_beams or model.generation_config.num_beams
    # Validation translations during training stop at 128 tokens (far above Multi30k's longest sentences), so that
    # an early model that has not learnt to stop costs little; the final test uses input length + 50 (§6.1).
    training_args.generation_max_length = training_args.generation_max_length or 128
    validating = training_args.eval_strategy != "no"
    check_positions(model.config, data_args,
                    generation_max_length=training_args.generation_max_length if validating else None)

    compute_metrics = validation_bleu(tokenizer, data_args.target_lang)

    time_limit = TimeLimit(plan.max_train_minutes)
    settings = CheckpointSettings(run)
    callbacks: list[TrainerCallback] = [time_limit, settings]
    # --streaming: one endless iteration, pass after pass each in its own batch order (`repeat`), so that a resumed
    # run, which skips as many batches as it has trained, continues exactly where the uninterrupted run would be
    train_dataset = tokenized["train"] if not data_args.streaming else StreamingTokenBudgetBatches(
        training_stream(data_args), tokenizer, max_tokens=plan.max_tokens,
        max_source_length=data_args.max_source_length, max_target_length=data_args.max_target_length,
        seed=training_args.seed, num_replicas=training_args.world_size, rank=training_args.process_index,
        repeat=True)
    if data_args.streaming:
        train_dataset.check_first_batch()  # a stream that yields no batch would train 0 steps and save the random init
    if run.recipe.save_every_minutes:
        callbacks.append(SaveEvery(run.recipe.save_every_minutes))
    planner = dropout_choice = None
    if plan.budget_minutes:
        passes = search_passes(run, "validation" in raw)
        search_sentences = len(select(raw["validation"], search_limit)) if passes else 0
        planner = BudgetPlanner(
            plan.budget_minutes, training_args.max_steps, cooldown_fraction=run.preset.get("cooldown_fraction", 0.0),
            test_sentences=count_test_sentences(run, raw),
            eval_sentences=len(eval_dataset) if eval_dataset is not None else 0,
            precision=plan.precision, precision_reason=plan.precision_reason,
            seconds_per_test_sentence=seconds_per_test_sentence(run),
            search_sentences=passes * search_sentences * SEARCH_COST_FACTOR,
            cooldown_checkpoints=COOLDOWN_CHECKPOINTS if averaging_searched(run) and passes else 0)
        callbacks.append(planner)
        settings.planner = planner
        long_run = long_run_dropout(run.preset, run.model_args.config_overrides, run.model_args.model_name_or_path)
        if long_run is not None:
            dropout_choice = LongRunDropout(planner, long_run["min_steps"], long_run["probabilities"],
                                            at_step=long_run["at_step"], resume_from=plan.resume_from)
            callbacks.append(dropout_choice)
    trainer = PaperTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100),
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
        callbacks=callbacks,
        max_tokens=plan.max_tokens,
        d_model=model.config.d_model,
        warmup=plan.warmup_steps,
        lr_factor=plan.lr_factor,
        stop_requested=time_limit.stop_requested,
    )

    # The newest *complete* checkpoint with finite weights of "last"/"true" or a run folder, as `check_inputs` found.
    ended = training_ended_at(plan.resume_from, training_args.max_steps) if plan.resume_from else None
    if ended is not None:  # nothing left to train: Trainer would train a step past the end, and a budget start over
        done = finished_metrics(run, ended["step"])
        if done is not None:
            print(f"The run in {run.output_dir} had finished: its training ended at step {ended['step']}, and its "
                  f"metrics.json scores the model it left. Nothing to do.")
            return done
        print(f"The run's training ended at step {ended['step']} ({plan.resume_from}); it resumes after training: the "
              f"choice on validation and the test set.")
        start = time.perf_counter()
        trainer.resume_without_training(plan.resume_from)
        train_result = TrainOutput(trainer.state.global_step, float("nan"), {})
    else:
        start = time.perf_counter()
        train_result = trainer.train(resume_from_checkpoint=plan.resume_from)
    train_seconds = time.perf_counter() - start
    stopped_by = "SIGTERM" if time_limit.signal == getattr(signal, "SIGTERM", None) else None
    main_process = trainer.is_world_process_zero()
    choice = None  # what the main process chooses on validation
    if main_process:  # an earlier run's metrics never stand beside this run's weights
        retire_previous_results(run)
    trainer.save_model()  # every process calls it; the main one writes
    if main_process:  # one writer: the processes may share the filesystem
        tokenizer.save_pretrained(run.output_dir)
        if stopped_by:  # averaging reads every checkpoint; a SIGTERM asks for a quick end
            run.recipe.average_last = 0
        average_into(run, trainer.model)
        if not stopped_by and not run.recipe.skip_test:  # the checkpoints to average and the decoding (§6.1)
            choice = choose_on_validation(
                run, trainer.model, tokenizer,
                select(raw["validation"], search_limit) if "validation" in raw else None,
                cooldown_from=ended["cooldown_from"] if ended else planner.cooldown_from if planner else None,
                checkpoint_every=ended["cooldown_checkpoint_every"] if ended else
                planner.cooldown_checkpoint_every if planner else None,
                final_step=trainer.state.global_step, num_beams=training_args.generation_num_beams,
                batch_size=training_args.per_device_eval_batch_size)
        if choice is None:
            write_given_decoding(run, trainer.model)
        for path in weight_files(run.output_dir):
            follow_umask(path)

    state = trainer.state
    metrics = dict(train_result.metrics)
    metrics.update(run_metrics(run, trainer.model, steps=state.global_step, epochs=state.epoch or 0.0,
                               train_seconds=train_seconds, device=trainer.args.device,
                               distributed_type=trainer.accelerator.distributed_type.value,
                               world_size=training_args.world_size, mixed_precision=training_args.mixed_precision,
                               label_smoothing=training_args.label_smoothing_factor))
    if data_args.streaming:  # one endless iteration: Trainer's epoch is a fraction of --max_steps, not of passes
        metrics["train_epochs"] = None
    else:  # a stream's length is not known: no tokens a second for it
        # Source + target tokens without padding: epochs (fractional) x tokens in one pass over the data.
        src_lengths, tgt_lengths = example_lengths(tokenized["train"])
        tokens_per_epoch = int(src_lengths.sum() + tgt_lengths.sum())
        if ended is None:  # a run resumed at its end trained nothing now
            metrics["train_tokens_per_second"] = round((state.epoch or 0.0) * tokens_per_epoch / train_seconds, 1)
    if planner is not None and planner.plans:
        metrics["plan"] = planner.plans[-1]
    if ended is not None:
        metrics["resumed_after_training"] = {"checkpoint": plan.resume_from, "step": ended["step"]}
    if dropout_choice is not None:  # what the preset's long_run_dropout offered and whether the plan took it
        metrics["long_run_dropout"] = {"min_steps": dropout_choice.min_steps, "at_step": dropout_choice.at_step,
                                       **dropout_choice.probabilities,
                                       "applied": bool(dropout_choice.applied)}
    if main_process and choice is not None:
        metrics["chosen_on_validation"] = choice
        metrics["averaged_checkpoints"] = choice["chosen"]["average_last"] if choice["averaged_from"] else \
            metrics["averaged_checkpoints"]
    if main_process:  # test set: beam 4, length penalty 0.6 (§6.1), BLEU two ways; metrics.json; the upload
        finish(run, trainer.model, tokenizer, raw, metrics, batch_size=training_args.per_device_eval_batch_size,
               num_beams=training_args.generation_num_beams, push=push, stopped_by=stopped_by)
    return metrics


def validation_bleu(tokenizer, target_lang: str):
    """`compute_metrics` for the validation runs during training: sacreBLEU (detokenized, cased) of the decoded
    predictions against the decoded labels, split into words as the test set's score splits them (`13a`; sacreBLEU's
    `zh` or `ja-mecab` for a target written without spaces, `vaswani_hf.bleu.bleu_tokenizer`).

    Args:
        tokenizer: the run's tokenizer (ids outside its vocabulary and -100 labels are dropped before decoding).
        target_lang: the target language code (`--target_lang`).
    Returns:
        a function of an `EvalPrediction` that returns `{"bleu": score}` (0-100, 2 decimals).
    Raises:
        ValueError: a target language whose BLEU is undefined here (`bleu_tokenizer`).
    """
    from vaswani_hf.bleu import bleu_tokenizer, load_bleu_metric

    bleu, split = load_bleu_metric(), bleu_tokenizer(target_lang) or "13a"

    def compute_metrics(prediction):
        preds = [[t for t in row if 0 <= t < len(tokenizer)] for row in prediction.predictions]
        labels = [[t for t in row if t != -100] for row in prediction.label_ids]
        hyps = [s.strip() for s in tokenizer.batch_decode(preds, skip_special_tokens=True)]
        refs = [[s.strip()] for s in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        return {"bleu": round(bleu.compute(predictions=hyps, references=refs, tokenize=split)["score"], 2)}

    return compute_metrics


def cli() -> int:
    """Console entry `vaswani-train` (`command_cli`: exit status 0 after a run, a bad input as one line)."""
    return command_cli(main)


if __name__ == "__main__":
    sys.exit(cli())
