"""The run scaffold both training loops stand on (train.py on Seq2SeqTrainer, train_no_trainer.py on accelerate): what
a run does before and after its training steps, written once.

A loop calls, in order:

1. `start_process()`: log lines with times; the CPU settings of `training/lib/cpu_tuning.py`.
2. `new_run(...)`: the preset's values for every flag the command line does not give, resolved into a `RunPlan`
   (updates, warmup, batch tokens, lr factor, time budget), held with the flags in a `Run`.
3. `check_inputs(run, ...)`: `--average_last` against the checkpoints the run keeps, the model and tokenizer it starts
   from (`lib/inputs.py`), the checkpoint a resumed run continues (`lib/checkpoints.py`: complete, finite, of a run
   with the same settings: `run_settings`), the Hub endpoint of `--push_to_hub`, and the data (`lib/prepare.py`
   `check_data`: its splits, first records, at least one pair each); before anything is written.
4. `with claim_output_dir(run, main_process=...)` (`training/lib/output_dir.py`): `--output_dir` is writable, locked
   against a second run, and holds no other run.
5. `prepare(run, ...)`: data -> joint BPE -> token ids, and the model; `check_positions`: learned positions cover the
   lengths the run feeds them.
6. its own training steps, writing `run_settings` into each checkpoint (`write_run_settings`, `RUN_SETTINGS` of
   `training/lib/checkpoints.py`).
7. `retire_previous_results(run)` (`training/lib/output_dir.py`) before the final model is written into --output_dir (an
   earlier `metrics.json` and `test_translations.txt` are renamed, never left beside other weights),
   `average_into(run, model)` (`training/lib/checkpoints.py`) once it is saved, then `run_metrics(...)` and
   `finish(...)`: the test set's BLEU, `metrics.json` (with the fingerprint of the weights it scored and the run's
   history: base model, data, steps), and the Hub upload.

`command_cli(main)` is both console entries: exit status 0 after a run, a `CheckError` as one line and status 1.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from vaswani_hf.checks import CheckError, read_json, weights_fingerprint

from .arguments import DataArguments, ModelArguments, RecipeArguments
from .checkpoints import (
    check_average_last,
    check_average_last_resumed,
    check_resume_settings,
    expected_model_fields,
    resolve_resume_checkpoint,
    resolve_resume_value,
    run_settings,
)
from .cpu_tuning import bound_onednn_caches, keep_freed_memory
from .inputs import check_model_inputs
from .output_dir import write_json_atomic, write_lines_atomic
from .planner import process_start_monotonic, seconds_after_training
from .precision import cpu_has_native_bf16
from .prepare import build_model, check_data, data_sources, dataset_label, is_multi30k, prepare_data, select
from .state import HubPush, Run, RunPlan

logger = logging.getLogger("vaswani_hf.training")

# The planner's guess for the final test translation until a validation run has timed decoding (a CPU's; the gpu
# preset sets its own).
SECONDS_PER_TEST_SENTENCE = 0.05


def start_process() -> None:
    """What a training command does first: log lines with times, glibc's malloc keeps freed memory
    (`keep_freed_memory`) and torch's oneDNN caches stay bounded (`bound_onednn_caches`, before the first product)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        level=logging.INFO)
    keep_freed_memory()
    bound_onednn_caches()


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


