"""Pictures of attention, as in the paper's Figures 3-5: for one sentence pair and one layer, the attention weights of
every head of the encoder self-attention, the decoder (masked) self-attention and the encoder-decoder attention,
drawn as heatmaps with the subword tokens on the axes.

`attention_maps` computes the weights (no drawing; usable without matplotlib); `plot_attention` draws one
kind as a grid of per-head heatmaps to a PNG. matplotlib is an optional dependency, imported only when drawing
(`pip install matplotlib` or `pip install 'vaswani-hf[train]'`); drawing uses the Agg backend and no pyplot
state, so it works on machines without a display.

Rows are queries, columns keys. Decoder rows are labelled with the decoder *input* at that position (`<s>` and
the target without its `</s>`); row `t` is the state that predicts target token `t + 1`.
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

__all__ = ["ATTENTION_KINDS", "KIND_TITLES", "AttentionMaps", "attention_maps", "attention_weights", "new_figure",
           "plot_all_attention", "plot_attention", "save_figure"]


@dataclass
class AttentionMaps:
    """Attention weights of one layer for one sentence pair.

    Attributes:
        source_tokens: the `S` source subwords (ending in `</s>`).
        target_tokens: the `T` decoder input subwords (`<s>` then the target without `</s>`).
        layer: 0-based layer index; num_layers: layers in the stack.
        encoder: `(H, S, S)`; decoder: `(H, T, T)` (zero above the diagonal); cross: `(H, T, S)`. Every row
            is a probability distribution over the keys.
    """

    source_tokens: list[str]
    target_tokens: list[str]
    layer: int
    num_layers: int
    encoder: torch.Tensor
    decoder: torch.Tensor
    cross: torch.Tensor

    def __getitem__(self, kind: str) -> torch.Tensor:
        if kind not in ATTENTION_KINDS:
            raise KeyError(f"Unknown attention kind {kind!r}; choose one of {', '.join(ATTENTION_KINDS)}.")
        return getattr(self, kind)

    def axes(self, kind: str) -> tuple[list[str], list[str]]:
        """(row labels, column labels) of `kind`."""
        return {"encoder": (self.source_tokens, self.source_tokens),
                "decoder": (self.target_tokens, self.target_tokens),
                "cross": (self.target_tokens, self.source_tokens)}[kind]


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
        decoder_ids = generated[generated.ne(model.config.pad_token_id)]
    else:
        labels = tokenizer(text_target=target)["input_ids"]
        decoder_ids = torch.tensor([start] + labels)
    if decoder_ids[-1].item() == eos:  # </s> is never a decoder input
        decoder_ids = decoder_ids[:-1]
    weights = attention_weights(model, input_ids, decoder_ids, layer)
    return AttentionMaps(
        source_tokens=tokenizer.convert_ids_to_tokens(input_ids[0].tolist()),
        target_tokens=tokenizer.convert_ids_to_tokens(decoder_ids.tolist()),
        layer=_layer_index(layer, model.config.decoder_layers),
        num_layers=model.config.decoder_layers,
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


def plot_attention(maps: AttentionMaps, kind: str, path: str | os.PathLike, heads_per_row: int = 4,
                   cmap: str = "viridis", dpi: int = 100) -> Path:
    """Draw one kind of attention of `maps` as a grid of per-head heatmaps and write it to a PNG. The colour scale
    runs from 0 to the largest weight in the figure, the same for every head.

    Args:
        maps: from `attention_maps`.
        kind: `"encoder"`, `"decoder"` or `"cross"`.
        path: the PNG to write (folders are created).
    Returns:
        `Path(path)`.
    Raises:
        KeyError: an unknown kind. ImportError: matplotlib is missing.
    """
    weights = maps[kind].numpy()  # (H, rows, cols)
    rows, cols = maps.axes(kind)
    heads = weights.shape[0]
    ncols = min(heads_per_row, heads)
    nrows = math.ceil(heads / ncols)
    cell_w = max(2.5, 0.22 * len(cols) + 1.0)
    cell_h = max(2.5, 0.22 * len(rows) + 1.0)
    figure = new_figure(figsize=(cell_w * ncols + 1.0, cell_h * nrows + 0.8), layout="constrained")
    vmax = max(float(weights.max()), 1e-6)  # one scale for all heads of the figure, so they compare
    axes = figure.subplots(nrows, ncols, squeeze=False)
    image = None
    fontsize = 8 if max(len(rows), len(cols)) <= 30 else 6
    for head in range(nrows * ncols):
        ax = axes[head // ncols][head % ncols]
        if head >= heads:
            ax.axis("off")
            continue
        image = ax.imshow(weights[head], vmin=0.0, vmax=vmax, cmap=cmap, aspect="auto", interpolation="nearest")
        ax.set_title(f"head {head + 1}", fontsize=9)
        ax.set_xticks(range(len(cols)))
        ax.set_xticklabels(cols, rotation=90, fontsize=fontsize)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(rows if head % ncols == 0 else [], fontsize=fontsize)
    figure.suptitle(f"{KIND_TITLES[kind]}, layer {maps.layer + 1} of {maps.num_layers}", fontsize=11)
    figure.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="attention weight")
    return save_figure(figure, path, dpi=dpi)


def plot_all_attention(maps: AttentionMaps, output_dir: str | os.PathLike, prefix: str = "attention",
                       **kwargs) -> list[Path]:
    """`plot_attention` for the three kinds, to `output_dir/{prefix}_layer{L}_{kind}.png` (L 1-based)."""
    output_dir = Path(output_dir)
    return [plot_attention(maps, kind, output_dir / f"{prefix}_layer{maps.layer + 1}_{kind}.png", **kwargs)
            for kind in ATTENTION_KINDS]
