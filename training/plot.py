"""Pictures of a model and of its training.

    vaswani-plot attention --model_dir outputs/multi30k-de-en --source "Ein Hund läuft am Strand." \\
        --target "A dog runs along the beach." --layer 6 --output_dir pictures/
    vaswani-plot attention --model_dir outputs/multi30k-de-en --source "Ein Hund läuft am Strand." --num_beams 4 \\
        --output_dir pictures/            # attention behind the model's own translation
    vaswani-plot positions --model_dir outputs/multi30k-de-en --source "Ein Hund läuft am Strand." \\
        --output pictures/positions.png
    vaswani-plot curve --trainer_state outputs/multi30k-de-en --output pictures/curve.png

`attention` writes three PNGs for one layer (encoder self-attention, decoder self-attention, encoder-decoder
attention), each a grid of per-head heatmaps with the subwords on the axes, as in the paper's Figures 3-5; the
decoder's rows are labelled with the output token each predicts. `positions` draws the positional encoding (§3.5) of
a sentence's positions (or of `--positions N`). The demo page (`vaswani-demo`) shows the same pictures, drawn by the
same code (`vaswani_hf.pictures`).
`curve` draws the training loss, validation loss, validation BLEU and learning rate against the step from the
`log_history` of a Trainer's `trainer_state.json` (give the file, a run's output_dir or a checkpoint folder).
Needs matplotlib.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python training/plot.py): import as vaswani_training
    __package__ = "vaswani_training"


def find_trainer_state(path: str | Path) -> Path:
    """`path` itself if it is a file; else `path/trainer_state.json`; else the newest checkpoint's.

    Raises:
        FileNotFoundError: none of these exists.
    """
    from vaswani_hf.averaging import find_checkpoints

    path = Path(path)
    if path.is_file():
        return path
    if (path / "trainer_state.json").is_file():
        return path / "trainer_state.json"
    if path.is_dir():
        for checkpoint in reversed(find_checkpoints(path)):
            if (checkpoint / "trainer_state.json").is_file():
                return checkpoint / "trainer_state.json"
    raise FileNotFoundError(f"No trainer_state.json at {path} (nor in a checkpoint-<step> folder under it). The "
                            "Trainer writes one into every checkpoint.")


def learning_curve_data(log_history: list[dict], metric: str = "bleu") -> dict[str, list[tuple[int, float]]]:
    """Series of `(step, value)` from a Trainer `log_history`.

    Returns:
        `{"train_loss": ..., "eval_loss": ..., f"eval_{metric}": ..., "learning_rate": ...}`, each sorted by step;
        series that were never logged are empty. The end-of-training summary (`train_loss` averaged over the run)
        is not a point of the curve and is left out.
    Raises:
        ValueError: `log_history` is not a list of dicts.
    """
    if not isinstance(log_history, list) or not all(isinstance(entry, dict) for entry in log_history):
        raise ValueError("log_history must be a list of dicts (trainer_state.json's 'log_history').")
    keys = {"train_loss": "loss", "eval_loss": "eval_loss", f"eval_{metric}": f"eval_{metric}",
            "learning_rate": "learning_rate"}
    series: dict[str, list[tuple[int, float]]] = {name: [] for name in keys}
    for entry in log_history:
        if "step" not in entry:
            continue
        for name, key in keys.items():
            value = entry.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                series[name].append((int(entry["step"]), float(value)))
    return {name: sorted(points) for name, points in series.items()}


def plot_learning_curve(trainer_state: str | Path, output: str | Path, metric: str = "bleu") -> Path:
    """Draw the learning curve of a run to a PNG: losses, validation `metric` and learning rate against the step.

    Raises:
        FileNotFoundError: no trainer_state.json. ValueError: it has no logged losses or metrics to draw.
    """
    from vaswani_hf.pictures.attention import new_figure, save_figure

    state_path = find_trainer_state(trainer_state)
    from vaswani_hf.checks import read_json

    state = read_json(state_path)  # an error naming the file if it does not parse
    if not isinstance(state, dict) or not isinstance(state.get("log_history", []), list):
        raise ValueError(f"{state_path}: expected the JSON object the Trainer writes, with a 'log_history' list of "
                         f"logged steps; got {type(state).__name__}" + ("" if not isinstance(state, dict) else
                         f" with a 'log_history' {type(state['log_history']).__name__}") +
                         ". Pass a checkpoint's trainer_state.json or the run's folder.")
    try:
        data = learning_curve_data(state.get("log_history", []), metric)
    except ValueError as error:
        raise ValueError(f"{state_path}: {error}") from None
    score = f"eval_{metric}"
    panels = [("loss", ["train_loss", "eval_loss"]), (metric.upper() if metric == "bleu" else metric, [score]),
              ("learning rate", ["learning_rate"])]
    panels = [(title, [name for name in names if data[name]]) for title, names in panels]
    panels = [(title, names) for title, names in panels if names]
    if not panels:
        raise ValueError(f"{state_path} has no logged losses, {score} or learning rates to draw (log_history is "
                         "empty: set logging_steps / eval_strategy when training).")
    figure = new_figure(figsize=(5.0 * len(panels), 3.8), layout="constrained")
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    labels = {"train_loss": "training loss", "eval_loss": "validation loss", score: f"validation {metric}",
              "learning_rate": "learning rate"}
    for ax, (title, names) in zip(axes, panels):
        for name in names:
            steps, values = zip(*data[name])
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=labels[name])
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if names == ["learning_rate"]:
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        if len(names) > 1:
            ax.legend()
    figure.suptitle(f"{state_path.parent.name}: learning curve", fontsize=11)
    return save_figure(figure, output)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    attention = commands.add_parser("attention", help="Per-head attention heatmaps of one layer for one sentence.")
    attention.add_argument("--model_dir", "--model", required=True, help="A saved model folder with its tokenizer.")
    attention.add_argument("--source", required=True, help="The source sentence.")
    attention.add_argument("--target", default=None,
                           help="A target sentence (teacher-forced). Default: the model's own translation.")
    attention.add_argument("--layer", type=int, default=None,
                           help="Layer to draw, 1..N (default N, the last), as the paper numbers them.")
    attention.add_argument("--num_beams", type=int, default=1,
                           help="Without --target: 1 translates greedily (default), more uses beam search with the "
                                "paper's GNMT length penalty.")
    attention.add_argument("--output_dir", required=True, help="Folder for the three PNGs.")
    attention.add_argument("--prefix", default="attention", help="File name prefix (default 'attention').")

    positions = commands.add_parser("positions", help="The positional encoding (§3.5) of a sentence's positions.")
    positions.add_argument("--model_dir", "--model", required=True,
                           help="A saved model folder (with its tokenizer for --source).")
    group = positions.add_mutually_exclusive_group(required=True)
    group.add_argument("--source", help="A source sentence: its tokens label the positions.")
    group.add_argument("--positions", type=int, help="Draw positions 0 .. N - 1 instead of a sentence's.")
    positions.add_argument("--output", required=True, help="The PNG to write.")

    curve = commands.add_parser("curve", help="Learning curve from a Trainer's trainer_state.json.")
    curve.add_argument("--trainer_state", required=True,
                       help="trainer_state.json, or a run's output_dir / a checkpoint folder holding one.")
    curve.add_argument("--output", required=True, help="The PNG to write.")
    curve.add_argument("--metric", default="bleu", help="Validation metric to draw, logged as eval_<metric> "
                                                        "(default bleu).")
    return parser


def _model_folder(path: str) -> Path:
    """`--model_dir`, checked: a saved model folder whose config, JSON files, weights and tokenizer fit together."""
    from vaswani_hf.checks import check_model_folder

    model_dir = Path(path)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a saved model folder (no config.json).")
    check_model_folder(model_dir)
    return model_dir


def _attention(args) -> list[Path]:
    from transformers import AutoTokenizer

    from vaswani_hf import VaswaniForConditionalGeneration
    from vaswani_hf.checks import check_output_dir, check_output_not_in_inputs
    from vaswani_hf.pictures.attention import attention_maps, plot_all_attention

    if args.num_beams < 1:
        raise ValueError(f"--num_beams must be >= 1, got {args.num_beams}.")
    model_dir = _model_folder(args.model_dir)
    check_output_not_in_inputs(args.output_dir, [model_dir], allow_inside=True)  # plots beside the model are fine
    check_output_dir(args.output_dir)
    model = VaswaniForConditionalGeneration.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    num_layers = min(model.config.encoder_layers, model.config.decoder_layers)
    layer = num_layers if args.layer is None else args.layer
    if not 1 <= layer <= num_layers:
        raise ValueError(f"--layer must be between 1 and {num_layers}, got {layer}.")
    maps = attention_maps(model, tokenizer, args.source, args.target, layer=layer - 1, num_beams=args.num_beams)
    return plot_all_attention(maps, args.output_dir, prefix=args.prefix)


def _positions(args) -> Path:
    from transformers import AutoTokenizer

    from vaswani_hf import VaswaniForConditionalGeneration
    from vaswani_hf.pictures.attention import save_figure
    from vaswani_hf.pictures.positions import positional_encoding_figure

    if args.positions is not None and not 1 <= args.positions <= 1000:
        raise ValueError(f"--positions must be between 1 and 1000, got {args.positions}.")
    if args.source is not None and not args.source.strip():
        raise ValueError("--source is empty: give a sentence, or --positions N.")
    model_dir = _model_folder(args.model_dir)
    model = VaswaniForConditionalGeneration.from_pretrained(model_dir).eval()
    if args.source is not None:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        tokens = tokenizer.convert_ids_to_tokens(tokenizer(args.source)["input_ids"])
    else:
        tokens = [""] * args.positions
    return save_figure(positional_encoding_figure(model, tokens), args.output)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "attention":
            paths = _attention(args)
        elif args.command == "positions":
            paths = [_positions(args)]
        else:
            paths = [plot_learning_curve(args.trainer_state, args.output, args.metric)]
    except (ValueError, FileNotFoundError, ImportError) as error:
        raise SystemExit(f"error: {error}") from None
    for path in paths:
        print(f"Wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
