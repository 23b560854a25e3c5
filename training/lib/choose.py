"""The end of a training run chooses, on the validation set, what §6.1 chose on the development set: how many of the
last checkpoints to average, and the length penalty (its alpha and its form), so that the test set is decoded once,
with the choice.

    "For the base models, we used a single model obtained by averaging the last 5 checkpoints [...] We used beam
    search with a beam size of 4 and length penalty alpha = 0.6. These hyperparameters were chosen after
    experimentation on the development set." (§6.1)

`choose_on_validation` averages the last N of the run's cooldown checkpoints for each N (1: the last checkpoint
alone), decodes the whole validation split once per N with beam search (`vaswani_hf.decoding.length_penalty_search`:
every alpha of both length-penalty styles from the same finished hypotheses), keeps the (N, style, alpha) of highest
validation BLEU, loads and writes those weights into --output_dir and writes the decoding into its
`generation_config.json`, so that `from_pretrained` + `generate()`, `vaswani-translate`, `vaswani-evaluate`, the
pipeline and the demo decode the chosen way. `--length_penalty` (with `--length_penalty_style`) given by the user is
kept, not searched; `--average_last N` given by the user is kept (0: none), not searched.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from vaswani_hf.checks import replace_file_atomically

from .checkpoints import checkpoint_step, current_run_checkpoints
from .state import Run

# At most this many checkpoints of the cooldown are averaged (the planner saves them evenly over it; §6.1 averaged
# the last 5 of the base model, written 10 minutes apart).
COOLDOWN_CHECKPOINTS = 4
# The search decodes the whole split in full length-sorted batches: a sentence costs less than in training's validation
# runs of 200 sentences, whose time the planner measures (about 0.7 of it in the main job, docs/results.md).
SEARCH_COST_FACTOR = 0.75
# The choice is the best validation BLEU among the settings whose output is at least as long as the references: the
# brevity penalty is steep below 1 and flat above, and outputs chosen below 1 on validation came out shorter on test
# sets (docs/results.md); where no setting reaches 1, the best of all.
MIN_LENGTH_RATIO = 1.0

__all__ = ["COOLDOWN_CHECKPOINTS", "MIN_LENGTH_RATIO", "SEARCH_COST_FACTOR", "averaging_searched",
           "choose_on_validation", "length_penalty_searched", "search_passes", "spread_over_cooldown",
           "write_given_decoding"]


def averaging_searched(run: Run) -> bool:
    """The number of checkpoints to average is chosen on validation: --average_last not given and the preset plans a
    cooldown (the planner then saves checkpoints over it)."""
    return run.recipe.average_last is None and bool(run.plan.budget_minutes) and \
        run.preset.get("cooldown_fraction", 0) > 0


def length_penalty_searched(run: Run) -> bool:
    """The length penalty is chosen on validation: --length_penalty not given."""
    return run.recipe.length_penalty is None


def search_passes(run: Run, has_validation: bool) -> int:
    """Beam searches over the validation split that the end of the run will make (for the planner's estimate)."""
    if not has_validation or run.recipe.skip_test or not (averaging_searched(run) or length_penalty_searched(run)):
        return 0
    return COOLDOWN_CHECKPOINTS if averaging_searched(run) else 1


def spread_over_cooldown(checkpoints: list[Path], every: int | None) -> list[Path]:
    """The checkpoints to average, oldest first: from the newest back, each kept one at least `every // 2` steps
    before the next kept one, so that a --save_steps checkpoint a few steps from one of the planner's (steps 2998 and
    3000, say) does not count the same weights twice in "the last N" (§6.1's checkpoints were 10 minutes apart).

    Args:
        checkpoints: `checkpoint-<step>` folders, oldest first.
        every: the planner's spacing of its cooldown checkpoints in steps; None or < 2: all are kept.
    """
    if not every or every < 2:
        return list(checkpoints)
    kept: list[Path] = []
    for folder in reversed(checkpoints):
        if not kept or checkpoint_step(kept[-1]) - checkpoint_step(folder) >= every // 2:
            kept.append(folder)
    return kept[::-1]


def _load(model, state: dict) -> None:
    """`state` (a checkpoint's or an average's weights, tied weights stored once) into `model`.

    Raises:
        RuntimeError: a parameter that `state` lacks and that is not tied to one it holds.
    """
    missing, unexpected = model.load_state_dict(state, strict=False)
    held = {tensor.data_ptr() for name, tensor in model.state_dict().items() if name in state}
    untied = [name for name in missing if model.state_dict()[name].data_ptr() not in held]
    if untied or unexpected:
        raise RuntimeError(f"The averaged weights do not fit the model: missing {untied[:3]}, unexpected "
                           f"{unexpected[:3]}.")


def _set_decoding(model, output_dir: Path, *, num_beams: int, length_penalty: float, style: str) -> None:
    """The chosen decoding into the model's generation config and --output_dir's generation_config.json (atomically)."""
    config = model.generation_config
    config.num_beams, config.length_penalty, config.early_stopping = num_beams, length_penalty, True
    config.length_penalty_style = style
    replace_file_atomically(output_dir / "generation_config.json", lambda tmp: config.to_json_file(tmp))


def write_given_decoding(run: Run, model) -> None:
    """Where nothing was chosen on validation: --length_penalty (and --length_penalty_style) given on the command line
    go into the model's generation config and --output_dir's generation_config.json, so that the folder decodes as
    the run's test translation did."""
    if run.recipe.length_penalty is None and run.recipe.length_penalty_style is None:
        return
    generation = model.generation_config
    alpha = run.recipe.length_penalty if run.recipe.length_penalty is not None else generation.length_penalty
    _set_decoding(model, run.output_dir, num_beams=generation.num_beams or 4,
                  length_penalty=0.6 if alpha is None else alpha, style=run.recipe.length_penalty_style or "hf")


def choose_on_validation(run: Run, model, tokenizer, validation, *, cooldown_from: int | None, final_step: int,
                         num_beams: int, batch_size: int, checkpoint_every: int | None = None) -> dict[str, Any] | None:
    """Choose the checkpoints to average and the length penalty on `validation`, apply them to `model` and
    --output_dir, and return what was tried and chosen (for metrics.json and the model card); None where nothing is
    chosen (both given on the command line, or no validation split).

    Args:
        run: the run (its flags say what is searched: `averaging_searched`, `length_penalty_searched`).
        model: the final model, already saved in --output_dir (its weights are replaced by the chosen average).
        validation: the validation split's translation records (all of them are decoded).
        cooldown_from: the last step before the learning-rate cooldown (the checkpoints after it are the candidates);
            None: the run's last `COOLDOWN_CHECKPOINTS` checkpoints.
        checkpoint_every: the planner's spacing of its cooldown checkpoints, in steps: candidates closer than half
            of it to a newer one are left out (`spread_over_cooldown`); None: none is left out.
        final_step: the run's last step; averaging is searched only when its checkpoint is the newest.
        num_beams: the beam size (the paper's 4).
    Returns:
        `{"chosen": {...}, "tried": [rows], "averaged_from": [...], "candidates": [the checkpoints the average
        was chosen among, oldest first], "validation_sentences": n, "seconds": s}`.
    """
    from vaswani_hf.averaging import average_checkpoints, save_averaged_model
    from vaswani_hf.decoding import DEFAULT_ALPHAS, best_setting, length_penalty_search

    search_average, search_penalty = averaging_searched(run), length_penalty_searched(run)
    if validation is None or len(validation) == 0 or not (search_average or search_penalty) or num_beams < 2:
        return None
    started = time.perf_counter()
    source_lang, target_lang = run.data_args.source_lang, run.data_args.target_lang
    sources = [t[source_lang] for t in validation["translation"]]
    references = [t[target_lang] for t in validation["translation"]]
    if search_penalty:
        alphas, styles = DEFAULT_ALPHAS, (("hf", "gnmt") if run.recipe.length_penalty_style is None
                                          else (run.recipe.length_penalty_style,))
    else:
        alphas, styles = (run.recipe.length_penalty,), (run.recipe.length_penalty_style or "hf",)

    candidates: list[Path] = []
    if search_average:
        mine = current_run_checkpoints(run.output_dir, started=run.plan.started, resuming=run.plan.resuming)
        if mine and checkpoint_step(mine[-1]) == final_step:
            if cooldown_from is not None:
                mine = [c for c in mine if checkpoint_step(c) > cooldown_from]
            candidates = spread_over_cooldown(mine, checkpoint_every)[-COOLDOWN_CHECKPOINTS:]
    counts = list(range(1, len(candidates) + 1)) or [None]  # None: the model as it is
    final_state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    tried: list[dict[str, Any]] = []
    for n in counts:
        if n is not None and n > 1:
            _load(model, average_checkpoints(candidates[-n:]))
        elif n == 1:
            model.load_state_dict(final_state)
        rows = length_penalty_search(model, tokenizer, sources, references, num_beams=num_beams, alphas=alphas,
                                     styles=styles, batch_size=batch_size)
        for row in rows:
            row["average_last"] = n if n is not None else (run.recipe.average_last or 1)
        tried.extend(rows)
        best = best_setting(rows, MIN_LENGTH_RATIO)
        paper = next((r for r in rows if r["length_penalty_style"] == "hf" and r["length_penalty"] == 0.6), None)
        label = {None: f"the model (--average_last {run.recipe.average_last})" if run.recipe.average_last else
                 "the model", 1: "last checkpoint"}.get(n, f"average of the last {n} checkpoints")
        print(f"  validation, {label}: "
              f"best {best['length_penalty_style']} alpha {best['length_penalty']:g} BLEU {best['bleu']} (length "
              f"ratio {best['length_ratio']})" + (f"; hf alpha 0.6 BLEU {paper['bleu']} (ratio {paper['length_ratio']})"
                                                  if paper is not None and paper is not best else ""), flush=True)
    chosen = best_setting(tried, MIN_LENGTH_RATIO)
    n = chosen["average_last"]
    averaged_from: list[str] = []
    if candidates and n > 1:
        chosen_folders = candidates[-n:]
        state = average_checkpoints(chosen_folders)
        _load(model, state)
        save_averaged_model(state, chosen_folders[-1], run.output_dir, sources=chosen_folders, in_place=True)
        averaged_from = [f.name for f in chosen_folders]
    elif candidates:
        model.load_state_dict(final_state)
        averaged_from = [candidates[-1].name]
    _set_decoding(model, run.output_dir, num_beams=num_beams, length_penalty=chosen["length_penalty"],
                  style=chosen["length_penalty_style"])
    seconds = time.perf_counter() - started
    what = (f"the average of the last {n} checkpoints ({', '.join(averaged_from)})" if len(averaged_from) > 1
            else "the last checkpoint")
    print(f"Chosen on validation ({len(sources)} sentences, beam {num_beams}, {len(tried)} settings, "
          f"{seconds:.0f} s): {what}, length penalty {chosen['length_penalty']:g} in the "
          f"{chosen['length_penalty_style']} form, BLEU {chosen['bleu']}, length ratio {chosen['length_ratio']}; "
          f"written into {run.output_dir / 'generation_config.json'}.", flush=True)
    return {"chosen": {key: chosen[key] for key in ("average_last", "num_beams", "length_penalty_style",
                                                    "length_penalty", "bleu", "length_ratio")},
            "averaged_from": averaged_from, "candidates": [folder.name for folder in candidates],
            "searched_average": bool(candidates),
            "searched_length_penalty": search_penalty, "validation_sentences": len(sources),
            "seconds": round(seconds, 1), "tried": tried}
