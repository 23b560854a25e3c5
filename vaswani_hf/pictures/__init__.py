"""Pictures of what the model computes, and the demo page's core that draws them.

- `attention.py`: the attention weights of one layer for a sentence pair and their heatmaps, as in the paper's
  Figures 3-5 (`attention_maps`, `attention_figure`, `plot_attention`, `plot_all_attention`; `vaswani-plot
  attention`), and the matplotlib figure helpers (`new_figure`, `save_figure`) that `vaswani-plot curve` draws with;
- `positions.py`: the positional encoding of §3.5 as the paper writes it (`positional_encoding_figure`;
  `vaswani-plot positions`);
- `demo.py`: what the `vaswani-demo` page computes without the page: the checks of a request, the n-best translations
  with their scores, the attention of every layer for one hypothesis, and its pictures as PIL images (the heads, the
  positional encoding of §3.5).

The public names of both files are importable from here; the page's own names (`MAX_BEAMS`, `check_request`, ...)
also from `vaswani_hf.pictures.demo`, which training/demo.py imports as `core`.
"""

from .attention import (
    ATTENTION_KINDS,
    KIND_TITLES,
    AttentionMaps,
    attention_figure,
    attention_maps,
    attention_weights,
    new_figure,
    plot_all_attention,
    plot_attention,
    save_figure,
)
from .demo import (
    MAX_BEAMS,
    MAX_CHARACTERS,
    MAX_SOURCE_TOKENS,
    Hypothesis,
    Translation,
    check_request,
    draw_head,
    draw_heads,
    draw_positional_encoding,
    hypothesis_attention,
    output_tokens,
    source_highlight,
    training_data_note,
    translate_nbest,
    unknown_characters,
    unshaded,
)
from .positions import positional_encoding_figure

__all__ = [
    "ATTENTION_KINDS",
    "KIND_TITLES",
    "MAX_BEAMS",
    "MAX_CHARACTERS",
    "MAX_SOURCE_TOKENS",
    "AttentionMaps",
    "Hypothesis",
    "Translation",
    "attention_figure",
    "attention_maps",
    "attention_weights",
    "check_request",
    "draw_head",
    "draw_heads",
    "draw_positional_encoding",
    "hypothesis_attention",
    "new_figure",
    "output_tokens",
    "plot_all_attention",
    "plot_attention",
    "positional_encoding_figure",
    "save_figure",
    "source_highlight",
    "training_data_note",
    "translate_nbest",
    "unknown_characters",
    "unshaded",
]
