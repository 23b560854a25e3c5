"""What the interactive demo page (`vaswani-demo`, training/demo.py) computes, without the page: the checks of a
request, the n-best translations with their scores, the attention of every layer for one hypothesis (Figures 3-5),
the source tokens one target token attends to, and the pictures (heatmaps of the heads, the positional encoding of
§3.5).

Decoding goes through `decoding.translate.translate_sentences`, the code path of `vaswani-translate`, so the page's best
hypothesis is the command's translation for the same beam size and length penalty. Pictures are PIL images (Pillow
comes with matplotlib), drawn with the Agg backend.

Every picture is drawn by the code `vaswani-plot` draws with (`attention.attention_figure`,
`positions.positional_encoding_figure`), at a screen's resolution.

Imports only torch, matplotlib, Pillow, huggingface_hub (the model card's metadata) and four modules of vaswani_hf
(relatively): `checks.py` (the model folder's check, which reads `configuration_vaswani.py` and `inputs_vaswani.py`),
`decoding/translate.py`, `pictures/attention.py` and `pictures/positions.py`, so `vaswani-publish --space` ships this
file with those six, in the same folders, into a Space folder that has no vaswani_hf installed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from ..checks import CheckError, check_model_folder
from ..decoding.translate import translate_sentences
from .attention import (
    ATTENTION_KINDS,
    KIND_TITLES,
    AttentionMaps,
    attention_figure,
    decoder_rows,
    predicted_token_labels,
)
from .positions import positional_encoding_figure

MAX_CHARACTERS = 10_000  # the page states it; longer text is refused before it is tokenized
MAX_SOURCE_TOKENS = 200  # bounds one request's decoding time (a paper sentence has ~30 subwords)
MAX_BEAMS = 12
PAGE_DPI = 72  # pictures for a screen, small and quick to draw

__all__ = ["ATTENTION_KINDS", "KIND_TITLES", "MAX_BEAMS", "MAX_CHARACTERS", "MAX_SOURCE_TOKENS", "Hypothesis",
           "Translation", "check_model_folder", "check_request", "draw_head", "draw_heads", "draw_positional_encoding",
           "figure_image", "hypothesis_attention", "output_tokens", "source_highlight", "training_data_note",
           "translate_nbest", "unknown_characters", "unshaded"]

MULTI30K_NOTE = ("This model was trained on Multi30k only: 29,000 short English descriptions of Flickr photos (people, "
                 "animals, everyday scenes) and their German translations, with a small Transformer. It translates "
                 "short sentences that describe a scene; on other text it often mistranslates or drops names, numbers "
                 "and words, and it can write a fluent sentence that says something the source does not.")


@dataclass
class Hypothesis:
    """One of the n best translations.

    Attributes:
        text: detokenized translation.
        score: beam search's score, the sum of the token log-probabilities divided by `length ** length_penalty`
            (or by `((5 + length) / 6) ** length_penalty` where the model's generation config says
            `length_penalty_style: "gnmt"`), `length` counting the tokens after the start token (transformers'
            `sequences_scores`); `None` for greedy decoding (beam 1).
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
        that chose output token `t` (`hypotheses[index].ids[t + 1]`, `predicted_tokens[t]`). A stack with fewer
        layers has an empty `(0,)` tensor where it has no layer.
    Raises:
        IndexError: no hypothesis `index`.
    """
    decoder_ids, predicted = decoder_rows(translation.hypotheses[index].ids, model.config.eos_token_id)
    device = next(model.parameters()).device
    model.eval()
    out = model(input_ids=torch.tensor([translation.source_ids], device=device),
                decoder_input_ids=torch.tensor([decoder_ids], device=device), output_attentions=True,
                use_cache=False)
    source_tokens = tokenizer.convert_ids_to_tokens(translation.source_ids)
    target_tokens = tokenizer.convert_ids_to_tokens(decoder_ids)
    predicted_tokens = predicted_token_labels(tokenizer, predicted)
    empty = torch.empty(0)

    def layer(stack, i):
        return stack[i][0].float().cpu() if i < len(stack) else empty

    num_layers = max(len(out.encoder_attentions), len(out.decoder_attentions))
    return [AttentionMaps(source_tokens=source_tokens, target_tokens=target_tokens, layer=i, num_layers=num_layers,
                          encoder=layer(out.encoder_attentions, i), decoder=layer(out.decoder_attentions, i),
                          cross=layer(out.cross_attentions, i), predicted_tokens=predicted_tokens)
            for i in range(num_layers)]


def output_tokens(tokenizer, hypothesis: Hypothesis) -> list[str]:
    """The tokens the model chose for `hypothesis` (without the start token; `</s>` last where it ended)."""
    return tokenizer.convert_ids_to_tokens(hypothesis.ids[1:])


def source_highlight(maps: AttentionMaps, target_index: int, head: int | None = None) -> list[tuple[str, float]]:
    """The source tokens with the encoder-decoder attention of the state that chose output token `target_index`
    (row `target_index` of `maps.cross`), of one `head` (0-based) or the mean of all heads (`None`), scaled so the
    largest weight is 1; for `gr.HighlightedText`. Tokens as the pictures show them ("▁" starts a word)."""
    if maps.cross.numel() == 0:
        return unshaded(maps)
    rows = maps.cross[:, target_index] if head is None else maps.cross[head, target_index][None]
    weights = rows.mean(0)
    weights = weights / weights.max().clamp_min(1e-9)
    return [(token, round(float(w), 4)) for token, w in zip(maps.source_tokens, weights)]


def unshaded(maps: AttentionMaps) -> list[tuple[str, float]]:
    """The source tokens without shading (weight 0 each): what the page shows until a target token is chosen."""
    return [(token, 0.0) for token in maps.source_tokens]


def training_data_note(model_dir: str | os.PathLike | None) -> str:
    """A line for the page on what the model in `model_dir` was trained on and what follows from it: read from the
    run's `metrics.json` (`dataset`; local files or a local folder said to be local, by name, never by path), else
    from the model card's `datasets:` (README.md); says so when neither tells."""
    dataset, local = None, False
    if model_dir and os.path.isdir(model_dir):
        try:
            with open(os.path.join(model_dir, "metrics.json"), encoding="utf-8") as handle:
                metrics = json.load(handle)
            dataset = metrics.get("dataset") if isinstance(metrics, dict) else None
            data = metrics.get("data") if isinstance(metrics, dict) else None
            # local files or a local folder: said so, by name (a path names the user's folders, not data)
            local = (isinstance(data, dict) and data.get("kind") in ("local", "files")) or (
                isinstance(dataset, str) and os.path.isabs(dataset))
            dataset = os.path.basename(dataset.rstrip("/")) if local and isinstance(dataset, str) else dataset
        except (OSError, ValueError):
            pass
        card = os.path.join(model_dir, "README.md")
        if dataset is None and os.path.isfile(card):
            import yaml
            from huggingface_hub import metadata_load  # a dependency of transformers: in a Space as well

            try:
                datasets = (metadata_load(card) or {}).get("datasets")
            except (OSError, ValueError, yaml.YAMLError):  # a header that is not YAML
                datasets = None
            dataset = datasets[0] if isinstance(datasets, list) and datasets else datasets or None
    if dataset is None:
        return ("What this model was trained on is not recorded in its folder (no metrics.json or model card): "
                "expect good translations only of text like its training data.")
    if "multi30k" in str(dataset).lower() and not local:
        return MULTI30K_NOTE
    if local:
        return (f"This model was trained on local files ({dataset}). Expect good translations only of text like that "
                "data; its model card says more.")
    return (f"This model was trained on {dataset}. Expect good translations only of text like that data; its model "
            "card says more.")


