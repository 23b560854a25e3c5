"""Table 3 of the paper on two CPU cores: the variations of the base model, at the `cpu` preset's scale on Multi30k.

    vaswani-ablate --output_dir outputs/table3                      # the default rows, 4 minutes each
    vaswani-ablate --output_dir outputs/table3 --rows all --minutes 6

Each row is `vaswani-train` (a process of its own) with one change to the `cpu` preset (d_model 256, 3+3 layers, 4
heads, d_ff 1024, dropout and label smoothing 0.1, sinusoidal positions) and the same time budget for the whole
command (`--time_budget_minutes`, the planner fitting the steps to it, with `--skip_test`: nothing is chosen by
looking at test2016). Then it scores the row's model on the whole validation split, as Table 3 does on newstest2013:
perplexity per target subword (teacher-forced, no label smoothing) and detokenized sacreBLEU of beam 4 with length
penalty 0.6, no checkpoint averaging.

The rows (the paper's labels; `--rows` picks some, `all` every one):

    base      the cpu preset
    A1, A16   (A) 1 head of d_k 256, 16 heads of d_k 16: the number of heads at constant computation
    C2, C_ff  (C) 2 + 2 layers; d_ff 2048
    D0, D02   (D) dropout 0.0, 0.2
    LS0       (D) label smoothing 0.0
    E         (E) learned positional embeddings instead of sinusoids

Row (B), a smaller d_k at a fixed number of heads, is not among them: the model's heads are d_model / num_heads wide.
A row whose `table3_row.json` exists is done and not run again, so a stopped run resumes with the next row (a row
cut off is run again from its start). At the end it writes `table3.json`, `table3.md` (the table, each row's command)
and `table3.png` into `--output_dir`. Arguments after `--` go to every row's `vaswani-train`.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python training/ablate.py): import as vaswani_training
    __package__ = "vaswani_training"

# row -> (Table 3 group, what changes, --config_overrides, other vaswani-train arguments)
ROWS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "base": ("base", "the cpu preset", "", ()),
    "A1": ("A", "1 head, d_k = d_v = 256", "num_heads=1", ()),
    "A16": ("A", "16 heads, d_k = d_v = 16", "num_heads=16", ()),
    "C2": ("C", "N = 2 layers per stack", "encoder_layers=2,decoder_layers=2", ()),
    "C_ff": ("C", "d_ff = 2048", "d_ff=2048", ()),
    "D0": ("D", "P_drop = 0.0", "dropout=0.0", ()),
    "D02": ("D", "P_drop = 0.2", "dropout=0.2", ()),
    "LS0": ("D", "epsilon_ls = 0.0", "", ("--label_smoothing_factor", "0.0")),
    "E": ("E", "learned positional embeddings", "position_embedding_type=learned", ()),
}
DEFAULT_ROWS = ("base", "A1", "A16", "D0", "LS0", "E")
ROW_FILE = "table3_row.json"
# what table3.md reads of each row
ROW_FIELDS = {"row", "group", "change", "parameters", "train_steps", "validation_ppl", "validation_bleu",
              "validation_length_ratio", "command"}
# The row of the paper's Table 3 (newstest2013 dev; base: N 6, d_model 512, d_ff 2048, h 8, d_k 64) that each row
# mirrors, with its perplexity and BLEU: the same change relative to the base model
PAPER_ROWS = {"base": ("base", 4.92, 25.8), "A1": ("h 1, d_k 512", 5.29, 24.9), "A16": ("h 32, d_k 16", 5.01, 25.4),
              "C2": ("N 2", 6.11, 23.7), "C_ff": ("d_ff 4096", 4.75, 26.2), "D0": ("P_drop 0.0", 5.77, 24.6),
              "D02": ("P_drop 0.2", 4.95, 25.5), "LS0": ("epsilon_ls 0.0", 4.67, 25.3),
              "E": ("positional embedding", 4.92, 25.7)}


def parse_rows(text: str) -> list[str]:
    """`"base,A1"` or `"all"` -> the row names, in the table's order.

    Raises:
        ValueError: an unknown row (the message lists them).
    """
    if text.strip() == "all":
        return list(ROWS)
    rows = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in rows if name not in ROWS]
    if unknown or not rows:
        raise ValueError(f"--rows: unknown row(s) {', '.join(unknown) or '(none given)'}; choose from "
                         f"{', '.join(ROWS)} or all.")
    return [name for name in ROWS if name in rows]


def row_command(name: str, output_dir: Path, minutes: float, extra: list[str]) -> list[str]:
    """The `vaswani-train` command line of row `name`, its process started with this Python."""
    _, _, overrides, arguments = ROWS[name]
    command = [sys.executable, "-m", "vaswani_training.train", "--output_dir", str(output_dir / name),
               "--overwrite_output_dir", "--time_budget_minutes", f"{minutes:g}", "--skip_test", "--num_samples", "0",
               *arguments]
    if overrides:
        command += ["--config_overrides", overrides]
    return command + list(extra)


def _validation(max_sentences: int | None) -> tuple[list[str], list[str]]:
    from vaswani_hf.data import multi30k_file, read_lines

    sources = read_lines(multi30k_file("validation", "de"))
    references = read_lines(multi30k_file("validation", "en"))
    return sources[:max_sentences], references[:max_sentences]


def validation_scores(model_dir: Path, max_sentences: int | None = None, batch_size: int = 64) -> dict:
    """Perplexity and BLEU of the model in `model_dir` on Multi30k's validation split (German -> English).

    Returns:
        `{"validation_ppl", "validation_bleu", "validation_length_ratio", "validation_sentences"}`: perplexity is
        exp of the mean cross-entropy per target subword (`</s>` included, teacher-forced, no label smoothing); BLEU
        is detokenized sacreBLEU of beam 4, length penalty 0.6; the length ratio is hypothesis / reference length.
    """
    import torch
    from transformers import AutoTokenizer

    from vaswani_hf import VaswaniForConditionalGeneration
    from vaswani_hf.bleu import compute_bleu
    from vaswani_hf.decoding.translate import translate_sentences

    model = VaswaniForConditionalGeneration.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sources, references = _validation(max_sentences)
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(sources), batch_size):
            batch = tokenizer(sources[start:start + batch_size], text_target=references[start:start + batch_size],
                              padding=True, return_tensors="pt")
            labels = batch["labels"].masked_fill(batch["labels"] == tokenizer.pad_token_id, -100)
            loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
            tokens = int(labels.ne(-100).sum())
            total, count = total + float(loss) * tokens, count + tokens
    hypotheses = translate_sentences(model, tokenizer, sources, batch_size=batch_size, num_beams=4,
                                     length_penalty=0.6)
    scores = compute_bleu(hypotheses, references, target_lang="en", with_paper_bleu=False)
    return {"validation_ppl": round(math.exp(total / count), 3), "validation_bleu": round(scores["bleu"], 2),
            "validation_length_ratio": round(scores["sys_len"] / scores["ref_len"], 3),
            "validation_sentences": len(sources)}


def _run_child(command: list[str], log) -> int:
    """Run `command` with its output into `log` and return its exit status. SIGTERM or Ctrl-C to this process is
    passed on to the child (a vaswani-train saves a checkpoint and stops), which is waited for, then re-raised: a
    stopped ablation leaves no training running on its own."""
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        return process.wait()
    except BaseException:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _done_row(path: Path) -> dict | None:
    """A finished row's `table3_row.json`, or `None` where the file is damaged (cut short, empty, not an object or
    without a field of the table): the row is then run again, as a row that never finished."""
    try:
        row = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return row if isinstance(row, dict) and ROW_FIELDS <= set(row) else None


def run_row(name: str, output_dir: Path, minutes: float, extra: list[str], max_sentences: int | None) -> dict:
    """Train row `name` in a process of its own, score it, and write its `table3_row.json` (atomically) last.

    Raises:
        RuntimeError: the training process failed (its exit status and log file named).
    """
    from .lib.output_dir import write_json_atomic

    folder = output_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    command = row_command(name, output_dir, minutes, extra)
    log = output_dir / f"{name}.log"
    started = time.monotonic()
    with open(log, "w", encoding="utf-8") as handle:
        status = _run_child(command, handle)
    if status != 0:
        raise RuntimeError(f"row {name}: vaswani-train exited with status {status}; see {log}.")
    seconds = time.monotonic() - started
    from vaswani_hf.checks import read_json

    metrics = read_json(folder / "metrics.json")  # an error naming the file if it does not parse
    if not isinstance(metrics, dict):
        raise RuntimeError(f"row {name}: {folder / 'metrics.json'} is not a JSON object of metrics; see {log}.")
    group, change, _, _ = ROWS[name]
    row = {"row": name, "group": group, "change": change, "parameters": metrics.get("parameters"),
           "train_steps": metrics.get("train_steps"), "train_minutes": metrics.get("train_minutes"),
           "precision": metrics.get("precision"), "command_minutes": round(seconds / 60, 2),
           **validation_scores(folder, max_sentences),
           "command": " ".join(["vaswani-train", *command[3:]])}
    write_json_atomic(folder / ROW_FILE, row)
    return row


def table_markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table beside the rows of the paper's Table 3 that they mirror (newstest2013, the base
    model's 100K steps), each row's command below."""
    lines = ["| row | change | parameters | steps | validation PPL | validation BLEU | length ratio | "
             "paper's row | its PPL (dev) | its BLEU (dev) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        paper, ppl, bleu = PAPER_ROWS[row["row"]]
        label = row["row"] if row["group"] == "base" else f"({row['group']}) {row['row']}"
        lines.append(f"| {label} | {row['change']} | {row['parameters']:,} | "
                     f"{row['train_steps']:,} | {row['validation_ppl']:.2f} | {row['validation_bleu']:.2f} | "
                     f"{row['validation_length_ratio']:.3f} | {paper} | {ppl} | {bleu} |")
    lines.append("")
    lines += [f"- {row['row']}: `{row['command']}`" for row in rows]
    return "\n".join(lines) + "\n"


def plot_rows(rows: list[dict], path: Path) -> Path:
    """Validation BLEU and perplexity per row, two bar charts, to a PNG."""
    from vaswani_hf.pictures.attention import new_figure, save_figure

    figure = new_figure(figsize=(max(6.0, 1.1 * len(rows) + 2), 3.6), layout="constrained")
    bleu, ppl = figure.subplots(1, 2)
    names = [row["row"] for row in rows]
    bleu.bar(names, [row["validation_bleu"] for row in rows], color="tab:blue")
    bleu.set_title("validation BLEU (beam 4)", fontsize=10)
    ppl.bar(names, [row["validation_ppl"] for row in rows], color="tab:orange")
    ppl.set_title("validation perplexity", fontsize=10)
    figure.suptitle("Table 3 at the cpu preset's scale, Multi30k, one time budget per row", fontsize=11)
    return save_figure(figure, path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True, help="A folder for the rows' runs and the table.")
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                        help=f"Rows to run, comma-separated, or all (default {','.join(DEFAULT_ROWS)}).")
    parser.add_argument("--minutes", type=float, default=4.0,
                        help="The time budget of each row's whole vaswani-train command (default 4).")
    parser.add_argument("--validation_sentences", type=int, default=None,
                        help="Score the first N validation sentences only (default all 1,014).")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = build_parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    try:
        rows = parse_rows(args.rows)
        if not args.minutes > 0:
            raise ValueError(f"--minutes must be positive, got {args.minutes}.")
        if args.validation_sentences is not None and args.validation_sentences < 1:
            raise ValueError(f"--validation_sentences must be >= 1, got {args.validation_sentences}.")
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    from vaswani_hf.checks import replace_file_atomically

    from .lib.output_dir import write_json_atomic

    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for name in rows:
        done = output_dir / name / ROW_FILE
        if done.is_file():
            row = _done_row(done)
            if row is not None:
                print(f"row {name}: done earlier ({done})")
                results.append(row)
                continue
            print(f"row {name}: {done} is damaged (cut short, empty or not the row's fields): running the row again")
        print(f"row {name}: {ROWS[name][1]} ({args.minutes:g} minutes) ...", flush=True)
        try:
            results.append(run_row(name, output_dir, args.minutes, extra, args.validation_sentences))
        except (RuntimeError, ValueError) as error:  # CheckError is a ValueError
            raise SystemExit(f"error: {error}") from None
        except KeyboardInterrupt as stop:  # SIGTERM or Ctrl-C: the row's vaswani-train was stopped and waited for
            raise SystemExit(f"stopped ({stop or 'Ctrl-C'}) during row {name}, whose training was stopped with "
                             f"it; the same command resumes from this row.") from None
        row = results[-1]
        print(f"row {name}: {row['train_steps']} steps, validation perplexity {row['validation_ppl']:.2f}, "
              f"BLEU {row['validation_bleu']:.2f}", flush=True)
    write_json_atomic(output_dir / "table3.json", results)
    table = table_markdown(results)
    replace_file_atomically(output_dir / "table3.md", lambda tmp: Path(tmp).write_text(table, encoding="utf-8"))
    plot_rows(results, output_dir / "table3.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
