"""The `vaswani-demo` page in a real browser: headless Chromium (Debian's `chromium` package, never a downloaded one)
driven by Playwright types a sentence, submits, reads the translation and checks that every heatmap arrived as the
image the page computed (the figures whose head numbers, token ticks and colour scale tests/test_pictures.py reads),
that the page says how to read them and what the model was trained on, and that no source token is shaded before a
target token is chosen; then the bad inputs each get their message, and two users at once are both served.

Needs `pip install -e '.[demo]'` and `apt-get install chromium` (VASWANI_CHROMIUM names another binary). The page serves
the tiny test model; VASWANI_DEMO_MODEL=DIR serves a trained model folder instead, VASWANI_DEMO_TIMING=FILE writes how
long the page took to answer a 30-word sentence with beam 4 and all pictures (reported in docs/demo.md, never
asserted), VASWANI_DEMO_SCREENSHOT=FILE saves a screenshot of the page (docs/demo.png).
"""

import io
import json
import os
import shutil
import time
import urllib.parse
import urllib.request

import pytest
import torch
from helpers import GERMAN, free_port

REQUIRED = os.environ.get("VASWANI_REQUIRE_DEV") == "1"
CHROMIUM = os.environ.get("VASWANI_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
# Chromium on a closed network: no GPU, no sandbox (root in CI), and none of its own background traffic.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
THIRTY_WORDS = ("Ein Mann in einem blauen Hemd steht auf einer Leiter und putzt die Fenster eines großen Hauses, "
                "während zwei Kinder mit einem braunen Hund auf dem grünen Rasen davor spielen.")
TIMEOUT_MS = 60_000

if not REQUIRED:
    pytest.importorskip("gradio", reason="the demo page needs gradio: pip install -e '.[demo]'")
    pytest.importorskip("playwright", reason="the browser test needs Playwright: pip install -e '.[demo]'")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"the browser test needs Chromium at {CHROMIUM}: apt-get install chromium (or set "
                    "VASWANI_CHROMIUM to a chromium binary)", allow_module_level=True)

from playwright.sync_api import expect, sync_playwright  # noqa: E402

# An answer carries its five drawn figures: a loaded machine needs more than Playwright's default 5 s for it
expect.set_options(timeout=TIMEOUT_MS)

from vaswani_hf.pictures import demo as core  # noqa: E402
from vaswani_training.demo import build_demo, launch, load_model  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_tokenizer):
    """(url, model, tokenizer) of the page running in this process on a free port; closed after the module."""
    from helpers import save_model_folder

    # 256 positions: the 30-word sentence is 92 subwords of the tiny BPE
    folder = os.environ.get("VASWANI_DEMO_MODEL") or str(save_model_folder(
        tmp_path_factory.mktemp("demo") / "model", tiny_tokenizer, max_position_embeddings=256))
    model, tokenizer = load_model(folder)
    threads = torch.get_num_threads()
    if os.environ.get("VASWANI_DEMO_MODEL"):  # a trained model computes on both cores, as `vaswani-demo` does
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    demo = build_demo(model, tokenizer)
    url = launch(demo, host="127.0.0.1", port=free_port(), concurrency=2, block=False)
    yield url, model, tokenizer
    demo.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def browser():
    assert os.access(CHROMIUM, os.X_OK), f"no Chromium at {CHROMIUM}: apt-get install chromium"
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, served):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(served[0])
    expect(page.locator("#translate")).to_be_visible()
    yield page
    context.close()


# True once the source tokens' shading (the alpha of their background colours) is `weights`
SHADING_IS = """weights => {
    const alphas = [...document.querySelectorAll('#source_highlight .score-token')].map(
        span => parseFloat((span.style.backgroundColor.match(/rgba\\(.*,\\s*([0-9.]+)\\)/) || [0, 1])[1]));
    return alphas.length === weights.length && alphas.every((a, i) => Math.abs(a - weights[i]) < 0.02);
}"""


# True once the five pictures are in the page, each loaded and not empty (Gradio's images load lazily: those below the
# window are asked to load now)
PICTURES_SHOWN = """() => ["heads_encoder", "heads_decoder", "heads_cross", "head_enlarged", "positional"].every(id => {
    const img = document.querySelector(`#${id} img`);
    if (img !== null && img.loading !== "eager") img.loading = "eager";
    return img !== null && img.complete && img.naturalWidth > 0 && img.naturalHeight > 0;
})"""


