"""Pictures of attention, as in the paper's Figures 3-5: for one sentence pair and one layer, the attention weights of
every head of the encoder self-attention, the decoder (masked) self-attention and the encoder-decoder attention,
drawn as heatmaps with the subword tokens on the axes.

`attention_maps` computes the weights (no drawing; usable without matplotlib); `plot_attention` draws one
kind as a grid of per-head heatmaps to a PNG. matplotlib is an optional dependency, imported only when drawing
(`pip install matplotlib` or `pip install 'vaswani-hf[train]'`); drawing uses the Agg backend and no pyplot
state, so it works on machines without a display.

Rows are queries, columns keys. A decoder position reads the token before it (`<s>` first) and predicts the next
one, so the rows of the decoder self-attention and of the encoder-decoder attention are labelled with the output
token each row predicts, and the decoder self-attention's columns with the decoder input each key position read.
`attention_figure` draws every picture of the package, here and on the demo page: head numbers, token ticks, the
names of both axes and one colour scale for all heads. The subword marker "▁" (a token that starts a word) is shown
as it is, everywhere.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checks import replace_file_atomically

ATTENTION_KINDS = ("encoder", "decoder", "cross")
KIND_TITLES = {"encoder": "encoder self-attention", "decoder": "decoder self-attention",
               "cross": "encoder-decoder attention"}
# (rows, columns) of each kind: rows are queries, columns keys
AXIS_NAMES = {"encoder": ("source token (query)", "source token (key)"),
              "decoder": ("predicting the output token (query)", "decoder input (key)"),
              "cross": ("predicting the output token (query)", "source token (key)")}
NOT_PREDICTED = "…"  # the row label of a decoder position whose prediction the sequence does not hold

__all__ = ["ATTENTION_KINDS", "AXIS_NAMES", "KIND_TITLES", "AttentionMaps", "attention_figure", "attention_maps",
           "attention_weights", "decoder_rows", "new_figure", "plot_all_attention", "plot_attention",
           "predicted_token_labels", "save_figure"]


@dataclass
class AttentionMaps:
    """Attention weights of one layer for one sentence pair.

    Attributes:
        source_tokens: the `S` source subwords (ending in `</s>`).
        target_tokens: the `T` decoder input subwords (`<s>` then the target without `</s>`).
        layer: 0-based layer index; num_layers: layers in the stack.
        encoder: `(H, S, S)`; decoder: `(H, T, T)` (zero above the diagonal); cross: `(H, T, S)`. Every row
            is a probability distribution over the keys.
        predicted_tokens: the `T` output tokens the decoder rows predict (`target_tokens` shifted by one, `</s>`
            last; `NOT_PREDICTED` for a last row whose prediction the sequence does not hold); `None`: unknown, the
            rows are labelled with `target_tokens`.
    """

    source_tokens: list[str]
    target_tokens: list[str]
    layer: int
    num_layers: int
    encoder: torch.Tensor
    decoder: torch.Tensor
    cross: torch.Tensor
    predicted_tokens: list[str] | None = None

    def __getitem__(self, kind: str) -> torch.Tensor:
        if kind not in ATTENTION_KINDS:
            raise KeyError(f"Unknown attention kind {kind!r}; choose one of {', '.join(ATTENTION_KINDS)}.")
        return getattr(self, kind)

    def axes(self, kind: str) -> tuple[list[str], list[str]]:
        """(row labels, column labels) of `kind`: decoder rows by the output token they predict, where known."""
        rows = self.predicted_tokens if self.predicted_tokens is not None else self.target_tokens
        return {"encoder": (self.source_tokens, self.source_tokens),
                "decoder": (rows, self.target_tokens),
                "cross": (rows, self.source_tokens)}[kind]


def decoder_rows(ids: list[int], eos_token_id: int) -> tuple[list[int], list[int | None]]:
    """The decoder inputs of a sequence `ids` (start token first, `</s>` last where it ended) and the token each
    input position predicts: `ids` without its `</s>` (never an input), and `ids[1:]`, with `None` for a last position
    whose prediction `ids` does not hold (a sequence cut off before `</s>`)."""
    inputs = ids[:-1] if len(ids) > 1 and ids[-1] == eos_token_id else list(ids)
    predicted: list[int | None] = list(ids[1:])
    return inputs, predicted + [None] * (len(inputs) - len(predicted))


def predicted_token_labels(tokenizer, ids: list[int | None]) -> list[str]:
    """The row labels of `decoder_rows`' predictions: their tokens, `NOT_PREDICTED` for `None`."""
    return [NOT_PREDICTED if i is None else tokenizer.convert_ids_to_tokens(i) for i in ids]


