"""generate(): greedy, beam search and sampling; the cache; padding; text in, text out."""

import copy

import pytest
import torch
from helpers import padded_batch, sentences_differing_from_greedy, tiny_model
from transformers import GenerationMixin, LogitsProcessor, LogitsProcessorList

SHORT = dict(max_new_tokens=8)


def trim(row: torch.Tensor) -> list[int]:
    """A generated row up to and including its first </s> (id 2), padding dropped."""
    tokens = row.tolist()
    return tokens[: tokens.index(2, 1) + 1] if 2 in tokens[1:] else [t for t in tokens if t != 0]


def test_greedy_is_argmax_of_the_model():
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    out = model.generate(input_ids=ids, attention_mask=mask, num_beams=1, do_sample=False, **SHORT)
    assert out.shape == (3, 9) and out[:, 0].eq(1).all()  # starts with <s> = decoder_start_token_id
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=out).logits
    # every generated token is the argmax given the tokens before it (no row finished: no </s> in out)
    assert not out[:, 1:].eq(2).any()
    assert torch.equal(logits[:, :-1].argmax(-1), out[:, 1:])


def test_default_decoding_is_beam_4_with_length_penalty():
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    default = model.generate(input_ids=ids, attention_mask=mask, **SHORT)
    explicit = model.generate(input_ids=ids, attention_mask=mask, num_beams=4, length_penalty=0.6,
                              early_stopping=True, **SHORT)
    assert torch.equal(default, explicit)
    assert sentences_differing_from_greedy(model, default, dict(num_beams=4), input_ids=ids, attention_mask=mask,
                                           **SHORT) >= 1
    # beam search with several returned hypotheses, best first
    out = model.generate(input_ids=ids, attention_mask=mask, num_beams=4, num_return_sequences=3,
                         return_dict_in_generate=True, output_scores=True, **SHORT)
    assert out.sequences.shape[0] == 9
    scores = out.sequences_scores.view(3, 3)
    assert (scores[:, :-1] >= scores[:, 1:]).all()
    for row in range(3):
        hypotheses = {tuple(trim(s)) for s in out.sequences[3 * row: 3 * row + 3]}
        assert len(hypotheses) == 3


@pytest.mark.parametrize("kwargs", [dict(num_beams=1, do_sample=False), dict(num_beams=4),
                                    dict(num_beams=3, num_return_sequences=2, length_penalty=1.0)])
def test_cached_and_uncached_generation_are_identical(kwargs):
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    cached = model.generate(input_ids=ids, attention_mask=mask, use_cache=True, **kwargs, **SHORT)
    uncached = model.generate(input_ids=ids, attention_mask=mask, use_cache=False, **kwargs, **SHORT)
    assert torch.equal(cached, uncached)
    assert sentences_differing_from_greedy(model, cached, kwargs, input_ids=ids, attention_mask=mask, **SHORT) != 0


@pytest.mark.parametrize("kwargs", [dict(num_beams=1, do_sample=False), dict(num_beams=4)])
def test_cross_attention_keys_and_values_are_computed_once_per_generate(kwargs):
    model = tiny_model()
    model.use_cpu_packed_linears = False  # k_proj itself runs (not the packed k|v matrix), so the hook sees it
    ids, mask = padded_batch(length=9)
    calls = []
    for layer in model.model.decoder.layers:
        layer.encoder_attn.k_proj.register_forward_hook(lambda *args: calls.append(1))
    out = model.generate(input_ids=ids, attention_mask=mask, **kwargs, **SHORT)
    assert out.shape[1] == 9  # 8 decoding steps
    assert len(calls) == 2  # once per decoder layer, not once per step
    calls.clear()
    model.generate(input_ids=ids, attention_mask=mask, use_cache=False, **kwargs, **SHORT)
    assert len(calls) == 2 * 8  # without the cache: every step


def test_sampling_is_reproducible_with_a_seed():
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(model.generate(input_ids=ids, attention_mask=mask, do_sample=True, num_beams=1, top_k=0,
                                   max_new_tokens=12))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    greedy = model.generate(input_ids=ids, attention_mask=mask, num_beams=1, do_sample=False, max_new_tokens=12)
    assert not torch.equal(runs[0], greedy)


