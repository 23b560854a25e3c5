"""The presets of the training commands (`--preset`): the model's size and the recipe's batch, schedule and length.

`base` and `big` are the paper's (Table 3, §5.1-5.4; the paper's batch is ~25000 source + 25000 target tokens over 8
GPUs); `cpu` is sized so that the default run on a 2-core machine trains and evaluates in under 30 minutes; `gpu` is
the base model on Multi30k within minutes on one GPU; `tiny` is for tests. A preset's values apply to every flag the
command line does not give.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from vaswani_hf import VaswaniConfig
from vaswani_hf.checks import CheckError

if TYPE_CHECKING:
    from .arguments import ModelArguments

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
        # 1,024-token batches: in the budget they fit 1.4-1.6x (bf16) and 1.7-1.8x (fp32) the steps of 2,048 and scored
        # +0.94 and +0.36 validation BLEU (docs/results.md, "The batch size"); 512 lost 0.8-1.6 there, and 2,048 had
        # beaten 4,096 by 2.8 test BLEU. Learning-rate factors 0.35 and 0.7 lost to 0.5 at 1,024 (same page).
        # Residual dropout stays the paper's 0.1: 0, 0.05, 0.2 and 0.3 did not beat it on validation, 0.15 beat it by
        # 0.10-0.71 at the 5,000-5,945 steps native bf16 fits and lost at the AVX2 path's 3,500; nor
        # did 8 heads beat 4 (same page, "Dropout"); nor, with native bf16, did d_ff 2048, d_model 384 or 2+2 layers in
        # the steps they fit in the budget (same page, "The model's width", "Two layers on each side"); nor, beside the
        # long-run dropout below, did 4+2 layers or dropout 0.15, and label smoothing 0.2 (off §5.4) gained no more
        # than two seeds differ (same page, "Levers on top of the long-run dropout").
        # A joint BPE of 8,000 entries: 5,000 fitted 1.12x the steps and scored higher on validation in bf16 but lower
        # in the fp32 run of the budget, and lower in bf16 too at 1,024-token batches (docs/results.md, "The vocabulary
        # size"), so it was not taken. The step cap binds only on a CPU faster than the budget needs: 9,302 steps
        # (a 31-minute budget) scored 41.43 on validation against 41.04-41.25 at 7,417-7,641 steps (docs/screens.md,
        # "The step cap, where a faster step would pass it").
        "max_tokens": 1024, "warmup_steps": 400, "lr_factor": 0.5, "max_steps": 10_000, "vocab_size": 8000,
        # The whole command (start to BLEU printed) plans its steps to end within this budget (training/lib/planner.py):
        # up to max_steps, fewer on a slower machine, the schedule always ending in a linear cooldown to lr 0 over
        # the last `cooldown_fraction` of the planned steps (a departure from §5.3, cpu preset only; README), then the
        # checkpoints to average and the length penalty are chosen on validation (training/lib/choose.py). 26 minutes on
        # every CPU: with set-up (venv, pip) the README's one-line command stays under 30; a CPU with native bf16
        # spends what it saves on more steps (validation BLEU still rose at 2,300 steps; docs/results.md).
        "time_budget_minutes": 26, "cooldown_fraction": 0.2,
        # Where the plan at step 50 fits >= 4,200 updates, dropout on the attention probabilities and after the FFN's
        # ReLU too (not in the paper; training/lib/dropout.py): +0.44 to +0.75 validation BLEU over the preset in three
        # pairs of seeds at 5,000-5,945 steps; at the AVX2 path's 4,200 fp32 steps one pair scored 0.32 lower with it.
        # Plans run under the final steps; at step 50 the two paths lie further apart (3,579-4,126 against
        # 4,451-5,181) than at step 12 (docs/results.md, "Dropout at 1,024-token batches").
        "long_run_dropout": {"min_steps": 4200, "at_step": 50, "attention_dropout": 0.1, "activation_dropout": 0.1},
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


def parse_overrides(text: str | None) -> dict[str, Any]:
    """'d_model=512,dropout=0.2,normalize_before=true' -> {'d_model': 512, 'dropout': 0.2, ...}.

    Raises:
        CheckError: an item without '=' or a field VaswaniConfig does not have.
    """
    if not text:
        return {}
    known = VaswaniConfig().to_dict()
    out: dict[str, Any] = {}
    for item in text.split(","):
        if "=" not in item:
            raise CheckError(f"--config_overrides: expected key=value, got {item!r}.")
        key, value = (s.strip() for s in item.split("=", 1))
        if key not in known:
            raise CheckError(f"--config_overrides: VaswaniConfig has no field {key!r}.")
        try:
            out[key] = json.loads(value.lower() if value.lower() in ("true", "false", "null") else value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def resolve_preset(model_args: ModelArguments) -> dict[str, Any]:
    """The preset named by `--preset` (`model_args.preset`).

    Raises:
        CheckError: an unknown name, listing the presets.
    """
    if model_args.preset not in PRESETS:
        raise CheckError(f"--preset {model_args.preset!r} is unknown; choose one of {', '.join(PRESETS)}.")
    return PRESETS[model_args.preset]