def _layer_index(layer: int, num_layers: int) -> int:
    if not -num_layers <= layer < num_layers:
        raise ValueError(f"layer {layer} does not exist: the model has {num_layers} layers (0..{num_layers - 1}, or "
                         "negative indices from the end).")
    return layer % num_layers


@torch.no_grad()
def attention_weights(model, input_ids: torch.LongTensor, decoder_input_ids: torch.LongTensor,
                      layer: int = -1) -> dict[str, torch.Tensor]:
    """Teacher-forced attention weights of one sentence pair in one layer.

    Args:
        model: a `VaswaniForConditionalGeneration` (dropout is off only in `eval()` mode).
        input_ids: `(S,)` or `(1, S)` source ids, no padding.
        decoder_input_ids: `(T,)` or `(1, T)` decoder input ids (start token first).
        layer: 0-based layer index (negative counts from the end; default the last layer).
    Returns:
        `{"encoder": (H, S, S), "decoder": (H, T, T), "cross": (H, T, S)}` float32 tensors on the CPU.
    Raises:
        ValueError: a batch of more than one sentence, or a layer the model does not have.
    """
    input_ids = input_ids.reshape(1, -1) if input_ids.dim() == 1 else input_ids
    decoder_input_ids = decoder_input_ids.reshape(1, -1) if decoder_input_ids.dim() == 1 else decoder_input_ids
    if input_ids.shape[0] != 1 or decoder_input_ids.shape[0] != 1:
        raise ValueError("attention_weights: pass one sentence pair (batch size 1).")
    config = model.config
    encoder_layer = _layer_index(layer, config.encoder_layers)
    decoder_layer = _layer_index(layer, config.decoder_layers)
    device = next(model.parameters()).device
    out = model(input_ids=input_ids.to(device), decoder_input_ids=decoder_input_ids.to(device),
                output_attentions=True, use_cache=False)
    return {
        "encoder": out.encoder_attentions[encoder_layer][0].float().cpu(),
        "decoder": out.decoder_attentions[decoder_layer][0].float().cpu(),
        "cross": out.cross_attentions[decoder_layer][0].float().cpu(),
    }


@torch.no_grad()
def attention_maps(model, tokenizer, source: str, target: str | None = None, layer: int = -1,
                   num_beams: int = 1) -> AttentionMaps:
    """Attention weights for `source` and either a given `target` or the model's own translation.

    Args:
        model: a `VaswaniForConditionalGeneration`; put it in `eval()` mode.
        tokenizer: its tokenizer (sources and targets end in `</s>`).
        source: the source sentence.
        target: a reference translation; `None` translates `source` with
            `vaswani_hf.decoding.paper_generate` (greedy for `num_beams=1`, else beam search with the GNMT
            penalty) and shows the attention that produced it.
        layer: 0-based layer (default the last).
    Returns:
        `AttentionMaps`.
    Raises:
        ValueError: an empty source, a layer the model does not have.
    """
    if not isinstance(source, str) or not source.strip():
        raise ValueError("attention_maps: the source sentence is empty.")
    input_ids = torch.tensor([tokenizer(source)["input_ids"]])
    start, eos = model.config.decoder_start_token_id, model.config.eos_token_id
    if target is None:
        from ..decoding.paper import paper_generate

        device = next(model.parameters()).device
        generated = paper_generate(model, input_ids.to(device), num_beams=num_beams)[0].cpu()
        sequence = generated[generated.ne(model.config.pad_token_id)].tolist()
    else:
        sequence = [start] + tokenizer(text_target=target)["input_ids"]
    decoder_ids, predicted = decoder_rows(sequence, eos)  # </s> is never a decoder input
    weights = attention_weights(model, input_ids, torch.tensor(decoder_ids), layer)
    return AttentionMaps(
        source_tokens=tokenizer.convert_ids_to_tokens(input_ids[0].tolist()),
        target_tokens=tokenizer.convert_ids_to_tokens(decoder_ids),
        layer=_layer_index(layer, model.config.decoder_layers),
        num_layers=model.config.decoder_layers,
        predicted_tokens=predicted_token_labels(tokenizer, predicted),
        **weights,
    )