@pytest.mark.parametrize("kwargs", [dict(num_beams=1, do_sample=False), dict(num_beams=4)])
def test_reusing_encoder_outputs_gives_the_same_translation(kwargs):
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    expected = model.generate(input_ids=ids, attention_mask=mask, **kwargs, **SHORT)
    encoder_outputs = model.get_encoder()(input_ids=ids, attention_mask=mask)
    calls = []
    model.model.encoder.register_forward_hook(lambda *args: calls.append(1))
    again = model.generate(encoder_outputs=encoder_outputs, attention_mask=mask, **kwargs, **SHORT)
    assert torch.equal(again, expected)
    assert calls == []  # the encoder did not run again
    assert sentences_differing_from_greedy(model, expected, kwargs, input_ids=ids, attention_mask=mask, **SHORT) != 0


@pytest.mark.parametrize("kwargs", [dict(num_beams=1, do_sample=False), dict(num_beams=4)])
def test_a_padded_batch_translates_each_sentence_as_alone(kwargs):
    model = tiny_model()
    ids, mask = padded_batch(batch=4, length=11)
    batched = model.generate(input_ids=ids, attention_mask=mask, **kwargs, **SHORT)
    for row in range(4):
        n = int(mask[row].sum())
        alone = model.generate(input_ids=ids[row: row + 1, :n], **kwargs, **SHORT)
        assert trim(batched[row]) == trim(alone[0])
    assert sentences_differing_from_greedy(model, batched, kwargs, input_ids=ids, attention_mask=mask, **SHORT) != 0


class EndFirstSentenceEarly(LogitsProcessor):
    """Forces </s> (id 2) as the 2nd generated token of the first input sentence and forbids it everywhere else,
    so that sentence finishes while the others run to max_new_tokens."""

    def __init__(self, rows_per_sentence: int):
        self.rows = rows_per_sentence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        scores[self.rows:, 2] = -float("inf")
        if input_ids.shape[1] == 2:
            eos_only = torch.full_like(scores[: self.rows], -float("inf"))
            eos_only[:, 2] = 0.0
            scores[: self.rows] = eos_only
        return scores


@pytest.mark.parametrize("kwargs", [dict(num_beams=1, do_sample=False), dict(num_beams=4),
                                    dict(num_beams=4, num_return_sequences=4)])
def test_finished_sequences_are_padded_with_pad_not_eos(kwargs):
    """transformers' beam search pads with `pad_token_id or eos_token_id`, i.e. </s> when the pad id is 0 (our
    rows `[1, x, 2, 2, 2, ...]`); greedy pads with <pad>. Our generate() makes both pad with <pad>."""
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    processors = LogitsProcessorList([EndFirstSentenceEarly(kwargs.get("num_beams", 1))])
    out = model.generate(input_ids=ids, attention_mask=mask, logits_processor=processors, **kwargs, **SHORT)
    raw = GenerationMixin.generate(model, input_ids=ids, attention_mask=mask, logits_processor=processors, **kwargs,
                                   **SHORT)
    assert out.shape == raw.shape == (3 * kwargs.get("num_return_sequences", 1), 9)
    finished = out[: kwargs.get("num_return_sequences", 1)]  # the first sentence's hypotheses
    assert finished[:, 2].eq(2).all()
    assert finished[:, 3:].eq(0).all()  # padding, not </s>
    assert torch.equal(out[:, :3], raw[:, :3])  # nothing up to </s> changes...
    assert torch.equal(out[len(finished):], raw[len(finished):])  # ...nor in unfinished sentences
    assert not out[len(finished):].eq(2).any() and not out[len(finished):].eq(0).any()


