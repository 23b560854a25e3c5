"""Fine-tuning learns: three ways of training, each held to a validation-loss fall and an exact-match threshold that an
untrained or broken model misses, with the broken variants run beside them.

- `Seq2SeqTrainer` in-process on the copy task of `tests/helpers.py` (24 ids, 2+2 layers, d_model 32), 300 steps:
  Trainer's eval loss falls by at least `TRAINER_LOSS_FALL` nats and greedy exact match reaches `TRAINER_MATCH`.
  Broken variants, each shown to miss it: a learning rate of 0 (frozen weights; the loss stays), the decoder's causal
  mask off (§3.2.3: it sees the next target token) and decoder inputs that are the labels instead of the labels shifted
  right (§3.1: it sees the token it predicts). With either leak the training loss falls as a working model's does;
  only generation, which has no future tokens to read, shows them.
- train_no_trainer.py's `run(argv)` on a word-for-word task (German number words to English, 600 pairs), 200 updates:
  validation loss `NO_TRAINER_LOSS_FALL` nats below the initial model's, test exact match (beam 4) at least
  `NO_TRAINER_MATCH` and test BLEU at least `NO_TRAINER_BLEU`; with the learning rate held at 0 none of them.
- train.py `--model_name_or_path <that run's folder>`, 150 more steps: validation loss at most `CONTINUED_LOSS_RATIO`
  of the starting model's and exact match at least `CONTINUED_MATCH`; the same command from a fresh model (the
  continuation not happening) misses it.

The thresholds sit between what the working runs reach and what the broken ones do, with room for another CPU's
rounding (measured over seeds 0-2 for the copy task and 1-4 for the commands, and with oneDNN instead of BLAS):
copy 3.8 -> 0.07 nats, exact match 0.93-0.95 (broken: 0.0); no-Trainer 6.3 -> 0.55-0.79 nats, 0.27-0.50 (test BLEU
39-73; learning rate 0: 0.0); continued -> 0.10-0.15 nats, 0.67-0.95 (BLEU 88-99; from a fresh model 0.13-0.22).
"""

import json
import random
from pathlib import Path

import pytest
import torch
from helpers import COPY_TASK, EOS, PAD, copy_batch, tiny_config, write_jsonl

from vaswani_hf import VaswaniForConditionalGeneration, modeling_vaswani

TRAINER_LOSS_FALL, TRAINER_MATCH = 2.0, 0.8
NO_TRAINER_LOSS_FALL, NO_TRAINER_MATCH, NO_TRAINER_BLEU = 4.0, 0.15, 25.0
CONTINUED_LOSS_RATIO, CONTINUED_MATCH = 0.5, 0.5


# -- Seq2SeqTrainer on the copy task ----------------------------------------------------------------------------------

def copy_examples(seed: int, count: int) -> list[dict]:
    """`count` copy-task examples (unpadded id lists), 32 at a time from `copy_batch`."""
    generator, examples = torch.Generator().manual_seed(seed), []
    while len(examples) < count:
        ids, _, _ = copy_batch(generator)
        for row in ids.tolist():
            sentence = row[: row.index(EOS) + 1]
            examples.append({"input_ids": sentence, "labels": list(sentence)})
    return examples[:count]


def collate(examples: list[dict], *, decoder_inputs_are_labels: bool = False) -> dict:
    """Right-padded batch: `input_ids`/`attention_mask` (pad 0) and `labels` (-100 at padding); with
    `decoder_inputs_are_labels`, the broken variant's `decoder_input_ids` = the labels, not shifted right."""
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.tensor([e["input_ids"] + [PAD] * (width - len(e["input_ids"])) for e in examples])
    labels = torch.tensor([e["labels"] + [-100] * (width - len(e["labels"])) for e in examples])
    batch = {"input_ids": ids, "attention_mask": ids.ne(PAD).long(), "labels": labels}
    if decoder_inputs_are_labels:
        batch["decoder_input_ids"] = labels.masked_fill(labels.eq(-100), PAD)
    return batch


def exact_match(prediction) -> dict:
    """Share of sentences whose generated tokens after the start token, up to and with the first </s>, are the
    reference's. Trainer pads both arrays with -100 or the pad id."""
    hits = 0
    for generated, reference in zip(prediction.predictions, prediction.label_ids):
        tokens = [int(t) for t in generated[1:] if t not in (-100, PAD)]
        tokens = tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens
        hits += tokens == [int(t) for t in reference if t not in (-100, PAD)]
    return {"exact_match": hits / len(prediction.label_ids)}


def future_visible_mask(attention_mask, batch, length, past, key_length, dtype, device):
    """The broken variant's decoder self-attention mask: padding only, no causal part (§3.2.3 left out)."""
    blocked = torch.zeros(1, 1, 1, key_length, dtype=torch.bool, device=device)
    if attention_mask is not None:
        blocked = blocked | attention_mask[:, None, None, -key_length:].eq(0)
    # Additive and never None: with no mask, SDPA would apply causality itself (the module's is_causal).
    return torch.zeros(batch, 1, length, key_length, dtype=dtype, device=device).masked_fill(
        blocked.expand(batch, 1, length, key_length), torch.finfo(dtype).min)


