"""See the model think: a local web page that translates what you type and shows the attention behind it.

    vaswani-demo --model outputs/multi30k-de-en            # then open http://127.0.0.1:7860
    vaswani-demo --model outputs/multi30k-de-en --port 8000 --host 0.0.0.0

Type or paste a sentence in the model's source language, choose the beam size, the length penalty and how many
hypotheses to list, and the page shows the n-best translations with their scores. For the chosen hypothesis it draws
the attention of every head of the encoder self-attention, the decoder self-attention and the encoder-decoder
attention of a chosen layer (as the paper's Figures 3-5), one head enlarged, and the positional encoding (§3.5) of the
sentence's positions, drawn by the code `vaswani-plot` draws with; choosing a target token shades the source tokens it
attended to. The page says what the model was trained on (its folder's metrics.json or model card). The best
hypothesis is `vaswani-translate`'s translation with the same settings (the same `generate()` call).

A thin Gradio layer over `vaswani_hf.pictures.demo`; needs `pip install 'vaswani-hf[demo]'`. Requests wait in Gradio's
queue and `--concurrency` of them run at once; each is bounded (10,000 characters, 200 subword tokens, beam <= 12).
Nothing is sent anywhere: Gradio's analytics are off and no share link is made. `vaswani-publish --space` writes this
page beside a published model, as a Hugging Face Space.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

if __package__ in (None, ""):  # run as a file (python training/demo.py): import as vaswani_training
    __package__ = "vaswani_training"

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # read when gradio is imported: no usage reports

try:  # the installed project
    from vaswani_hf.pictures import demo as core
except ImportError:  # a Space folder written by `vaswani-publish --space`: the same modules shipped beside this file
    from .pictures import demo as core

CheckError = core.CheckError
logger = logging.getLogger("vaswani_hf.demo")

EXAMPLE_SOURCES = {"de": "Zwei junge Männer spielen auf einer Wiese Fußball, während ein Hund ihnen zusieht.",
                   "en": "Two young men are playing soccer in a field while a dog watches them."}


def load_model(model_dir: str, *, trust_remote_code: bool = False, device: str = "cpu"):
    """The model (eval mode, on `device`) and tokenizer of a saved folder; with vaswani_hf installed, or from the
    folder's own code files with `trust_remote_code=True` (a Space), which both loads are given.

    Raises:
        CheckError: the folder fails `check_model_folder` (as for vaswani-translate): a missing or damaged file, a
            config.json without a field of the model, a tokenizer that does not belong to the model, ...
    """
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    try:
        import vaswani_hf  # noqa: F401  (registers the model with the Auto classes)
    except ImportError:
        pass
    core.check_model_folder(model_dir, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir, trust_remote_code=trust_remote_code,
                                                  use_safetensors=True)
    return model.to(device).eval(), tokenizer


def _hypothesis_label(rank: int, hypothesis) -> str:
    score = "greedy" if hypothesis.score is None else f"score {hypothesis.score:.3f}"
    return f"{rank + 1}. ({score}) {hypothesis.text}"


class DemoPage:
    """What the page's events compute, as plain methods (tested without a browser); each returns the new values of
    its event's outputs, in order, and never raises: bad input becomes a message in the page (`status`) and a
    `gr.Warning`. Each browser tab's state (`gr.State`) is a dict: the `Translation`, the chosen hypothesis `index`
    and its `maps` (`core.hypothesis_attention`)."""

    def __init__(self, model, tokenizer):
        import gradio as gr

        self.gr, self.model, self.tokenizer = gr, model.eval(), tokenizer
        config = model.config
        self.num_layers, self.num_heads = max(config.encoder_layers, config.decoder_layers), config.num_heads

    def pictures(self, maps, layer, head, kind) -> list:
        """All heads of the three kinds of attention of `layer` (1-based), and head `head` of `kind` enlarged."""
        chosen = maps[int(layer) - 1]
        return [core.draw_heads(chosen, k) for k in core.ATTENTION_KINDS] + [
            core.draw_head(chosen, kind, min(int(head), self.num_heads) - 1)]

    def hypothesis_outputs(self, translation, index, layer, head, kind) -> list:
        """[state, text, 3 grids, enlarged head, target tokens, source shading] for hypothesis `index`."""
        maps = core.hypothesis_attention(self.model, self.tokenizer, translation, index)
        hypothesis = translation.hypotheses[index]
        targets = [f"{i + 1} {t}" for i, t in enumerate(core.output_tokens(self.tokenizer, hypothesis))]
        return [{"translation": translation, "index": index, "maps": maps}, hypothesis.text,
                *self.pictures(maps, layer, head, kind), self.gr.update(choices=targets, value=None),
                core.unshaded(maps[int(layer) - 1])]  # no shading until a target token is chosen

    def cleared(self, message: str) -> list:
        self.gr.Warning(message)
        empty = self.gr.update(choices=[], value=None)
        return [None, f"**{message}**", "", empty, None, None, None, None, None, empty, None]

    def translate(self, text, beams, alpha, n, layer, head, kind) -> list:
        """The Translate button: [state, status, translation, hypotheses, 3 grids, enlarged head, positional
        encoding, target tokens, source shading]."""
        started = time.perf_counter()
        try:
            text, beams, alpha, n = core.check_request(text, beams, alpha, n)
            translation = core.translate_nbest(self.model, self.tokenizer, text, num_beams=beams,
                                               length_penalty=alpha, num_hypotheses=n)
            state, best, *images, targets, shading = self.hypothesis_outputs(translation, 0, layer, head, kind)
            positional = core.draw_positional_encoding(
                self.model, self.tokenizer.convert_ids_to_tokens(translation.source_ids))
        except CheckError as error:
            return self.cleared(str(error))
        except Exception as error:  # noqa: BLE001 - the page says what failed instead of breaking
            logger.exception("translation failed")
            return self.cleared(f"The translation failed ({type(error).__name__}: {error}).")
        status = (f"{len(translation.hypotheses)} hypotheses (beam {beams}, length penalty {alpha:g}) in "
                  f"{time.perf_counter() - started:.2f} s.")
        if translation.unknown:
            status += (" Characters outside the vocabulary (spelled as bytes or `<unk>`, rarely seen in training): "
                       + " ".join(translation.unknown))
        choices = [(_hypothesis_label(i, h), i) for i, h in enumerate(translation.hypotheses)]
        return [state, status, best, self.gr.update(choices=choices, value=0), *images, positional, targets, shading]

    def choose_hypothesis(self, state, index, layer, head, kind) -> list:
        """A hypothesis chosen: [state, translation, 3 grids, enlarged head, target tokens, source shading]."""
        if not state or index is None:
            return [self.gr.update()] * 8
        return self.hypothesis_outputs(state["translation"], int(index), layer, head, kind)

    def redraw(self, state, layer, head, kind) -> list:
        """Another layer, head or kind: [3 grids, enlarged head]."""
        return self.pictures(state["maps"], layer, head, kind) if state else [None] * 4

    def highlight(self, state, target, layer):
        """A target token chosen (0-based): the source tokens shaded by its encoder-decoder attention; none chosen:
        the source tokens unshaded."""
        if not state:
            return None
        maps = state["maps"][int(layer) - 1]
        return core.unshaded(maps) if target is None else core.source_highlight(maps, int(target))


def build_demo(model, tokenizer, *, title: str = "Attention Is All You Need: see the model translate",
               source_lang: str = "de", model_dir: str | None = None):
    """The page as a `gradio.Blocks` (not launched), wiring `DemoPage`'s methods to its elements. Element ids (the
    browser test reads them): `training_data`, `source`, `num_beams`, `length_penalty`, `num_hypotheses`,
    `translate`, `status`, `translation`, `hypotheses`, `layer`, `head`, `kind`, `heads_encoder`, `heads_decoder`,
    `heads_cross`, `head_enlarged`, `positional`, `target_token`, `source_highlight`. `model_dir` (default: the folder
    the model was loaded from) is where the page reads what the model was trained on.

    Raises:
        ImportError: gradio is not installed (the message says how to install it).
    """
    try:
        import gradio as gr
    except ImportError as error:
        raise ImportError("The demo page needs gradio: pip install 'vaswani-hf[demo]' (or pip install gradio)."
                          ) from error

    page = DemoPage(model, tokenizer)
    generation = model.generation_config
    default_beams = min(generation.num_beams or 4, core.MAX_BEAMS)
    default_alpha = generation.length_penalty if generation.length_penalty is not None else 0.6
    # the form generate() applies: the folder's choice (training/lib/choose.py) or transformers' own
    penalty = ("((5 + length) / 6)^penalty, the paper's GNMT form" if getattr(
        generation, "length_penalty_style", None) == "gnmt" else "length^penalty, transformers' form")
    note = core.training_data_note(model_dir if model_dir is not None else getattr(model, "name_or_path", None))
    with gr.Blocks(title=title, analytics_enabled=False) as demo:
        state = gr.State(None)
        gr.Markdown(f"# {title}\nType or paste a sentence in the model's source language ({source_lang}): at most "
                    f"{core.MAX_CHARACTERS:,} characters and {core.MAX_SOURCE_TOKENS} subword tokens. Beam size 1 to "
                    f"{core.MAX_BEAMS} (the paper's: 4, length penalty 0.6, §6.1; this model's defaults are those "
                    f"its generation config holds; the page applies the penalty as log-probability / {penalty}).")
        gr.Markdown(f"*{note}*", elem_id="training_data")
        source = gr.Textbox(label="Source", lines=3, elem_id="source",
                            placeholder=EXAMPLE_SOURCES.get(source_lang, ""))
        with gr.Row():
            beams = gr.Number(value=default_beams, precision=0, label=f"Beam size (1-{core.MAX_BEAMS})",
                              elem_id="num_beams")
            alpha = gr.Number(value=default_alpha, label="Length penalty", elem_id="length_penalty")
            n_best = gr.Number(value=min(3, default_beams), precision=0, label="Hypotheses (1-beam size)",
                               elem_id="num_hypotheses")
            button = gr.Button("Translate", variant="primary", elem_id="translate")
        status = gr.Markdown(elem_id="status")
        translation = gr.Textbox(label="Translation (the chosen hypothesis)", interactive=False,
                                 elem_id="translation")
        hypotheses = gr.Radio(label=f"n-best hypotheses (score: log-probability / {penalty.split(',')[0]})", choices=[],
                              elem_id="hypotheses")
        with gr.Row():  # a slider needs two choices: one layer or one head leaves nothing to choose, and it is hidden
            layer = gr.Slider(1, max(page.num_layers, 2), value=page.num_layers, step=1, label="Layer",
                              elem_id="layer", visible=page.num_layers > 1)
            head = gr.Slider(1, max(page.num_heads, 2), value=1, step=1, label="Head (enlarged)", elem_id="head",
                             visible=page.num_heads > 1)
            kind = gr.Radio([(label, k) for k, label in core.KIND_TITLES.items()], value="cross",
                            label="Enlarged attention", elem_id="kind")
        gr.Markdown("Each picture is one kind of attention of the chosen layer, a heatmap per head (numbered), one "
                    "colour scale for all heads. Rows are queries, columns keys. A decoder position reads the token "
                    "before it (`<s>` first) and predicts the next one, so the rows of the decoder's pictures are "
                    "labelled with the output token each one predicts, the same tokens as in the target-token list "
                    "below, and the decoder self-attention's columns with the inputs. `▁` starts a word (the BPE's "
                    "word-boundary marker), in the pictures and in the lists alike.", elem_id="reading_the_pictures")
        images = [gr.Image(label=f"{core.KIND_TITLES[k]}: every head", show_label=False, type="pil", format="png",
                           elem_id=f"heads_{k}", interactive=False)
                  for k in core.ATTENTION_KINDS]
        enlarged = gr.Image(label="one head, enlarged", show_label=False, type="pil", format="png",
                            elem_id="head_enlarged", interactive=False)
        with gr.Row():
            target = gr.Radio(label="Output token (choose one to shade the source tokens it attended to)",
                              type="index", choices=[], elem_id="target_token")
            shaded = gr.HighlightedText(label="Encoder-decoder attention of that token (chosen layer, mean of heads)",
                                        elem_id="source_highlight")
        positional = gr.Image(label="Positional encoding of the source positions (§3.5)", show_label=False, type="pil",
                              format="png", elem_id="positional", interactive=False)

        inputs = [source, beams, alpha, n_best, layer, head, kind]
        outputs = [state, status, translation, hypotheses, *images, enlarged, positional, target, shaded]
        for trigger in (button.click, source.submit):
            trigger(page.translate, inputs, outputs)
        hypotheses.input(page.choose_hypothesis, [state, hypotheses, layer, head, kind],
                         [state, translation, *images, enlarged, target, shaded])
        for control in (layer, head, kind):
            control.input(page.redraw, [state, layer, head, kind], [*images, enlarged])
        layer.input(page.highlight, [state, target, layer], shaded)
        target.input(page.highlight, [state, target, layer], shaded)
    return demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", "--model_dir", required=True, help="A saved model folder (with its tokenizer).")
    parser.add_argument("--host", default=None, help="Address to listen on (default: GRADIO_SERVER_NAME, else "
                                                     "127.0.0.1; 0.0.0.0 to be reached from other machines).")
    parser.add_argument("--port", type=int, default=None,
                        help="Port (default: GRADIO_SERVER_PORT, else the first free one from 7860).")
    parser.add_argument("--concurrency", type=int, default=2,
                        help="Requests computed at once; the others wait in the queue (default 2).")
    parser.add_argument("--source_lang", default="de", help="The source language's code, for the page (default de).")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, mps (default cpu).")
    parser.add_argument("--trust_remote_code", action="store_true",
                        help="Allow a Hub-style folder's own model code to run (only for folders you trust).")
    return parser


def launch(demo, *, host: str | None = None, port: int | None = None, concurrency: int = 2, block: bool = True):
    """Queue (`concurrency` requests at once, 64 waiting) and serve `demo`; no share link. Returns its URL."""
    demo.queue(default_concurrency_limit=concurrency, max_size=64)
    _, url, _ = demo.launch(server_name=host, server_port=port, share=False, prevent_thread_lock=not block,
                            quiet=not block)
    return url


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.INFO)
    if args.concurrency < 1:
        raise SystemExit(f"--concurrency must be >= 1, got {args.concurrency}.")
    if args.port is not None and not 1 <= args.port <= 65535:
        raise SystemExit(f"--port must be a TCP port from 1 to 65535, got {args.port}; leave it out for the first "
                         f"free one from 7860.")
    try:
        model, tokenizer = load_model(args.model, trust_remote_code=args.trust_remote_code, device=args.device)
        demo = build_demo(model, tokenizer, source_lang=args.source_lang, model_dir=args.model)
    except (ImportError, OSError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    launch(demo, host=args.host, port=args.port, concurrency=args.concurrency)
    return 0


if __name__ == "__main__":
    sys.exit(main())