def test_text_in_text_out_with_the_tokenizer(tiny_tokenizer, parallel_text):
    """Tokenize, generate, decode: what the translation pipeline does, by hand."""
    model = tiny_model(vocab_size=len(tiny_tokenizer))
    sources = parallel_text[0][:3]
    batch = tiny_tokenizer(sources, padding=True, return_tensors="pt")
    generated = model.generate(**batch, max_new_tokens=6)
    texts = tiny_tokenizer.batch_decode(generated, skip_special_tokens=True)
    assert len(texts) == 3 and all(isinstance(t, str) and t for t in texts)
    for source, text in zip(sources, texts):
        alone = model.generate(**tiny_tokenizer(source, return_tensors="pt"), max_new_tokens=6)
        assert tiny_tokenizer.decode(alone[0], skip_special_tokens=True) == text


def test_translation_pipeline_returns_text(tiny_tokenizer, parallel_text):
    """`pipeline("translation")` works once vaswani_hf is imported (vaswani_hf.pipeline registers it again)."""
    from transformers import pipeline

    model = tiny_model(vocab_size=len(tiny_tokenizer))
    translator = pipeline("translation", model=model, tokenizer=tiny_tokenizer)
    sources = parallel_text[0][:2]
    results = translator(sources, max_new_tokens=6, num_beams=2)
    assert len(results) == 2 and all(isinstance(result, dict) for result in results)  # flat, as in transformers
    single = translator(sources[0], max_new_tokens=6, num_beams=2)
    assert single == [results[0]]
    for result, source in zip(results, sources):
        text = result["translation_text"]
        assert isinstance(text, str) and text
        expected = model.generate(**tiny_tokenizer(source, return_tensors="pt"), max_new_tokens=6, num_beams=2)
        assert text == tiny_tokenizer.decode(expected[0], skip_special_tokens=True).strip()


@pytest.mark.parametrize("kwargs", [dict(num_beams=1), dict(num_beams=3), dict(do_sample=True, num_return_sequences=2)])
def test_static_cache_gives_the_dynamic_caches_tokens(kwargs):
    model = tiny_model(seed=2)
    ids, mask = padded_batch(length=9)
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, **kwargs)
    torch.manual_seed(0)
    dynamic = model.generate(**common)
    torch.manual_seed(0)
    static = model.generate(**common, cache_implementation="static")
    assert torch.equal(static, dynamic)
    assert sentences_differing_from_greedy(model, dynamic, kwargs, input_ids=ids, attention_mask=mask,
                                           max_new_tokens=8, min_new_tokens=8) != 0


def test_compiled_decoding_step_gives_eager_tokens():
    from transformers import CompileConfig

    model = tiny_model(seed=2)
    ids, mask = padded_batch(length=9)
    graphs = []

    def backend(graph_module, example_inputs):  # records each compiled graph, runs it as traced
        graphs.append(graph_module)
        return graph_module.forward

    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=None)
    compile_config._compile_all_devices = True  # transformers compiles decoding steps on GPUs only by default
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, num_beams=1)
    eager = model.generate(**common)
    compiled = model.generate(**common, cache_implementation="static", compile_config=compile_config)
    assert graphs  # the decoding step was traced whole (fullgraph=True raises on any graph break)
    assert torch.equal(compiled, eager)


def test_plain_generate_calls_do_not_warn():
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging

    model = tiny_model()
    ids, mask = padded_batch(length=9)
    assert model.generation_config.max_length == 256  # the bound of calls that give no length
    verbosity = logging.get_verbosity()
    logging.set_verbosity_warning()  # another test (the benchmark's import) may have silenced transformers
    try:
        _generate_and_capture(model, ids, mask, CaptureLogger, logging)
    finally:
        logging.set_verbosity(verbosity)


def _generate_and_capture(model, ids, mask, CaptureLogger, logging):
    with CaptureLogger(logging.get_logger("transformers.generation.utils")) as captured:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5,
                       generation_config=copy.deepcopy(model.generation_config))
    assert out.shape == (3, 6)
    assert "max_length" not in captured.out, captured.out
    with CaptureLogger(logging.get_logger("transformers.generation.utils")) as captured:  # the check can fail
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, max_length=30)
    assert "max_length" in captured.out
    assert model.generation_config.max_length == 256  # restored