def train_copy_with_trainer(output_dir: Path, *, learning_rate: float = 5e-3,
                            decoder_inputs_are_labels: bool = False) -> dict:
    """Seq2SeqTrainer, 300 steps of 32 copy examples (AdamW, 30 warmup steps, linear decay); Trainer's evaluate()
    on 128 held-out examples (greedy generation) before and after, and the training losses."""
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(tiny_config(**COPY_TASK))
    args = Seq2SeqTrainingArguments(
        output_dir=str(output_dir), max_steps=300, per_device_train_batch_size=32, per_device_eval_batch_size=128,
        learning_rate=learning_rate, warmup_steps=30, lr_scheduler_type="linear", weight_decay=0.0, logging_steps=50,
        save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True, seed=0, use_cpu=True,
        dataloader_num_workers=0, predict_with_generate=True, generation_num_beams=1, generation_max_length=16)
    trainer = Seq2SeqTrainer(
        model=model, args=args, train_dataset=copy_examples(seed=0, count=300 * 32),
        eval_dataset=copy_examples(seed=99, count=128), compute_metrics=exact_match,
        data_collator=lambda examples: collate(examples, decoder_inputs_are_labels=decoder_inputs_are_labels))
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    train_losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return {"before": before, "after": after, "train_losses": train_losses}


def learned(run: dict, loss_fall: float, match: float) -> bool:
    return (run["before"]["eval_loss"] - run["after"]["eval_loss"] >= loss_fall
            and run["after"]["eval_exact_match"] >= match)


def test_seq2seq_trainer_learns_the_copy_task(tmp_path):
    run = train_copy_with_trainer(tmp_path)
    before, after = run["before"], run["after"]
    assert before["eval_exact_match"] == 0.0 and before["eval_loss"] > 3.0  # about ln 24 untrained
    assert before["eval_loss"] - after["eval_loss"] >= TRAINER_LOSS_FALL, (before, after)
    assert after["eval_exact_match"] >= TRAINER_MATCH, after
    assert learned(run, TRAINER_LOSS_FALL, TRAINER_MATCH)


@pytest.mark.parametrize("broken", ["learning_rate_0", "causal_mask_off", "decoder_inputs_are_labels"])
def test_broken_training_misses_the_threshold(broken, tmp_path, monkeypatch):
    if broken == "causal_mask_off":
        monkeypatch.setattr(modeling_vaswani, "causal_mask", future_visible_mask)
    run = train_copy_with_trainer(tmp_path, learning_rate=0.0 if broken == "learning_rate_0" else 5e-3,
                                  decoder_inputs_are_labels=broken == "decoder_inputs_are_labels")
    before, after = run["before"], run["after"]
    assert not learned(run, TRAINER_LOSS_FALL, TRAINER_MATCH), (before, after)
    assert after["eval_exact_match"] < 0.5 * TRAINER_MATCH, after
    if broken == "learning_rate_0":
        assert after["eval_loss"] == pytest.approx(before["eval_loss"], rel=1e-6)
    else:  # the leak makes the training loss look like learning; generation, with no future to read, does not
        assert run["train_losses"][-1] < 0.5, run


# -- the training commands on a word-for-word task --------------------------------------------------------------------

NUMBERS = [("eins", "one"), ("zwei", "two"), ("drei", "three"), ("vier", "four"), ("fünf", "five"), ("sechs", "six"),
           ("sieben", "seven"), ("acht", "eight"), ("neun", "nine"), ("zehn", "ten"), ("elf", "eleven"),
           ("zwölf", "twelve")]


def number_pairs(seed: int, count: int) -> list[tuple[str, str]]:
    """(German, English) pairs of 3-7 number words, translated word for word."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        words = [rng.choice(NUMBERS) for _ in range(rng.randint(3, 7))]
        pairs.append((" ".join(de for de, _ in words), " ".join(en for _, en in words)))
    return pairs


@pytest.fixture(scope="module")
def numbers(tmp_path_factory):
    root = tmp_path_factory.mktemp("numbers")
    splits = {"train": number_pairs(0, 600), "validation": number_pairs(1, 64), "test": number_pairs(2, 64)}
    files = {name: write_jsonl(root / f"{name}.jsonl", pairs) for name, pairs in splits.items()}
    flags = ["--preset", "tiny", "--train_file", files["train"], "--validation_file", files["validation"],
             "--test_file", files["test"], "--cpu_bf16", "no", "--cache_dir", str(root / "cache"),
             "--lr_factor", "0.3", "--num_samples", "0"]
    return {"root": root, "flags": flags, **splits}


def validation_loss(model: VaswaniForConditionalGeneration, folder: Path, pairs) -> float:
    """The model's plain cross-entropy per target token on `pairs`, tokenized with the tokenizer saved in `folder`."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    batch = tokenizer([de for de, _ in pairs], text_target=[en for _, en in pairs], padding=True,
                      return_tensors="pt")
    batch["labels"] = batch["labels"].masked_fill(batch["labels"].eq(tokenizer.pad_token_id), -100)
    model.eval()
    with torch.no_grad():
        return model(**batch).loss.item()