def figure_image(figure, dpi: int = PAGE_DPI):
    """A matplotlib `Figure` rendered to an RGB PIL image at `dpi` (Agg, in memory; no PNG round trip, no cropping)."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    figure.set_dpi(dpi)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return Image.fromarray(np.asarray(canvas.buffer_rgba())[..., :3].copy())


def draw_heads(maps: AttentionMaps, kind: str, heads_per_row: int = 4):
    """Every head of one kind of attention of `maps` as a PIL image: `attention.attention_figure` (head numbers, token
    ticks, axis names, colour bar), the figure `vaswani-plot attention` writes, at the page's resolution.

    Returns:
        an RGB image; `None` where the stack of that kind has no such layer.
    """
    if maps[kind].numel() == 0:
        return None
    figure = attention_figure(maps, kind, heads_per_row=heads_per_row)
    return figure_image(figure)


def draw_head(maps: AttentionMaps, kind: str, head: int):
    """One head (0-based) of one kind of attention, enlarged, as a PIL image (`attention.attention_figure` of that
    head); `None` where there is no such layer.

    Raises:
        IndexError: no head `head`.
    """
    if maps[kind].numel() == 0:
        return None
    figure = attention_figure(maps, kind, heads=[head])
    return figure_image(figure)


def draw_positional_encoding(model, tokens: list[str]):
    """The positional encoding the encoder adds at each of `tokens`' positions (§3.5), as a PIL image:
    `positions.positional_encoding_figure`, the figure `vaswani-plot positions` writes."""
    figure = positional_encoding_figure(model, tokens)
    return figure_image(figure)