def given_flags(parser, argv: Sequence[str] | None) -> set[str]:
    """The option names (dests, underscored) given on the command line, whatever the spelling: `--max-steps 3`,
    `--max_steps=3` and `--no_x` all count. `parser.allow_abbrev` must be False (abbreviations would go uncounted)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    actions = parser._option_string_actions  # argparse's own table of every spelling -> action
    given = set()
    for token in argv:
        if not token.startswith("--"):
            continue
        action = actions.get(token.split("=", 1)[0])
        if action is not None:
            given.add(action.dest)
        else:
            given.add(token.split("=", 1)[0].lstrip("-").replace("-", "_"))
    return given


def strip_hub_token(args) -> str | None:
    """Take the Hub token out of an arguments object (Trainer pickles its arguments into training_args.bin of the run
    and of every checkpoint) and return it, to be passed only to the upload call."""
    token = getattr(args, "hub_token", None)
    if token is not None:
        args.hub_token = None
    return token


def default_budget_minutes(preset: dict[str, Any], recipe: RecipeArguments, device_type: str) -> float | None:
    """The preset's time budget for the whole command: `time_budget_minutes_native_bf16`, where the preset has one, on a
    CPU with native bf16 (whichever precision `cpu_precision` then finds faster there) unless --cpu_bf16 no, else
    `time_budget_minutes`; None where the preset has none (base, big, tiny)."""
    native = device_type == "cpu" and recipe.cpu_bf16 != "no" and "time_budget_minutes_native_bf16" in preset \
        and cpu_has_native_bf16()
    return preset.get("time_budget_minutes_native_bf16" if native else "time_budget_minutes")


def new_run(model_args: ModelArguments, data_args: DataArguments, recipe: RecipeArguments, *,
            preset: dict[str, Any], output_dir: str | Path, max_steps: int, warmup_steps: int,
            max_steps_given: bool, device_type: str, resume_value: str | bool | None) -> Run:
    """The `Run` of a command whose loop has settled `max_steps` and `warmup_steps`: batch tokens, lr factor, clock
    stop and validation sentences from the flags or else the preset; the time budget from --time_budget_minutes, else
    the preset's (`default_budget_minutes`) unless --max_steps is given. `resume_value`: --resume_from_checkpoint as
    given (None, "", "false": a new run).

    Raises:
        CheckError: a time budget that is not a positive number of minutes.
    """
    budget = recipe.time_budget_minutes
    if budget is None and not max_steps_given:
        budget = default_budget_minutes(preset, recipe, device_type)
    if budget is not None and (isinstance(budget, bool) or not budget > 0):
        raise CheckError(f"--time_budget_minutes must be a positive number of minutes, got {budget}.")
    if data_args.max_eval_samples is None:
        data_args.max_eval_samples = preset.get("max_eval_samples")
    max_train_minutes = recipe.max_train_minutes
    if max_train_minutes is None:
        max_train_minutes = preset.get("max_train_minutes")
    resume_value = resolve_resume_value(resume_value)
    plan = RunPlan(max_steps=max_steps, warmup_steps=warmup_steps,
                   max_tokens=data_args.max_tokens if data_args.max_tokens is not None else preset["max_tokens"],
                   lr_factor=recipe.lr_factor if recipe.lr_factor is not None else preset["lr_factor"],
                   budget_minutes=budget, max_train_minutes=max_train_minutes, resuming=resume_value is not None)
    return Run(model_args, data_args, recipe, preset, plan, Path(output_dir), resume_value)


def check_streaming(run: Run, layout: str) -> None:
    """--streaming trains for --max_steps updates of vaswani-train: a stream's batch count is not known before a pass,
    so no time budget can be planned over it, and the no-Trainer loop counts its epochs in batches.

    Raises:
        CheckError: --streaming with the no-Trainer loop, or without --max_steps (a time budget instead).
    """
    if not run.data_args.streaming:
        return
    if layout != "trainer":
        raise CheckError("--streaming is a flag of vaswani-train; vaswani-train-no-trainer counts its epochs in "
                         "batches, which a stream does not know. Use vaswani-train, or leave --streaming out.")
    if run.plan.budget_minutes is not None:
        raise CheckError("--streaming needs --max_steps (and no --time_budget_minutes): the number of batches in a "
                         "stream is not known before a pass over it, so no time budget can be planned; "
                         "--max_train_minutes still stops training by the clock.")


def check_inputs(run: Run, *, save_total_limit: int | None, save_total_limit_given: bool, saving: bool,
                 save_steps: int | float | None, layout: str = "trainer", push: HubPush | None = None) -> int | None:
    """Everything that can be checked before the data, the tokenizer and the training: `--average_last` against the
    checkpoints the run keeps (`check_average_last`), the model and tokenizer it starts from
    (`check_model_inputs`); for a resumed run the checkpoint it continues (`resolve_resume_checkpoint`: complete,
    finite weights; kept in `run.plan.resume_from`), its settings (`check_resume_settings`) and the checkpoints
    `--average_last` will find (`check_average_last_resumed`); with `push`, that the Hub can be reached; --streaming
    (`check_streaming`); the data (`check_data`: splits, first records, non-empty), read up to each split's first pair.

    `layout`: the checkpoints of the loop, "trainer" (train.py) or "accelerate" (train_no_trainer.py).

    Returns:
        the `save_total_limit` to use (a default below `--average_last` is raised to it).

    Raises:
        CheckError: naming the flag and what to do.
    """
    check_streaming(run, layout)
    limit = check_average_last(run.recipe.average_last or 0, save_total_limit=save_total_limit,
                               save_total_limit_given=save_total_limit_given, saving=saving,
                               max_steps=run.plan.max_steps, save_steps=save_steps, resuming=run.plan.resuming)
    check_model_inputs(run.model_args.model_name_or_path, run.model_args.tokenizer_name,
                       run.model_args.config_overrides, preset_model=run.preset.get("model", {}),
                       vocab_size=run.model_args.vocab_size)
    if run.plan.resuming:
        checkpoint = resolve_resume_checkpoint(run.resume_value, run.output_dir, layout=layout)
        run.plan.resume_from = checkpoint
        check_resume_settings(checkpoint, run_settings(run), model_config=expected_model_fields(run))
        check_average_last_resumed(run.recipe.average_last, resume_from=checkpoint, output_dir=run.output_dir,
                                   max_steps=run.plan.max_steps, save_steps=save_steps, save_total_limit=limit)
    from .choose import COOLDOWN_CHECKPOINTS, averaging_searched

    if averaging_searched(run) and limit is not None and not save_total_limit_given:
        # the cooldown's checkpoints, and the --save_steps ones that may fall among them, stay until the choice
        limit = max(limit, COOLDOWN_CHECKPOINTS + 2)
    if push is not None:
        from .publishing import check_hub_reachable

        check_hub_reachable(push.endpoint)
    check_data(run.data_args)
    return limit


def prepare(run: Run, *, main_process_first: AbstractContextManager | None = None):
    """Data -> joint BPE -> token ids (`prepare_data`, inside `main_process_first`: the main process trains and caches
    the BPE, the others load it), then the model of the preset or of --model_name_or_path (`build_model`).

    Returns:
        `(raw, tokenizer, tokenized, model)`: the `DatasetDict` of translation records, the tokenizer, the
        `DatasetDict` of token ids, and the model.
    """
    with main_process_first or nullcontext():
        raw, tokenizer, tokenized = prepare_data(run.model_args, run.data_args, run.preset)
    if "train" in tokenized:  # --drop_long_pairs leaves out pairs of raw["train"]: count what is trained
        run.train_pairs = len(tokenized["train"])
        run.train_pairs_left_out = len(raw["train"]) - len(tokenized["train"])
    model = build_model(run.model_args, run.preset, tokenizer)
    return raw, tokenizer, tokenized, model


def check_positions(config, data_args: DataArguments, *, generation_max_length: int | None = None) -> None:
    """Learned positions (§3.5's alternative) cannot extrapolate: refuse, before training, lengths their table does not
    cover, rather than fail at the first long batch.

    Raises:
        CheckError: --max_source_length, --max_target_length or `generation_max_length` (validation decoding) above
            the config's `max_position_embeddings`.
    """
    if config.position_embedding_type != "learned":
        return
    lengths = {"--max_source_length": data_args.max_source_length, "--max_target_length": data_args.max_target_length}
    if generation_max_length is not None:
        lengths["--generation_max_length"] = generation_max_length
    too_long = {flag: n for flag, n in lengths.items() if n > config.max_position_embeddings}
    if too_long:
        raise CheckError(
            f"The model has learned positions for {config.max_position_embeddings} tokens (max_position_embeddings), "
            f"fewer than {', '.join(f'{k} {v}' for k, v in too_long.items())}. Lower these flags, raise "
            f"max_position_embeddings, or use position_embedding_type=sinusoidal.")


def count_test_sentences(run: Run, raw) -> int:
    """Sentences the final test translation decodes: the test split, at most --max_test_samples; 0 without one or
    with --skip_test."""
    if "test" not in raw or run.recipe.skip_test:
        return 0
    limit = run.data_args.max_test_samples
    return len(raw["test"]) if limit is None else min(len(raw["test"]), limit)


def seconds_per_test_sentence(run: Run) -> float:
    """The guess for one test sentence's decoding time until a validation run measures it (the preset's, if any)."""
    return run.preset.get("seconds_per_test_sentence", SECONDS_PER_TEST_SENTENCE)


def training_deadline(run: Run, *, test_sentences: int) -> float | None:
    """The `time.monotonic()` at which a loop without the planner stops training: --max_train_minutes from now, or the
    whole command's time budget (counted from the process start) less the estimated time after training
    (`seconds_after_training`), whichever comes first; None where neither is set."""
    deadlines = []
    if run.plan.max_train_minutes:
        deadlines.append(time.monotonic() + run.plan.max_train_minutes * 60)
    if run.plan.budget_minutes:
        after = seconds_after_training(test_sentences, seconds_per_test_sentence(run))
        deadlines.append(process_start_monotonic() + run.plan.budget_minutes * 60 - after)
    return min(deadlines) if deadlines else None


def run_metrics(run: Run, model, *, steps: int, epochs: float, train_seconds: float, device: torch.device,
                distributed_type: str, world_size: int, mixed_precision: str | None,
                label_smoothing: float) -> dict[str, Any]:
    """The metrics both loops record for a run (metrics.json); each loop adds its own (loss, tokens, plan) and the
    choice made on validation (`training/lib/choose.py`) replaces `averaged_checkpoints`."""
    return {
        "preset": run.model_args.preset,
        "label_smoothing": label_smoothing,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_steps": steps,
        "train_epochs": round(epochs, 2),
        "train_minutes": round(train_seconds / 60, 2),
        "max_tokens": run.plan.max_tokens,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "distributed_type": distributed_type,
        "world_size": world_size,
        "mixed_precision": mixed_precision,
        "precision": run.plan.precision,
        "torch_threads": torch.get_num_threads(),
        "averaged_checkpoints": run.recipe.average_last or 0,
    }


def run_history(run: Run, raw) -> dict[str, Any]:
    """What the model card tells of the run's history: the model it started from (`base_model`: None when trained from
    scratch; `base_model_local`; `base_model_history`, the dataset, data and steps of that model's own run where its
    folder holds a metrics.json), the data (`data`: the files or Hub dataset of each split, `dataset`: a short label)
    and the training pairs (`train_pairs`: those trained on, after --drop_long_pairs; `train_pairs_left_out`: those
    it left out; None for a stream)."""
    data_args = run.data_args
    base = run.model_args.model_name_or_path
    history: dict[str, Any] = {
        "base_model": base,
        "base_model_local": bool(base and Path(base).exists()),
        "dataset": dataset_label(data_args),
        "data": data_sources(data_args),
        "train_pairs": run.train_pairs,
        "train_pairs_left_out": run.train_pairs_left_out,
    }
    if base and (Path(base) / "metrics.json").is_file():
        try:
            earlier = read_json(Path(base) / "metrics.json")
        except CheckError:
            earlier = None
        if isinstance(earlier, dict):
            history["base_model_history"] = {key: earlier.get(key) for key in
                                             ("base_model", "dataset", "data", "train_steps", "preset")}
    return history


def finish(run: Run, model, tokenizer, raw, metrics: dict[str, Any], *, batch_size: int, num_beams: int,
           push: HubPush | None = None, stopped_by: str | None = None) -> dict[str, Any]:
    """The end of a training run, on the main process only, once the final (averaged) model and its tokenizer are in
    --output_dir: translate and score the test split if the data has one (`evaluate_test_set`: beam search, §6.1;
    BLEU three ways), print --num_samples sample translations and the scores, write `test_translations.txt` and
    `metrics.json` (atomically; with the whole command's minutes, the run's history of `run_history` and
    `weights_sha256`, the fingerprint of the weights scored), and with `push` upload the Hub-ready export.

    `stopped_by`: the signal that stopped training ("SIGTERM"): the test translation and the upload are skipped (a
    scheduler that sends SIGTERM kills soon after), and metrics.json says so.

    `metrics` is updated in place and returned, with `source_lang`, `target_lang` and the history added (the model
    card of `lib/publishing.py` reads them).
    """
    from .scoring import evaluate_test_set

    data_args, output_dir = run.data_args, run.output_dir
    metrics.update(source_lang=data_args.source_lang, target_lang=data_args.target_lang, **run_history(run, raw))
    if stopped_by:
        metrics["stopped_by"] = stopped_by
        logger.warning("Stopped by %s: the test set is not translated. Score the model with vaswani-evaluate "
                       "--model %s.", stopped_by, output_dir)
    elif run.recipe.skip_test:
        metrics["test"] = "not translated (--skip_test)"
    elif "test" in raw:
        test = select(raw["test"], data_args.max_test_samples)
        generation = model.generation_config  # the decoding chosen on validation (training/lib/choose.py) or given
        result = evaluate_test_set(model, tokenizer, test, data_args, batch_size=batch_size,
                                   num_beams=generation.num_beams or num_beams,
                                   length_penalty=generation.length_penalty,
                                   is_multi30k=is_multi30k(data_args),
                                   length_penalty_style=getattr(generation, "length_penalty_style", None) or "hf")
        metrics.update(result["metrics"])
        write_lines_atomic(output_dir / "test_translations.txt", result["hypotheses"])
        print("\nSample translations (test set):")
        samples = list(zip(result["sources"], result["hypotheses"], result["references"]))
        for source, hypothesis, reference in samples[: run.recipe.num_samples]:
            print(f"  source:    {source}\n  output:    {hypothesis}\n  reference: {reference}\n")
    metrics["weights_sha256"] = weights_fingerprint(output_dir)
    metrics["command_minutes"] = round((time.monotonic() - process_start_monotonic()) / 60, 2)
    write_json_atomic(output_dir / "metrics.json", metrics)
    if "test_bleu" in metrics:
        print(f"Test BLEU (sacreBLEU, detokenized): {metrics['test_bleu']}   {metrics['test_bleu_signature']}   "
              f"(beam {metrics['num_beams']}, length penalty {metrics['length_penalty']:g} in the "
              f"{metrics['length_penalty_style']} form; length ratio {metrics['test_length_ratio']})")
    elif run.recipe.skip_test:
        print(f"The test split was not translated (--skip_test): vaswani-evaluate --model {output_dir} scores it.")
    if "test_paper_bleu" in metrics:
        print(f"Test BLEU (the paper's Table 2 form: cased, Moses-tokenized, get_ende_bleu.sh): "
              f"{metrics['test_paper_bleu']}   {metrics['test_paper_bleu_signature']}")
    if "test_tok_bleu" in metrics:
        print(f"Test BLEU (lowercased, tokenized, as Multi30k papers report): {metrics['test_tok_bleu']}")
    budget = run.plan.budget_minutes
    print(f"Model, tokenizer and metrics.json written to {output_dir}")
    print(f"Whole command: {metrics['command_minutes']} min" + (f" (time budget {budget:g} min)" if budget else ""))
    if push is not None and not stopped_by:
        from .publishing import write_and_push

        write_and_push(output_dir, repo_id=push.repo_id, token=push.token, private=push.private,
                       endpoint=push.endpoint)
    return metrics


def command_cli(main: Callable[[], Any]) -> int:
    """A training command's console entry: runs `main` and returns exit status 0 (`main` returns the metrics dict,
    which `sys.exit` would print and turn into status 1); a `CheckError` (what was wrong and what to do) exits with
    its message and status 1, without a traceback."""
    try:
        main()
    except CheckError as error:
        raise SystemExit(f"error: {error}") from None
    return 0