def translations_match(folder: Path, pairs) -> float:
    """Share of the run's test translations (`test_translations.txt`, beam 4) equal to the reference."""
    hypotheses = (folder / "test_translations.txt").read_text(encoding="utf-8").splitlines()
    assert len(hypotheses) == len(pairs)
    return sum(hypothesis.strip() == reference for hypothesis, (_, reference) in zip(hypotheses, pairs)) / len(pairs)


def no_trainer_run(numbers, name: str) -> dict:
    from vaswani_training.train_no_trainer import run

    folder = numbers["root"] / name
    metrics, model = run(numbers["flags"] + ["--output_dir", str(folder), "--max_steps", "200", "--logging_steps",
                                             "20", "--checkpointing_steps", "0"])
    torch.manual_seed(1)  # an initial model of the run's config, as the run's own was before its first update
    initial = VaswaniForConditionalGeneration(model.config)
    log = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    return {"folder": folder, "metrics": metrics, "log": log,
            "initial_loss": validation_loss(initial, folder, numbers["validation"]),
            "loss": validation_loss(model, folder, numbers["validation"]),
            "exact_match": translations_match(folder, numbers["test"])}


@pytest.fixture(scope="module")
def no_trainer(numbers):
    return no_trainer_run(numbers, "no_trainer")


def test_no_trainer_loop_learns(no_trainer):
    run = no_trainer
    assert run["initial_loss"] - run["loss"] >= NO_TRAINER_LOSS_FALL, run
    assert run["exact_match"] >= NO_TRAINER_MATCH, run
    assert run["metrics"]["test_bleu"] >= NO_TRAINER_BLEU and run["metrics"]["test_sentences"] == 64


def test_no_trainer_loop_with_learning_rate_0_misses_the_threshold(numbers, monkeypatch):
    import vaswani_training.train_no_trainer as loop

    original = loop.paper_optimizer_and_schedule

    def frozen(*args, **kwargs):  # the schedule's every rate times 0: the weights never move
        optimizer, scheduler = original(*args, **kwargs)
        scheduler.base_lrs = [0.0] * len(scheduler.base_lrs)
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        return optimizer, scheduler

    monkeypatch.setattr(loop, "paper_optimizer_and_schedule", frozen)
    run = no_trainer_run(numbers, "no_trainer_lr0")
    assert {entry["learning_rate"] for entry in run["log"]} == {0.0}
    assert run["initial_loss"] - run["loss"] < NO_TRAINER_LOSS_FALL and run["exact_match"] < NO_TRAINER_MATCH, run
    assert run["metrics"]["test_bleu"] < NO_TRAINER_BLEU
    assert run["loss"] == pytest.approx(run["initial_loss"], rel=1e-6)  # the same init: the same untrained model


def continued_run(numbers, name: str, *start: str) -> dict:
    from vaswani_training.train import main

    folder = numbers["root"] / name
    metrics = main(numbers["flags"] + ["--output_dir", str(folder), *start, "--max_steps", "150", "--logging_steps",
                                       "10", "--logging_first_step", "true", "--eval_strategy", "no",
                                       "--save_strategy", "no", "--disable_tqdm", "true"])
    model = VaswaniForConditionalGeneration.from_pretrained(folder)
    return {"folder": folder, "metrics": metrics, "loss": validation_loss(model, folder, numbers["validation"]),
            "exact_match": translations_match(folder, numbers["test"])}


def test_train_continues_a_saved_model(numbers, no_trainer):
    start = no_trainer
    run = continued_run(numbers, "continued", "--model_name_or_path", str(start["folder"]))
    assert run["loss"] <= CONTINUED_LOSS_RATIO * start["loss"], (start["loss"], run["loss"])
    assert run["exact_match"] >= CONTINUED_MATCH and run["exact_match"] > start["exact_match"], run
    assert run["metrics"]["test_bleu"] > start["metrics"]["test_bleu"]


def test_train_from_a_fresh_model_misses_the_continued_threshold(numbers, no_trainer):
    """The control of the continuation: the same 150 steps from a fresh preset model (what an ignored
    --model_name_or_path would give)."""
    run = continued_run(numbers, "fresh")
    assert run["exact_match"] < CONTINUED_MATCH and run["loss"] > CONTINUED_LOSS_RATIO * no_trainer["loss"], run