def new_figure(**kwargs):
    """A matplotlib `Figure` (no pyplot, no display needed); `kwargs` go to `Figure`.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("Drawing needs matplotlib: pip install matplotlib (or pip install 'vaswani-hf[train]')."
                          ) from error
    return Figure(**kwargs)


def save_figure(figure, path: str | os.PathLike, dpi: int = 100) -> Path:
    """Write a matplotlib `Figure` to `path` as PNG, atomically (temporary file beside it, then renamed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure)
    return replace_file_atomically(path, lambda tmp: figure.savefig(tmp, format="png", dpi=dpi, bbox_inches="tight"))


def attention_figure(maps: AttentionMaps, kind: str, heads: list[int] | None = None, heads_per_row: int = 4,
                     cmap: str = "viridis"):
    """One kind of attention of `maps` as a matplotlib `Figure`: a heatmap per head, titled "head h" (1-based), the
    tokens on both axes (`AttentionMaps.axes`), the axes named (`AXIS_NAMES`), and one colour bar from 0 to the
    largest weight of the figure, the same for every head so that they compare. What `vaswani-plot attention` and
    the demo page draw.

    Args:
        maps: from `attention_maps` (or the demo's `hypothesis_attention`).
        kind: `"encoder"`, `"decoder"` or `"cross"`.
        heads: 0-based heads to draw (default all), `heads_per_row` to a row.
    Raises:
        KeyError: an unknown kind. IndexError: a head the model does not have. ImportError: matplotlib is missing.
    """
    weights = maps[kind].numpy()  # (H, rows, cols)
    heads = list(range(weights.shape[0])) if heads is None else list(heads)
    for head in heads:
        if not 0 <= head < weights.shape[0]:
            raise IndexError(f"head {head + 1} does not exist: the model has {weights.shape[0]} heads.")
    rows, cols = maps.axes(kind)
    row_name, col_name = AXIS_NAMES[kind]
    ncols = min(heads_per_row, len(heads))
    nrows = math.ceil(len(heads) / ncols)
    cell_w = min(max(3.0, 0.22 * len(cols) + 1.2), 9.0)  # long sentences: smaller labels, not a wider page
    cell_h = min(max(2.8, 0.22 * len(rows) + 1.2), 9.0)
    figure = new_figure(figsize=(cell_w * ncols + 1.0, cell_h * nrows + 0.9), layout="constrained")
    vmax = max(float(weights[heads].max()), 1e-6)
    axes = figure.subplots(nrows, ncols, squeeze=False)
    image = None
    longest = max(len(rows), len(cols))
    fontsize = 8 if longest <= 30 else 6 if longest <= 45 else 4
    for slot in range(nrows * ncols):
        ax = axes[slot // ncols][slot % ncols]
        if slot >= len(heads):
            ax.axis("off")
            continue
        head = heads[slot]
        image = ax.imshow(weights[head], vmin=0.0, vmax=vmax, cmap=cmap, aspect="auto", interpolation="nearest")
        ax.set_title(f"head {head + 1}", fontsize=10)
        ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=fontsize)
        ax.set_yticks(range(len(rows)), rows if slot % ncols == 0 else [], fontsize=fontsize)
        if slot % ncols == 0:
            ax.set_ylabel(row_name, fontsize=9)
        if slot // ncols == nrows - 1:
            ax.set_xlabel(col_name, fontsize=9)
    one = f", head {heads[0] + 1}" if len(heads) == 1 else ""
    figure.suptitle(f"{KIND_TITLES[kind]}, layer {maps.layer + 1} of {maps.num_layers}{one}", fontsize=11)
    figure.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="attention weight")
    return figure


def plot_attention(maps: AttentionMaps, kind: str, path: str | os.PathLike, heads_per_row: int = 4,
                   cmap: str = "viridis", dpi: int = 100) -> Path:
    """Draw one kind of attention of `maps` (`attention_figure`: every head) and write it to a PNG.

    Args:
        maps: from `attention_maps`.
        kind: `"encoder"`, `"decoder"` or `"cross"`.
        path: the PNG to write (folders are created).
    Returns:
        `Path(path)`.
    Raises:
        KeyError: an unknown kind. ImportError: matplotlib is missing.
    """
    return save_figure(attention_figure(maps, kind, heads_per_row=heads_per_row, cmap=cmap), path, dpi=dpi)


def plot_all_attention(maps: AttentionMaps, output_dir: str | os.PathLike, prefix: str = "attention",
                       **kwargs) -> list[Path]:
    """`plot_attention` for the three kinds, to `output_dir/{prefix}_layer{L}_{kind}.png` (L 1-based)."""
    output_dir = Path(output_dir)
    return [plot_attention(maps, kind, output_dir / f"{prefix}_layer{maps.layer + 1}_{kind}.png", **kwargs)
            for kind in ATTENTION_KINDS]
