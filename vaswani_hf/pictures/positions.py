"""A picture of the positional encoding of §3.5, as the paper writes it:

    PE(pos, 2i) = sin(pos / 10000^(2i / d_model)),    PE(pos, 2i + 1) = cos(pos / 10000^(2i / d_model)).

Each dimension is a sinusoid of the position, and the wavelengths form a geometric progression from 2π to
10000 · 2π: the first dimensions change from one position to the next, the last ones hardly over a whole sentence.
The heatmap puts the d_model / 2 sines first and the d_model / 2 cosines after them, each half in order of i (the
sines and cosines of one i sit side by side in the vector, which would draw as stripes); the curves show a few
dimensions spread over the range of wavelengths. A model with learned positions (Table 3, row E) is drawn as its
vectors are.

`positional_encoding_figure` is what `vaswani-plot positions` writes and the demo page shows. Imports only torch,
numpy and matplotlib (and `attention.py` for the figure helpers).
"""

from __future__ import annotations

import math

import torch

from .attention import new_figure

CAPTION_SINUSOIDAL = ("Each dimension is a sinusoid of the position; its wavelength grows geometrically with i, from "
                      "2π to 10000·2π positions.\nNearby positions differ in the first dimensions, distant ones also "
                      "in the later ones, and PE(pos + k) is a linear function of PE(pos) (§3.5).")
CAPTION_LEARNED = "Learned positions (Table 3, row E): one trained vector per position, not a formula."

__all__ = ["CAPTION_LEARNED", "CAPTION_SINUSOIDAL", "curve_dimensions", "positional_encoding_figure",
           "positional_table", "wavelength"]


def wavelength(dimension: int, d_model: int) -> float:
    """The wavelength, in positions, of dimension `dimension` (2i or 2i + 1) of the sinusoidal encoding:
    2π · 10000^(2i / d_model)."""
    return 2 * math.pi * 10000 ** (2 * (dimension // 2) / d_model)


def curve_dimensions(d_model: int, count: int = 4) -> list[int]:
    """`count` sine dimensions 2i whose exponents 2i / d_model spread evenly from 0 to 3/4 (for 4: wavelengths 2π,
    2π · 10, 2π · 100 and 2π · 1000 positions): the geometric range of §3.5 in a few curves."""
    dims = [2 * round(k / max(count - 1, 1) * 0.75 * d_model / 2) for k in range(count)]
    return sorted({d for d in dims if d < d_model})


def positional_table(model, num_positions: int) -> torch.Tensor:
    """The `(num_positions, d_model)` vectors the encoder adds at positions 0 .. num_positions - 1, float32 on the CPU.

    Raises:
        ValueError: learned positions and more positions than the model has.
    """
    positions = model.get_encoder().embed_positions
    if hasattr(positions, "reserve"):
        positions.reserve(num_positions)
    with torch.no_grad():
        return positions(torch.arange(num_positions, device=positions.weight.device)).float().cpu()


def positional_encoding_figure(model, tokens: list[str], curve_positions: int = 100):
    """The positional encoding of `tokens`' positions as a matplotlib `Figure`: left a heatmap (positions x
    dimensions; sinusoidal: the sines then the cosines, see the module docstring), right the curves of
    `curve_dimensions` over `curve_positions` positions (learned: over the sentence), the sentence's positions
    shaded; the formula above and the caption (`CAPTION_SINUSOIDAL` or `CAPTION_LEARNED`) below.

    Args:
        model: a `VaswaniForConditionalGeneration`.
        tokens: the source tokens (their number is the number of positions drawn; the labels of the rows).
    Raises:
        ImportError: matplotlib is missing.
    """
    learned = getattr(model.config, "position_embedding_type", "sinusoidal") == "learned"
    length = len(tokens)
    span = length if learned else max(length, curve_positions)
    table = positional_table(model, span).numpy()
    d_model = table.shape[1]
    shown = table[:length] if learned else table[:length, list(range(0, d_model, 2)) + list(range(1, d_model, 2))]
    figure = new_figure(figsize=(11.0, max(3.6, 0.16 * length + 2.2)), layout="constrained")
    heat, lines = figure.subplots(1, 2, width_ratios=[3, 2])
    image = heat.imshow(shown, cmap="RdBu_r", vmin=-1.0, vmax=1.0, aspect="auto", interpolation="nearest")
    heat.set_yticks(range(length), [f"{i} {t}" for i, t in enumerate(tokens)], fontsize=7)
    heat.set_ylabel("position and source token", fontsize=9)
    if learned:
        heat.set_xlabel("dimension", fontsize=9)
    else:
        half = d_model // 2
        heat.axvline(half - 0.5, color="black", linewidth=0.8)
        heat.set_xticks([0, half // 2, half, half + half // 2], ["i = 0", f"{half // 2}", "i = 0", f"{half // 2}"],
                        fontsize=7)
        heat.set_xlabel(f"sines, dimension 2i    |    cosines, dimension 2i + 1    (i = 0 .. {half - 1})", fontsize=8)
    heat.set_title(f"{length} positions x d_model {d_model}", fontsize=10)
    figure.colorbar(image, ax=heat, shrink=0.8)
    for dim in curve_dimensions(d_model):
        label = f"dimension {dim}" if learned else f"2i = {dim}: wavelength {wavelength(dim, d_model):,.0f}"
        lines.plot(range(span), table[:, dim], label=label, linewidth=1.2)
    lines.axvspan(0, length - 1, color="0.85", zorder=0, label="this sentence's positions")
    lines.set_xlabel("position", fontsize=9)
    lines.set_ylim(-1.15, 1.15)
    lines.set_title("a few dimensions" if learned else "sines across the range of wavelengths", fontsize=10)
    lines.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    figure.suptitle("positional encoding (§3.5)" + ("" if learned else
                    ":  PE(pos, 2i) = sin(pos / 10000^(2i/d_model)),  PE(pos, 2i+1) = cos(pos / 10000^(2i/d_model))"),
                    fontsize=10)
    figure.supxlabel(CAPTION_LEARNED if learned else CAPTION_SINUSOIDAL, fontsize=8)
    return figure