def submit(page, text: str, beams=4, alpha=0.6, n=3) -> None:
    page.locator("#source textarea").fill(text)
    for field, value in (("#num_beams", beams), ("#length_penalty", alpha), ("#num_hypotheses", n)):
        page.locator(f"{field} input").fill(str(value))
    page.locator("#translate").click()


def picture(page, element: str, url: str):
    """The PIL image an `<img>` of the page shows (fetched from the page's own server), checked loaded."""
    from PIL import Image

    image = page.locator(f"#{element} img")
    image.scroll_into_view_if_needed()  # loaded lazily
    expect(image).to_be_visible()
    image.evaluate("img => { img.loading = 'eager'; }")
    page.wait_for_function("id => { const img = document.querySelector(`#${id} img`); "
                           "return img.complete && img.naturalWidth > 0; }", arg=element, timeout=TIMEOUT_MS)
    width, height = image.evaluate("img => [img.naturalWidth, img.naturalHeight]")
    source = image.get_attribute("src")
    with urllib.request.urlopen(urllib.parse.urljoin(url, source), timeout=30) as response:
        decoded = Image.open(io.BytesIO(response.read()))
        decoded.load()
    assert decoded.size == (width, height) and width > 0 and height > 0, (element, decoded.size, width, height)
    return decoded


def wait_for_answer(page, previous_status: str = "") -> str:
    status = page.locator("#status")
    expect(status).not_to_have_text(previous_status or "\u0000", timeout=TIMEOUT_MS)
    expect(status).to_contain_text(" s.", timeout=TIMEOUT_MS)
    return status.inner_text()


def test_translate_and_see_the_attention(page, served):
    import numpy as np

    url, model, tokenizer = served
    sentence = GERMAN[5] if not os.environ.get("VASWANI_DEMO_MODEL") else THIRTY_WORDS
    submit(page, sentence, beams=4, alpha=0.6, n=3)
    status = wait_for_answer(page)
    expected = core.translate_nbest(model, tokenizer, sentence, num_beams=4, length_penalty=0.6, num_hypotheses=3)
    assert status.startswith("3 hypotheses (beam 4, length penalty 0.6)")
    expect(page.locator("#translation textarea")).to_have_value(expected.hypotheses[0].text)
    assert expected.hypotheses[0].text
    assert page.locator("#hypotheses label").count() == 3
    # every heatmap is the image the page computed for the best hypothesis, last layer
    maps = core.hypothesis_attention(model, tokenizer, expected, 0)[-1]
    for kind in core.ATTENTION_KINDS:
        shown = picture(page, f"heads_{kind}", url)
        assert np.array_equal(np.asarray(shown.convert("RGB")), np.asarray(core.draw_heads(maps, kind))), kind
    enlarged, positional = picture(page, "head_enlarged", url), picture(page, "positional", url)
    assert enlarged.size == core.draw_head(maps, "cross", 0).size and min(enlarged.size) > 150
    assert positional.size == core.draw_positional_encoding(
        model, tokenizer.convert_ids_to_tokens(expected.source_ids)).size

    # the page says how to read the pictures and what the model was trained on
    expect(page.locator("#reading_the_pictures")).to_contain_text("a heatmap per head (numbered)")
    expect(page.locator("#reading_the_pictures")).to_contain_text("predicts")
    expect(page.locator("#reading_the_pictures")).to_contain_text("▁")
    expect(page.locator("#training_data")).to_contain_text(core.training_data_note(model.name_or_path)[:40])
    # the source tokens are listed, with "▁" as in the pictures, and no shading until a target token is chosen
    tokens = page.locator("#source_highlight .score-token")
    expect(tokens).to_have_count(len(expected.source_ids))
    page.wait_for_function(SHADING_IS, arg=[0.0] * len(expected.source_ids), timeout=TIMEOUT_MS)
    assert [t.strip() for t in tokens.all_inner_texts()] == [t.strip() for t in maps.source_tokens]

    # choosing a target token shades the source tokens by its encoder-decoder attention
    targets = page.locator("#target_token label")
    assert targets.count() == len(expected.hypotheses[0].ids) - 1
    assert [t.split(" ", 1)[1] for t in targets.all_inner_texts()] == maps.predicted_tokens[:targets.count()]
    targets.nth(1).click()
    shading = core.source_highlight(maps, 1)
    expect(tokens).to_have_count(len(shading))
    page.wait_for_function(SHADING_IS, arg=[round(w, 3) for _, w in shading], timeout=TIMEOUT_MS)
    assert [t.strip() for t in tokens.all_inner_texts()] == [t.strip() for t, _ in shading]
    if os.environ.get("VASWANI_DEMO_SCREENSHOT"):
        page.screenshot(path=os.environ["VASWANI_DEMO_SCREENSHOT"], full_page=True)

    # another hypothesis: its text and its attention
    page.locator("#hypotheses label").nth(2).click()  # answered with its four pictures: allow their drawing time
    expect(page.locator("#translation textarea")).to_have_value(expected.hypotheses[2].text, timeout=TIMEOUT_MS)
    third = core.hypothesis_attention(model, tokenizer, expected, 2)[-1]
    expect(page.locator("#target_token label")).to_have_count(len(expected.hypotheses[2].ids) - 1)
    shown = picture(page, "heads_decoder", url)
    assert shown.size == core.draw_heads(third, "decoder").size


