"""What the interactive demo page (`vaswani-demo`, training/demo.py) computes, without the page: the checks of a
request, the n-best translations with their scores, the attention of every layer for one hypothesis (Figures 3-5),
the source tokens one target token attends to, and the pictures (heatmaps of the heads, the positional encoding of
§3.5).

Decoding goes through `decoding.translate.translate_sentences`, the code path of `vaswani-translate`, so the page's best
hypothesis is the command's translation for the same beam size and length penalty. Pictures are PIL images (Pillow
comes with matplotlib), drawn with the Agg backend.

Imports only torch, matplotlib, Pillow and three modules of vaswani_hf (relatively): `checks.py`,
`decoding/translate.py` and `pictures/attention.py`, so `vaswani-publish --space` ships this file with those three,
in the same folders, into a Space folder that has no vaswani_hf installed.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

import torch

from ..checks import CheckError
from ..decoding.translate import translate_sentences
from .attention import ATTENTION_KINDS, KIND_TITLES, AttentionMaps, new_figure, save_figure

MAX_CHARACTERS = 10_000  # the page states it; longer text is refused before it is tokenized
MAX_SOURCE_TOKENS = 200  # bounds one request's decoding time (a paper sentence has ~30 subwords)
MAX_BEAMS = 12
PAGE_DPI = 72  # pictures for a screen, small and quick to draw

__all__ = ["ATTENTION_KINDS", "KIND_TITLES", "MAX_BEAMS", "MAX_CHARACTERS", "MAX_SOURCE_TOKENS", "Hypothesis",
           "Translation", "check_request", "draw_head", "draw_heads", "draw_positional_encoding",
           "hypothesis_attention", "output_tokens", "source_highlight", "translate_nbest", "unknown_characters"]


@dataclass
class Hypothesis:
    """One of the n best translations.

    Attributes:
        text: detokenized translation.
        score: beam search's score, the sum of the token log-probabilities divided by `length ** length_penalty`,
            `length` counting the tokens after the start token (transformers' `sequences_scores`); `None` for greedy
            decoding (beam 1).
        ids: the generated ids, decoder start token first, `</s>` last (where the hypothesis ended), no padding.
    """

    text: str
    score: float | None
    ids: list[int]


@dataclass
class Translation:
    """The n-best list of one source sentence, best first; `unknown`: characters outside the vocabulary
    (`unknown_characters`)."""

    source: str
    source_ids: list[int]
    hypotheses: list[Hypothesis]
    unknown: list[str] = field(default_factory=list)


def _whole_number(value, name: str, low: int, high: int) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise CheckError(f"{name} must be a whole number from {low} to {high}; got {value!r}.") from None
    if not number.is_integer() or not low <= number <= high:
        raise CheckError(f"{name} must be a whole number from {low} to {high}; got {value!r}.")
    return int(number)


def check_request(text, num_beams, length_penalty, num_hypotheses) -> tuple[str, int, float, int]:
    """Check what the page sends before any work.

    Args:
        text: the source text (at most `MAX_CHARACTERS` characters, not only whitespace).
        num_beams: 1 to `MAX_BEAMS`; length_penalty: a finite number from -5 to 5 (the paper's alpha is 0.6, §6.1);
        num_hypotheses: 1 to `num_beams`. Numbers may come as floats from a page's number field.
    Returns:
        `(text without surrounding whitespace, num_beams, length_penalty, num_hypotheses)`.
    Raises:
        CheckError: naming the field, what it got and what it accepts.
    """
    if not isinstance(text, str) or not text.strip():
        raise CheckError("Type or paste a sentence to translate: the text is empty.")
    if len(text) > MAX_CHARACTERS:
        raise CheckError(f"The text has {len(text):,} characters; the page translates at most {MAX_CHARACTERS:,}. "
                         f"Paste one or a few sentences.")
    beams = _whole_number(num_beams, "Beam size", 1, MAX_BEAMS)
    try:
        alpha = float(length_penalty)
    except (TypeError, ValueError):
        alpha = float("nan")
    if not -5.0 <= alpha <= 5.0:  # also refuses nan
        raise CheckError(f"Length penalty must be a number from -5 to 5 (the paper's is 0.6); got {length_penalty!r}.")
    hypotheses = _whole_number(num_hypotheses, "Number of hypotheses", 1, beams)
    return text.strip(), beams, alpha, hypotheses


def unknown_characters(tokenizer, text: str) -> list[str]:
    """The characters of `text` the vocabulary does not hold (each once, in order of appearance): those encoded as
    `<unk>` or spelled as UTF-8 bytes (`<0xE6>`, the joint BPE's byte fallback), which the model has rarely seen."""
    encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"])
    found: list[str] = []
    for token, token_id, (start, end) in zip(tokens, encoded["input_ids"], encoded["offset_mapping"]):
        byte = len(token) == 6 and token.startswith("<0x") and token.endswith(">")
        if token_id == tokenizer.unk_token_id or byte:
            for char in text[start:end]:
                if not char.isspace() and char not in found:
                    found.append(char)
    return found


@torch.no_grad()
def translate_nbest(model, tokenizer, text: str, *, num_beams: int, length_penalty: float,
                    num_hypotheses: int) -> Translation:
    """The `num_hypotheses` best translations of `text` with their scores.

    `generate()` is called by `decoding.translate.translate_sentences` with the same arguments as `vaswani-translate
    --num_beams N --length_penalty A` (output length up to source length + 50, §6.1), plus `num_return_sequences`
    and the scores, which change no hypothesis; the first hypothesis is the command's translation.

    Raises:
        CheckError: the source is longer than `MAX_SOURCE_TOKENS` subwords or than the model takes.
    """
    source_ids = tokenizer(text)["input_ids"]
    if len(source_ids) > MAX_SOURCE_TOKENS:
        raise CheckError(f"The text is {len(source_ids)} subword tokens long; the page translates at most "
                         f"{MAX_SOURCE_TOKENS} at once. Split it into sentences.")
    outputs = []

    def generate(m, **kwargs):  # translate_sentences' own call, keeping the n-best and their scores
        out = m.generate(**kwargs, num_return_sequences=num_hypotheses, return_dict_in_generate=True,
                         output_scores=num_beams > 1)
        outputs.append(out)
        return out.sequences

    try:
        translate_sentences(model, tokenizer, [text], num_beams=num_beams, length_penalty=length_penalty,
                            generate_fn=generate)
    except ValueError as error:  # a sentence longer than the model's positions
        raise CheckError(str(error).replace("translate_sentences: sentence 0: ", "")) from None
    out = outputs[0]
    scores = out.sequences_scores.tolist() if getattr(out, "sequences_scores", None) is not None else None
    hypotheses = []
    for i, row in enumerate(out.sequences.cpu()):
        ids = row.tolist()
        while ids and ids[-1] == model.config.pad_token_id:
            ids.pop()
        hypotheses.append(Hypothesis(text=tokenizer.decode(ids, skip_special_tokens=True).strip(),
                                     score=None if scores is None else float(scores[i]), ids=ids))
    return Translation(source=text, source_ids=source_ids, hypotheses=hypotheses,
                       unknown=unknown_characters(tokenizer, text))


@torch.no_grad()
def hypothesis_attention(model, tokenizer, translation: Translation, index: int = 0) -> list[AttentionMaps]:
    """The attention of every layer when the model reads hypothesis `index` of `translation` (teacher-forced: one
    forward pass with `output_attentions=True` on the source and the hypothesis, as `attention.attention_weights`
    for one layer, here all layers at once).

    Returns:
        one `AttentionMaps` a layer (`max(encoder_layers, decoder_layers)` of them); the target tokens are the
        decoder inputs (`<s>` and the hypothesis without `</s>`), so row `t` of `decoder` and `cross` is the state
        that chose output token `t` (`hypotheses[index].ids[t + 1]`). A stack with fewer layers has an empty
        `(0,)` tensor where it has no layer.
    Raises:
        IndexError: no hypothesis `index`.
    """
    ids = translation.hypotheses[index].ids
    decoder_ids = ids[:-1] if len(ids) > 1 and ids[-1] == model.config.eos_token_id else ids
    device = next(model.parameters()).device
    model.eval()
    out = model(input_ids=torch.tensor([translation.source_ids], device=device),
                decoder_input_ids=torch.tensor([decoder_ids], device=device), output_attentions=True,
                use_cache=False)
    source_tokens = tokenizer.convert_ids_to_tokens(translation.source_ids)
    target_tokens = tokenizer.convert_ids_to_tokens(decoder_ids)
    empty = torch.empty(0)

    def layer(stack, i):
        return stack[i][0].float().cpu() if i < len(stack) else empty

    num_layers = max(len(out.encoder_attentions), len(out.decoder_attentions))
    return [AttentionMaps(source_tokens=source_tokens, target_tokens=target_tokens, layer=i, num_layers=num_layers,
                          encoder=layer(out.encoder_attentions, i), decoder=layer(out.decoder_attentions, i),
                          cross=layer(out.cross_attentions, i))
            for i in range(num_layers)]


def output_tokens(tokenizer, hypothesis: Hypothesis) -> list[str]:
    """The tokens the model chose for `hypothesis` (without the start token; `</s>` last where it ended)."""
    return tokenizer.convert_ids_to_tokens(hypothesis.ids[1:])


def source_highlight(maps: AttentionMaps, target_index: int, head: int | None = None) -> list[tuple[str, float]]:
    """The source tokens with the encoder-decoder attention of the state that chose output token `target_index`
    (row `target_index` of `maps.cross`), of one `head` (0-based) or the mean of all heads (`None`), scaled so the
    largest weight is 1; for `gr.HighlightedText`. Subword marks "▁" become spaces."""
    if maps.cross.numel() == 0:
        return [(token.replace("▁", " "), 0.0) for token in maps.source_tokens]
    rows = maps.cross[:, target_index] if head is None else maps.cross[head, target_index][None]
    weights = rows.mean(0)
    weights = weights / weights.max().clamp_min(1e-9)
    return [(token.replace("▁", " "), round(float(w), 4)) for token, w in zip(maps.source_tokens, weights)]


def _image(draw) -> object:
    """A PIL image of what `draw(path)` writes as a PNG (a temporary file, removed)."""
    from PIL import Image

    with tempfile.TemporaryDirectory(prefix="vaswani-demo-") as folder:
        path = os.path.join(folder, "figure.png")
        draw(path)
        with Image.open(path) as image:
            image.load()
            return image.copy()


def draw_heads(maps: AttentionMaps, kind: str, cell: int = 160, gap: int = 6):
    """Every head of one kind of attention of `maps` at a glance, as a PIL image: the heads' heatmaps left to right
    (viridis, one colour scale for all heads from 0 to the largest weight), each scaled up by a whole factor to about
    `cell` pixels on its longer side, `gap` white pixels apart; no labels (the enlarged head, `draw_head`, has the
    tokens on its axes). Pixels only, no figure: a few milliseconds where `attention.plot_attention` takes
    seconds for long sentences.

    Returns:
        an RGB image `rows * s` high and `H * cols * s + (H - 1) * gap` wide, `s = max(1, cell // max(rows, cols))`;
        `None` where the stack of that kind has no such layer.
    """
    import numpy as np
    from matplotlib import colormaps
    from PIL import Image

    weights = maps[kind]
    if weights.numel() == 0:
        return None
    heads, rows, cols = weights.shape
    scale = max(1, cell // max(rows, cols))
    values = (weights / weights.max().clamp_min(1e-6)).numpy()
    colours = (colormaps["viridis"](values)[..., :3] * 255).astype(np.uint8)  # (H, rows, cols, 3)
    colours = colours.repeat(scale, axis=1).repeat(scale, axis=2)
    canvas = np.full((rows * scale, heads * cols * scale + (heads - 1) * gap, 3), 255, dtype=np.uint8)
    for h in range(heads):
        left = h * (cols * scale + gap)
        canvas[:, left:left + cols * scale] = colours[h]
    return Image.fromarray(canvas)


def draw_head(maps: AttentionMaps, kind: str, head: int):
    """One head (0-based) of one kind of attention, enlarged, with the tokens on the axes and the weights' colour
    bar, as a PIL image; `None` where there is no such layer.

    Raises:
        IndexError: no head `head`.
    """
    weights = maps[kind]
    if weights.numel() == 0:
        return None
    if not 0 <= head < weights.shape[0]:
        raise IndexError(f"head {head + 1} does not exist: the model has {weights.shape[0]} heads.")
    rows, cols = maps.axes(kind)
    figure = new_figure(figsize=(max(4.0, 0.3 * len(cols) + 2.0), max(3.5, 0.3 * len(rows) + 1.5)),
                        layout="constrained")
    ax = figure.subplots()
    image = ax.imshow(weights[head].numpy(), vmin=0.0, cmap="viridis", aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(cols)), cols, rotation=90, fontsize=9)
    ax.set_yticks(range(len(rows)), rows, fontsize=9)
    ax.set_xlabel("keys")
    ax.set_ylabel("queries")
    ax.set_title(f"{KIND_TITLES[kind]}, layer {maps.layer + 1}, head {head + 1}", fontsize=11)
    figure.colorbar(image, ax=ax, shrink=0.8, label="attention weight")
    return _image(lambda path: save_figure(figure, path, dpi=PAGE_DPI))


def draw_positional_encoding(model, tokens: list[str], curves: tuple[int, ...] | None = None):
    """The positional encoding the encoder adds to each of `tokens` (§3.5; learned positions for a model with
    `position_embedding_type="learned"`): a heatmap of positions x dimensions and the curves of a few dimensions
    (`curves`; default the sines of dimensions 0, d/32, d/16 and d/8, whose wavelengths grow geometrically), as a PIL
    image."""
    positions = model.get_encoder().embed_positions
    if hasattr(positions, "reserve"):
        positions.reserve(len(tokens))
    with torch.no_grad():
        table = positions(torch.arange(len(tokens), device=positions.weight.device)).float().cpu().numpy()
    d_model = table.shape[1]
    curves = curves if curves is not None else sorted({2 * (d_model // (2 * n)) for n in (32, 16, 8)} | {0})
    figure = new_figure(figsize=(9.0, max(3.0, 0.18 * len(tokens) + 1.5)), layout="constrained")
    heat, lines = figure.subplots(1, 2, width_ratios=[3, 2])
    image = heat.imshow(table, cmap="RdBu_r", vmin=-1.0, vmax=1.0, aspect="auto", interpolation="nearest")
    heat.set_yticks(range(len(tokens)), [f"{i} {t}" for i, t in enumerate(tokens)], fontsize=7)
    heat.set_xlabel("dimension")
    heat.set_title(f"positional encoding (§3.5), {len(tokens)} positions x d_model {table.shape[1]}", fontsize=10)
    figure.colorbar(image, ax=heat, shrink=0.8)
    for dim in curves:
        if dim < table.shape[1]:
            lines.plot(range(len(tokens)), table[:, dim], label=f"dim {dim}")
    lines.set_xlabel("position")
    lines.legend(fontsize=8)
    lines.set_title("a few dimensions", fontsize=10)
    return _image(lambda path: save_figure(figure, path, dpi=PAGE_DPI))