# No two neighbours share a message: a message already shown would pass before its own request is answered, and the
# next click, made while that request runs, would be dropped (a button's click fires once at a time).
BAD_INPUTS = [
    ("", 4, "the text is empty"),
    ("x" * 10_001, 4, "10,001 characters; the page translates at most 10,000"),
    ("      ", 4, "the text is empty"),
    ("Ein Hund läuft.", 0, "Beam size must be a whole number from 1 to 12; got 0"),
    ("Ein Hund läuft.", 40, "Beam size must be a whole number from 1 to 12; got 40"),
]


def test_bad_input_gets_a_message_in_the_page(page):
    submit(page, GERMAN[0], beams=2, n=1)
    wait_for_answer(page)
    for text, beams, message in BAD_INPUTS:
        submit(page, text, beams=beams, n=1)
        expect(page.locator("#status")).to_contain_text(message)
        # the earlier answer is gone, not left beside the message
        expect(page.locator("#translation textarea")).to_have_value("")
        expect(page.locator("#heads_cross img")).to_have_count(0)
    # the page still works afterwards
    submit(page, GERMAN[1], beams=2, n=1)
    wait_for_answer(page, BAD_INPUTS[-1][2])
    expect(page.locator("#heads_cross img")).to_have_count(1)


def test_characters_outside_the_vocabulary_are_named(page):
    submit(page, "Ein Hund 日本.", beams=2, n=1)
    expect(page.locator("#status")).to_contain_text("Characters outside the vocabulary")
    expect(page.locator("#status")).to_contain_text("日 本")


def test_two_users_at_once_are_both_served(browser, served):
    pages = []
    for sentence in GERMAN[6:8]:
        context = browser.new_context()
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(served[0])
        expect(page.locator("#translate")).to_be_visible()
        pages.append((context, page, sentence))
    for _, page, sentence in pages:  # both submitted before either answers
        submit(page, sentence, beams=4, n=2)
    for context, page, sentence in pages:
        wait_for_answer(page)
        expected = core.translate_nbest(served[1], served[2], sentence, num_beams=4, length_penalty=0.6,
                                        num_hypotheses=2)
        expect(page.locator("#translation textarea")).to_have_value(expected.hypotheses[0].text)
        context.close()


def test_thirty_words_with_beam_4_and_every_picture(page, served):
    """A 30-word sentence, beam 4: the translation and all five pictures arrive. How long the page took from the click
    to the last picture is written to VASWANI_DEMO_TIMING (reported in docs/demo.md, not asserted: a speed is the
    machine's, not the code's)."""
    _, model, tokenizer = served
    assert len(THIRTY_WORDS.split()) == 30
    expected = core.translate_nbest(model, tokenizer, THIRTY_WORDS, num_beams=4, length_penalty=0.6, num_hypotheses=3)
    times = []
    for _ in range(3 if os.environ.get("VASWANI_DEMO_TIMING") else 1):
        submit(page, "", n=1)  # a message first, so that the answer below is told from the one before
        expect(page.locator("#status")).to_contain_text("the text is empty")
        started = time.perf_counter()
        submit(page, THIRTY_WORDS, beams=4, alpha=0.6, n=3)
        wait_for_answer(page, "the text is empty")
        page.wait_for_function(PICTURES_SHOWN, timeout=TIMEOUT_MS)
        times.append(time.perf_counter() - started)
        expect(page.locator("#translation textarea")).to_have_value(expected.hypotheses[0].text)
    if os.environ.get("VASWANI_DEMO_TIMING"):
        with open(os.environ["VASWANI_DEMO_TIMING"], "w", encoding="utf-8") as handle:
            json.dump({"seconds": times, "words": 30, "num_beams": 4, "model": os.environ.get("VASWANI_DEMO_MODEL"),
                       "server_status": page.locator("#status").inner_text(),
                       "translation": expected.hypotheses[0].text}, handle, ensure_ascii=False)
