"""generate(): greedy, beam search and sampling; the cache; padding; text in, text out; its refusals of bad arguments.

What makes generate() cheaper than transformers' defaults (`generation_vaswani.py`) gives exactly what the defaults
give:

- `_expand_inputs_for_generation` keeps one encoder row per sentence where the attention takes the beams (or samples)
  of a sentence against it (kernels_vaswani's "vaswani_sdpa", which generate() installs);
- `_reorder_cache` follows the beams in the self-attention cache only;
- the self-attention cache is `VaswaniSelfAttentionCache`, written in place into a preallocated buffer: its layer
  holds what transformers' `DynamicLayer` holds through updates, beam reorders, growth past its capacity, crops and
  batch selections, and `generate()` uses it unless given another cache;
- beam search leaves finished sentences out of the decoding steps;
- `logits_to_keep` projects only the positions asked for;
- the private GenerationMixin hooks overridden exist in the installed transformers, and each says why.
"""

import copy
import math
import re

import pytest
import torch
from helpers import GERMAN, copy_sources, padded_batch, sentences_differing_from_greedy, tiny_model, trained_copy_model
from transformers import (
    GenerationConfig,
    GenerationMixin,
    LogitsProcessor,
    LogitsProcessorList,
)
from transformers.cache_utils import DynamicCache, DynamicLayer, EncoderDecoderCache

from vaswani_hf import VaswaniForConditionalGeneration
from vaswani_hf.decoding.translate import translate_sentences
from vaswani_hf.generation_vaswani import VaswaniSelfAttentionCache, VaswaniSelfAttentionCacheLayer

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


@pytest.mark.parametrize("alpha", [2, 20])
@pytest.mark.parametrize("style", ["hf", "gnmt"])
def test_an_integer_length_penalty_decodes_as_its_float(alpha, style):
    """An integer alpha, as a generation_config.json may hold it (`"length_penalty": 20`), decodes as the same float;
    transformers would raise OverflowError on |Y|**20 as a Python int (above int64 from 9 tokens) divided into a
    tensor. 12 new tokens: the search reaches that length."""
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    common = dict(input_ids=ids, attention_mask=mask, num_beams=4, early_stopping=True, length_penalty_style=style,
                  return_dict_in_generate=True, output_scores=True, max_new_tokens=12)
    as_int = model.generate(length_penalty=alpha, **common)
    as_float = model.generate(length_penalty=float(alpha), **common)
    assert torch.equal(as_int.sequences, as_float.sequences)
    torch.testing.assert_close(as_int.sequences_scores, as_float.sequences_scores, rtol=0, atol=0)
    model.generation_config.length_penalty = alpha  # the folder's file, not the call, sets it
    common.pop("length_penalty_style")
    from_config = model.generate(length_penalty_style=style, **common)
    assert torch.equal(from_config.sequences, as_float.sequences)


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


def test_translate_sentences_packs_the_weights_once_for_all_its_batches(tiny_tokenizer, monkeypatch):
    """One packing of the weights serves every batch of a `translate_sentences` call (generate() would pack at each
    call), with the translations of one generate() call per sentence; afterwards the model is plain again."""
    from vaswani_hf import fast_paths_vaswani

    model = tiny_model(vocab_size=len(tiny_tokenizer)).eval()
    packed = []
    pack = fast_paths_vaswani.pack_for_inference
    monkeypatch.setattr(fast_paths_vaswani, "pack_for_inference", lambda weight: packed.append(1) or pack(weight))
    sources = GERMAN[:6]
    with torch.no_grad():
        alone = [tiny_tokenizer.decode(model.generate(**tiny_tokenizer(source, return_tensors="pt"),
                                                      max_new_tokens=8)[0], skip_special_tokens=True).strip()
                 for source in sources]
    per_call = len(packed) // len(sources)
    assert per_call > 0 and len(packed) == per_call * len(sources)  # generate() alone: a packing per call
    packed.clear()
    for workers in (1, 2):
        got = translate_sentences(model, tiny_tokenizer, sources, batch_size=1, max_new_tokens=8, workers=workers)
        assert got == alone, workers
        assert len(packed) == per_call, workers  # six batches, one packing
        packed.clear()
    assert {type(m).__name__ for m in model.modules()} >= {"Linear"} and not any(
        type(m).__name__ == "OneDNNLinear" for m in model.modules())


def test_translation_pipeline_returns_text(tiny_tokenizer, parallel_text):
    """`pipeline("translation")` works once vaswani_hf is imported (vaswani_hf.decoding.pipeline registers it again)."""
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


# Arguments out of range, and a tokenizer bigger than the model, are refused -------------------------------------------


def test_generate_refuses_an_empty_batch():
    model = tiny_model()
    for shape in ((0, 5), (2, 0)):
        with pytest.raises(ValueError, match="at least one sentence of at least one token"):
            model.generate(torch.zeros(shape, dtype=torch.long), max_new_tokens=3)


def test_translating_with_a_tokenizer_bigger_than_the_model(tiny_tokenizer):
    model = tiny_model()  # 99 entries; the tokenizer's ids go up to 419
    with pytest.raises(ValueError, match=r"input_ids holds token id \d+, outside this model's vocabulary of 99 "
                                         r"entries.*load the tokenizer saved with the model"):
        translate_sentences(model, tiny_tokenizer, GERMAN[:3], num_beams=1, max_new_tokens=3)


def test_generate_rejects_out_of_range_arguments():
    model = tiny_model()
    ids = torch.tensor([[5, 6, 7, 2]])
    # transformers itself fails on these with a ZeroDivisionError / a negative tensor dimension; ours says what is
    # wrong.
    for name, value in (("num_beams", 0), ("num_beams", -1), ("num_beams", 2.5), ("num_return_sequences", 0)):
        with pytest.raises(ValueError, match=rf"generate\(\): {name} must be an integer >= 1, got {value}"):
            model.generate(input_ids=ids, **{name: value})
    # These transformers refuses clearly already.
    with pytest.raises(ValueError, match="`max_new_tokens` must be greater than 0, but is -1"):
        model.generate(input_ids=ids, max_new_tokens=-1)
    with pytest.raises(ValueError, match=r"`num_return_sequences` \(3\) has to be smaller or equal to `num_beams` "
                                         r"\(2\)"):
        model.generate(input_ids=ids, num_beams=2, num_return_sequences=3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_beams=0), "num_beams must be an integer >= 1, got 0"),
        (dict(batch_size=0), "batch_size must be an integer >= 1, got 0"),
        (dict(batch_size=2.5), "batch_size must be an integer >= 1, got 2.5"),
        (dict(batch_size=True), "batch_size must be an integer >= 1, got True"),
        (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 1 or None, got -1"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1 or None, got 0"),
        (dict(max_source_length=0), "max_source_length must be an integer >= 1 or None, got 0"),
        (dict(length_penalty=math.nan), "length_penalty must be a finite number, got nan"),
    ],
)
def test_translate_sentences_rejects_out_of_range_arguments(tiny_tokenizer, kwargs, message):
    model = tiny_model(vocab_size=len(tiny_tokenizer))
    with pytest.raises(ValueError, match=re.escape(f"translate_sentences: {message}")):
        translate_sentences(model, tiny_tokenizer, GERMAN[:2], **kwargs)


# What makes generate() cheaper than transformers' defaults gives what the defaults give -------------------------------


class StockGeneration(VaswaniForConditionalGeneration):
    """Our model with transformers' own expansion (one encoder row per beam), cache (`DynamicCache`) and cache
    reordering (all caches)."""

    def _prepare_cache_for_generation(self, *args, **kwargs):
        return GenerationMixin._prepare_cache_for_generation(self, *args, **kwargs)

    def _expand_inputs_for_generation(self, *args, **kwargs):
        stock = GenerationMixin.__dict__["_expand_inputs_for_generation"]  # a staticmethod up to transformers 5.17
        return stock.__func__(*args, **kwargs) if isinstance(stock, staticmethod) else stock(self, *args, **kwargs)

    def _reorder_cache(self, past_key_values, beam_idx):
        past_key_values.reorder_cache(beam_idx)
        return past_key_values


def stock_copy(model: VaswaniForConditionalGeneration) -> StockGeneration:
    stock = StockGeneration(model.config).eval()
    stock.load_state_dict(model.state_dict())
    stock.generation_config = model.generation_config
    return stock


@pytest.mark.parametrize("kwargs", [
    dict(num_beams=4),
    dict(num_beams=3, num_return_sequences=2, length_penalty=1.0),
    dict(num_beams=4, use_cache=False),
    dict(num_beams=1, do_sample=False),
    dict(num_beams=1, do_sample=True, num_return_sequences=3, top_k=0),
])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_generation_matches_transformers_expansion_and_reordering(kwargs, attn):
    model = tiny_model(attn_implementation=attn)
    stock = stock_copy(model)
    ids, mask = padded_batch(length=9)
    outputs = []
    for candidate in (model, stock):
        torch.manual_seed(0)
        outputs.append(candidate.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True,
                                          output_scores=True, **kwargs, **SHORT))
    ours, expected = outputs
    assert torch.equal(ours.sequences, expected.sequences)
    assert sentences_differing_from_greedy(model, ours.sequences, kwargs, input_ids=ids, attention_mask=mask,
                                           **SHORT) != 0
    rows = ours.scores[0].shape[0] // 3  # of each sentence
    for step_ours, step_expected in zip(ours.scores, expected.scores, strict=True):
        finite = torch.isfinite(step_expected)
        assert torch.equal(finite, torch.isfinite(step_ours))
        torch.testing.assert_close(step_ours[finite], step_expected[finite], rtol=1e-5, atol=1e-5)
        # control: another sentence's rows (an encoder row shared with the wrong beams): 0.97 or more off, 10^5 times
        both = finite & finite.roll(rows, 0)
        assert (step_ours - step_expected.roll(rows, 0))[both].abs().max() > 0.1
    if kwargs.get("num_beams", 1) > 1:
        torch.testing.assert_close(ours.sequences_scores, expected.sequences_scores, rtol=1e-5, atol=1e-5)


def test_cross_attention_probabilities_come_back_one_row_per_beam():
    model = tiny_model()
    stock = stock_copy(model)
    ids, mask = padded_batch(length=9)
    ours, expected = (m.generate(input_ids=ids, attention_mask=mask, num_beams=4, return_dict_in_generate=True,
                                 output_attentions=True, **SHORT) for m in (model, stock))
    assert len(ours.cross_attentions) == len(expected.cross_attentions) == 8
    for step_ours, step_expected in zip(ours.cross_attentions, expected.cross_attentions, strict=True):
        for layer_ours, layer_expected in zip(step_ours, step_expected, strict=True):
            assert layer_ours.shape == layer_expected.shape == (12, 4, 1, 9)  # 3 sentences x 4 beams, 4 heads
            torch.testing.assert_close(layer_ours, layer_expected)
            # rows 4-7 are the beams of sentence 1 (2 padding positions), rows 8-11 those of sentence 2 (4)
            assert layer_ours[4:8, :, :, 7:].eq(0).all() and layer_ours[8:, :, :, 5:].eq(0).all()
            assert layer_ours[:4].gt(0).all()


@pytest.mark.parametrize("kwargs", [dict(num_beams=4), dict(do_sample=True, num_return_sequences=3)])
def test_encoder_decoder_keys_and_values_are_projected_once_per_sentence(kwargs):
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    rows = []
    for layer in model.model.decoder.layers:
        layer.encoder_attn.k_proj.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    out = model.generate(input_ids=ids, attention_mask=mask, **kwargs, **SHORT)
    assert out.shape[0] == 3 * kwargs.get("num_return_sequences", 1)
    assert rows == [3, 3]  # once per layer, for the 3 sentences, not for each of their beams or samples


def test_reorder_cache_moves_only_the_self_attention_cache():
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    decoder_ids = torch.tensor([[1, 5], [1, 6], [1, 7]])
    with torch.no_grad():
        cache = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, use_cache=True).past_key_values
    beam_idx = torch.tensor([2, 0, 0])
    expected_self = [(layer.keys[beam_idx], layer.values[beam_idx]) for layer in cache.self_attention_cache.layers]
    cross = [(layer.keys, layer.values) for layer in cache.cross_attention_cache.layers]
    assert model._reorder_cache(cache, beam_idx) is cache
    for layer, (keys, values) in zip(cache.self_attention_cache.layers, expected_self, strict=True):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    for layer, (keys, values) in zip(cache.cross_attention_cache.layers, cross, strict=True):
        assert layer.keys is keys and layer.values is values  # untouched: not even copied
    plain = DynamicCache()
    plain.update(torch.arange(6.0).view(3, 1, 2, 1), torch.arange(6.0).view(3, 1, 2, 1), 0)
    model._reorder_cache(plain, beam_idx)  # a decoder-only style cache is reordered as usual
    assert plain.layers[0].keys.flatten().tolist() == [4.0, 5.0, 0.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_only_an_attention_that_shares_encoder_rows_takes_one_row_for_several_decoder_rows(attn):
    """k consecutive decoder rows per encoder row (the beams of a sentence in generate()): kernels_vaswani's
    "vaswani_sdpa" (`shares_encoder_rows`) gives what repeating the encoder output k times gives; the plain
    implementations, and any call asking for attention probabilities (the eager reference), refuse them clearly."""
    model = tiny_model(attn_implementation=attn)
    ids, mask = padded_batch(length=9)
    decoder_ids = torch.randint(3, 99, (6, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        encoder = model.get_encoder()(input_ids=ids, attention_mask=mask)
        repeated = type(encoder)(last_hidden_state=encoder.last_hidden_state.repeat_interleave(2, dim=0))
        expected = model(encoder_outputs=repeated, attention_mask=mask.repeat_interleave(2, dim=0),
                         decoder_input_ids=decoder_ids)
        with pytest.raises(ValueError, match="6 decoder rows for 3 encoder rows: pass one encoder row per decoder row"):
            model(encoder_outputs=encoder, attention_mask=mask, decoder_input_ids=decoder_ids)
        model.set_attn_implementation("vaswani_sdpa")
        shared = model(encoder_outputs=encoder, attention_mask=mask, decoder_input_ids=decoder_ids)
        torch.testing.assert_close(shared.logits, expected.logits, rtol=1e-5, atol=1e-5)
        # control: encoder rows tiled instead of repeated (rows paired with the wrong sentences): 1.3 off, 10^5 times
        tiled = type(encoder)(last_hidden_state=encoder.last_hidden_state.repeat(2, 1, 1))
        wrong = model(encoder_outputs=tiled, attention_mask=mask.repeat(2, 1), decoder_input_ids=decoder_ids)
        assert (wrong.logits - expected.logits).abs().max() > 0.1
        with pytest.raises(ValueError, match="4 decoder rows for 3 encoder rows.*or k consecutive decoder rows"):
            model(encoder_outputs=encoder, attention_mask=mask, decoder_input_ids=decoder_ids[:4])
        with pytest.raises(ValueError, match="6 decoder rows for 3 encoder rows"):
            model(encoder_outputs=encoder, attention_mask=mask, decoder_input_ids=decoder_ids, output_attentions=True)


def test_logits_to_keep_projects_only_the_positions_asked_for():
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    decoder_ids = torch.randint(3, 99, (3, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        last = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, logits_to_keep=1).logits
        some = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids,
                     logits_to_keep=torch.tensor([0, 3])).logits
        labels = decoder_ids.clone()
        with_labels = model(input_ids=ids, attention_mask=mask, labels=labels, logits_to_keep=1)
    assert last.shape == (3, 1, 99) and some.shape == (3, 2, 99)
    torch.testing.assert_close(last, full[:, -1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(some, full[:, [0, 3]], rtol=1e-5, atol=1e-5)
    assert (last - full[:, -2:-1]).abs().max() > 0.1  # control: the position before, 3.6 off
    assert with_labels.logits.shape == (3, 5, 99)  # the loss needs every position: ignored with labels
    assert model._supports_logits_to_keep()  # so generate() passes logits_to_keep=1


class WithoutLogitsToKeep(VaswaniForConditionalGeneration):
    def _supports_logits_to_keep(self) -> bool:
        return False


def test_a_forced_decoder_prefix_generates_the_same_with_logits_to_keep():
    model = tiny_model()
    plain = WithoutLogitsToKeep(model.config).eval()
    plain.load_state_dict(model.state_dict())
    ids, mask = padded_batch(length=9)
    prefix = torch.tensor([[1, 7, 8]] * 3)
    for kwargs in (dict(num_beams=1, do_sample=False), dict(num_beams=4)):
        out = model.generate(input_ids=ids, attention_mask=mask, decoder_input_ids=prefix, **kwargs, **SHORT)
        expected = plain.generate(input_ids=ids, attention_mask=mask, decoder_input_ids=prefix, **kwargs, **SHORT)
        assert torch.equal(out[:, :3], prefix) and torch.equal(out, expected)
        assert sentences_differing_from_greedy(model, out, kwargs, input_ids=ids, attention_mask=mask,
                                               decoder_input_ids=prefix, **SHORT) != 0


@pytest.mark.parametrize("kwargs", [
    dict(num_beams=4, early_stopping=True),
    dict(num_beams=4, early_stopping=True, num_return_sequences=3),
    dict(num_beams=3, early_stopping=False, length_penalty=0.0),
    dict(num_beams=4, early_stopping="never", length_penalty=0.6),
])
def test_beam_search_leaves_finished_sentences_out_and_returns_the_same(kwargs):
    """The first decoding step runs once per sentence, and after the step in which a sentence is finished, decoding
    steps run on the open sentences' rows only; generate() returns exactly what it returns when every step runs on
    the whole batch."""
    model = trained_copy_model(steps=40)
    ids, mask = copy_sources(seed=3, batch=12, min_len=1, max_len=9)  # outputs of 2 to 10 tokens
    rows = []
    hook = model.model.decoder.register_forward_pre_hook(
        lambda module, args, kw: rows.append((kw.get("input_ids") if kw.get("input_ids") is not None
                                              else args[0]).shape[0]), with_kwargs=True)
    skipped = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, **kwargs)
    hook.remove()
    model.skip_finished_sentences = False
    everything = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, **kwargs)
    assert torch.equal(skipped, everything)
    assert sentences_differing_from_greedy(model, everything, kwargs, input_ids=ids, attention_mask=mask,
                                           max_new_tokens=20) >= 1
    full = ids.shape[0] * kwargs["num_beams"]
    assert rows[0] == ids.shape[0]  # the first step: one row per sentence (all its beams hold the start token)
    assert rows[1] == full and min(rows[1:]) < full  # then every beam, and fewer as sentences finished
    assert all(r % kwargs["num_beams"] == 0 for r in rows[1:]) and rows[1:] == sorted(rows[1:], reverse=True)
    with_scores = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, return_dict_in_generate=True,
                                 output_scores=True, **kwargs)
    assert torch.equal(with_scores.sequences, everything)  # returning scores: every step on the whole batch


def _stock_generate(model, **kwargs):
    """transformers' own beam search loop, every step on the whole batch."""
    model.lean_beam_search, model.skip_finished_sentences = False, False
    try:
        return model.generate(**kwargs)
    finally:
        model.lean_beam_search, model.skip_finished_sentences = True, None


def _count_calls(monkeypatch, cls, name) -> list:
    calls = []
    original = getattr(cls, name)

    def counted(self, *args, **kwargs):
        calls.append(len(args[0]))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, counted)
    return calls


@pytest.mark.parametrize("kwargs", [
    dict(num_beams=4),
    dict(num_beams=4, early_stopping=True, num_return_sequences=3),
    dict(num_beams=3, early_stopping=False, length_penalty=0.0),
    dict(num_beams=4, early_stopping="never", length_penalty=0.6),
    dict(num_beams=4, early_stopping=False, length_penalty=1.0),  # hypotheses improve after all beams finished
    dict(num_beams=5, length_penalty=1.4, length_penalty_style="gnmt"),
    dict(num_beams=2, early_stopping=True, num_return_sequences=2, length_penalty=-0.5),
    dict(num_beams=4, max_new_tokens=3),
])
def test_lean_beam_search_returns_transformers_sequences(kwargs, monkeypatch):
    """`LeanBeamSearch` (per-beam top-k, the first step once per sentence, finished sentences dropped from every
    state) returns token for token what transformers' loop returns on the whole batch, for a batch and for one
    sentence alone, with both length penalties and every early-stopping mode."""
    from vaswani_hf.generation_vaswani import LeanBeamSearch

    calls = _count_calls(monkeypatch, LeanBeamSearch, "run")
    model = trained_copy_model(steps=40)
    ids, mask = copy_sources(seed=3, batch=12, min_len=1, max_len=9)
    kwargs = {"max_new_tokens": 20, **kwargs}
    lean = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert calls == [ids.shape[0] * kwargs["num_beams"]]
    stock = _stock_generate(model, input_ids=ids, attention_mask=mask, **kwargs)
    assert lean.shape == stock.shape and torch.equal(lean, stock)
    assert sentences_differing_from_greedy(model, stock, kwargs, input_ids=ids, attention_mask=mask,
                                           max_new_tokens=kwargs["max_new_tokens"]) >= 1
    for row in (0, 5):  # one sentence: the lean search too, the same tokens as transformers' loop alone
        alone = model.generate(input_ids=ids[row:row + 1], attention_mask=mask[row:row + 1], **kwargs)
        assert torch.equal(alone, _stock_generate(model, input_ids=ids[row:row + 1],
                                                  attention_mask=mask[row:row + 1], **kwargs))
    assert len(calls) == 3


def test_lean_beam_search_keeps_a_padded_batch_and_a_decoder_prefix():
    """Padding in the sources and a forced decoder prefix: the lean search returns transformers' sequences."""
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    prefix = torch.tensor([[1, 7, 8]] * ids.shape[0])
    for extra in ({}, {"decoder_input_ids": prefix}):
        lean = model.generate(input_ids=ids, attention_mask=mask, num_beams=4, **extra, **SHORT)
        assert torch.equal(lean, _stock_generate(model, input_ids=ids, attention_mask=mask, num_beams=4, **extra,
                                                 **SHORT))
        if extra:
            assert torch.equal(lean[:, :3], prefix)


@pytest.mark.parametrize("kwargs", [
    dict(no_repeat_ngram_size=2), dict(min_new_tokens=6), dict(repetition_penalty=1.5), dict(suppress_tokens=[5, 6]),
])
def test_lean_beam_search_applies_transformers_row_wise_logits_processors(kwargs, monkeypatch):
    """transformers' processors that read each row alone (`LeanBeamSearch.ROW_WISE`) run inside the lean search, on
    the open rows: the sequences are transformers' loop's, and the processor changed them."""
    from vaswani_hf.generation_vaswani import LeanBeamSearch

    calls = _count_calls(monkeypatch, LeanBeamSearch, "run")
    model = trained_copy_model(steps=40)
    ids, mask = copy_sources(seed=4, batch=8, min_len=3, max_len=9)
    kwargs = dict(num_beams=4, max_new_tokens=20, **kwargs)
    out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert calls == [ids.shape[0] * 4]
    assert torch.equal(out, _stock_generate(model, input_ids=ids, attention_mask=mask, **kwargs))
    plain = model.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=20)
    assert out.shape != plain.shape or not torch.equal(out, plain)


def test_beam_search_with_another_logits_processor_keeps_transformers_loop(monkeypatch):
    """A logits processor the lean search cannot run on fewer rows (one it does not know, without `for_sentences`):
    transformers' loop runs (leaving finished sentences out) and returns its sequences."""
    from vaswani_hf.generation_vaswani import LeanBeamSearch

    class BanToken(LogitsProcessor):  # bans token 9 in the batch's first row: it needs to see every row
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[0, 9] = -float("inf")
            return scores

    calls = _count_calls(monkeypatch, LeanBeamSearch, "run")
    model = trained_copy_model(steps=40)
    ids, mask = copy_sources(seed=4, batch=8, min_len=3, max_len=9)
    kwargs = dict(num_beams=4, max_new_tokens=20, logits_processor=LogitsProcessorList([BanToken()]))
    out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    assert calls == []
    assert torch.equal(out, _stock_generate(model, input_ids=ids, attention_mask=mask, **kwargs))


@pytest.mark.parametrize("threads", [1, 2])
def test_paper_hypotheses_come_from_the_lean_search_with_transformers_sequences_and_scores(threads, monkeypatch):
    """`beam_search_hypotheses` (the choice on validation, `paper_generate`): per-sentence length limits
    (`SourceLengthLimitLogitsProcessor.for_sentences`) and `sequences_scores` (`output_sequences_scores`) in the lean
    search, on one thread and on two; the sequences are transformers' loop's and the scores agree within float32
    rounding."""
    from vaswani_hf.decoding.paper import beam_search_hypotheses
    from vaswani_hf.generation_vaswani import LeanBeamSearch

    calls = _count_calls(monkeypatch, LeanBeamSearch, "run")
    model = trained_copy_model(steps=40)
    ids, mask = copy_sources(seed=3, batch=12, min_len=1, max_len=9)
    saved = torch.get_num_threads()
    try:
        for max_len_b in (50, 2):  # 2: most sentences stop at their own limit, before </s>
            torch.set_num_threads(threads)
            lean = beam_search_hypotheses(model, ids, mask, num_beams=4, max_len_b=max_len_b)
            torch.set_num_threads(1)
            model.lean_beam_search = False
            stock = beam_search_hypotheses(model, ids, mask, num_beams=4, max_len_b=max_len_b)
            model.lean_beam_search = True
            assert torch.equal(lean.sequences, stock.sequences) and torch.equal(lean.lengths, stock.lengths)
            assert torch.equal(lean.valid, stock.valid)
            torch.testing.assert_close(lean.scores, stock.scores, rtol=0, atol=1e-5)
            if max_len_b == 2:  # each sentence's own limit holds, and binds
                limits = mask.sum(1, keepdim=True) + 2
                assert bool((lean.lengths <= limits).all()) and bool((lean.lengths == limits).any())
    finally:
        torch.set_num_threads(saved)
    assert len(calls) == 2


def test_output_sequences_scores_returns_transformers_sequences_scores_without_the_step_scores():
    """`output_sequences_scores=True` in the generation config beside `return_dict_in_generate=True`: the sequences
    and transformers' `sequences_scores` (what `output_scores=True` returns), not the per-step scores, from the lean
    search and from transformers' loop alike."""
    model = trained_copy_model(steps=40)
    ids, mask = copy_sources(seed=3, batch=6, min_len=1, max_len=9)
    config = GenerationConfig(num_beams=4, max_new_tokens=20, num_return_sequences=2, length_penalty=0.6,
                              return_dict_in_generate=True, decoder_start_token_id=model.config.decoder_start_token_id,
                              eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id)
    reference = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, output_scores=True)
    config.output_sequences_scores = True
    for lean in (True, False):
        model.lean_beam_search = lean
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        assert torch.equal(out.sequences, reference.sequences) and out.scores is None
        torch.testing.assert_close(out.sequences_scores, reference.sequences_scores, rtol=0, atol=1e-5)
    model.lean_beam_search = True


def test_beam_search_on_two_threads_returns_the_one_thread_sequences(monkeypatch):
    """With two torch threads (sharing each product), the lean beam search returns the one-thread sequences."""
    from vaswani_hf.generation_vaswani import LeanBeamSearch

    calls = _count_calls(monkeypatch, LeanBeamSearch, "run")
    model = trained_copy_model(steps=40)
    ids, mask = copy_sources(seed=5, batch=9, min_len=1, max_len=9)
    kwargs = dict(num_beams=4, num_return_sequences=2, max_new_tokens=20)
    one = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    finally:
        torch.set_num_threads(threads)
    assert calls == [36, 36] and torch.equal(two, one)


@pytest.mark.parametrize("kwargs", [
    dict(), dict(max_new_tokens=3), dict(no_repeat_ngram_size=2), dict(min_new_tokens=6),
])
@pytest.mark.parametrize("threads", [1, 2])
def test_lean_greedy_search_returns_transformers_sequences(kwargs, threads, monkeypatch):
    """Greedy search drops finished sentences from its steps (`LeanGreedySearch`), on one thread or two, and returns
    token for token what transformers' `_sample` returns on the whole batch, for a batch and one sentence."""
    from vaswani_hf.generation_vaswani import LeanGreedySearch

    calls = _count_calls(monkeypatch, LeanGreedySearch, "run")
    model = trained_copy_model(steps=40)
    ids, mask = copy_sources(seed=3, batch=12, min_len=1, max_len=9)
    kwargs = {"num_beams": 1, "do_sample": False, "max_new_tokens": 20, **kwargs}
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lean = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        alone = model.generate(input_ids=ids[4:5], attention_mask=mask[4:5], **kwargs)
    finally:
        torch.set_num_threads(saved)
    assert calls == [ids.shape[0], 1]
    stock = _stock_generate(model, input_ids=ids, attention_mask=mask, **kwargs)
    assert lean.shape == stock.shape and torch.equal(lean, stock)
    assert torch.equal(alone, _stock_generate(model, input_ids=ids[4:5], attention_mask=mask[4:5], **kwargs))
    lengths = stock.ne(model.config.pad_token_id).sum(1)
    assert int(lengths.min()) < int(lengths.max())  # sentences ended at different steps: rows were dropped


def test_greedy_search_with_a_streamer_or_scores_keeps_transformers_loop(monkeypatch):
    """A streamer, or scores returned, keep transformers' `_sample`: the lean greedy search does not run."""
    from transformers import TextStreamer

    from vaswani_hf.generation_vaswani import LeanGreedySearch

    calls = _count_calls(monkeypatch, LeanGreedySearch, "run")
    model = trained_copy_model(steps=40)
    ids, mask = copy_sources(seed=3, batch=1, min_len=3, max_len=6)
    seen = []

    class Tokens:  # a tokenizer stand-in that records what the streamer decodes
        def decode(self, tokens, **kwargs):
            seen.append(list(tokens))
            return ""

    plain = model.generate(input_ids=ids, attention_mask=mask, num_beams=1, do_sample=False, max_new_tokens=20)
    streamed = model.generate(input_ids=ids, attention_mask=mask, num_beams=1, do_sample=False, max_new_tokens=20,
                              streamer=TextStreamer(Tokens()))
    scored = model.generate(input_ids=ids, attention_mask=mask, num_beams=1, do_sample=False, max_new_tokens=20,
                            return_dict_in_generate=True, output_scores=True)
    assert calls == [1] and torch.equal(streamed, plain) and torch.equal(scored.sequences, plain)
    assert len(scored.scores) == plain.shape[1] - 1 and seen and seen[-1] == plain[0].tolist()  # start token too


@pytest.mark.parametrize("num_beams", [1, 4])
def test_lean_searches_run_stopping_criteria_that_say_which_sentences_they_are_for(num_beams, monkeypatch):
    """A stopping criterion with `for_sentences` (as `vaswani-train`'s `StopWhen`, which ends validation when training
    must stop) runs inside the lean searches: sequences are those of transformers' loop with the same criterion, cut
    where it stops them."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from vaswani_hf.generation_vaswani import LeanBeamSearch, LeanGreedySearch

    class StopAfter(StoppingCriteria):  # stops every sentence once its sequences reach `length` tokens
        def __init__(self, length):
            self.length = length

        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)

        def for_sentences(self, sentences):
            return self

    calls = _count_calls(monkeypatch, LeanGreedySearch if num_beams == 1 else LeanBeamSearch, "run")
    model = trained_copy_model(steps=40)
    ids, mask = copy_sources(seed=3, batch=12, min_len=1, max_len=9)
    for length in (4, 30):
        kwargs = dict(num_beams=num_beams, do_sample=False, max_new_tokens=20,
                      stopping_criteria=StoppingCriteriaList([StopAfter(length)]))
        lean = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        assert torch.equal(lean, _stock_generate(model, input_ids=ids, attention_mask=mask, **kwargs))
        if length == 4:  # cut at 4 tokens, the decoder start included
            assert lean.shape[1] == 4
        else:  # never reached: as without the criterion
            assert torch.equal(lean, model.generate(input_ids=ids, attention_mask=mask, num_beams=num_beams,
                                                    do_sample=False, max_new_tokens=20))
    assert len(calls) == 3  # with the criterion, twice; without it, once


def test_validation_cut_short_by_the_stop_signal_runs_in_the_lean_beam_search(monkeypatch):
    """`vaswani-train`'s `StopWhen` (validation ends when training must stop) keeps validation's beam search in
    `LeanBeamSearch`, which stops every sentence at the step the signal turns true."""
    from transformers import StoppingCriteriaList

    from vaswani_hf.generation_vaswani import LeanBeamSearch
    from vaswani_training.train import StopWhen

    calls = _count_calls(monkeypatch, LeanBeamSearch, "run")
    model = trained_copy_model(steps=40)
    ids, mask = copy_sources(seed=3, batch=6, min_len=5, max_len=9)
    plain = model.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=20)
    steps = []
    stop = StopWhen(lambda: steps.append(1) or len(steps) > 8)  # asked once a step: true from the 9th
    cut = model.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=20,
                         stopping_criteria=StoppingCriteriaList([stop]))
    assert len(calls) == 2 and cut.shape[1] < plain.shape[1]


def test_the_private_generation_hooks_overridden_are_transformers_own_and_say_why():
    """An override of a GenerationMixin method that transformers renamed or dropped would silently stop running: every
    private method of `VaswaniGenerationMixin` that is not its own helper is one that the installed GenerationMixin
    defines (or, for `_reorder_cache`, calls), and each says why the public API cannot do its work."""
    import inspect

    from vaswani_hf.generation_vaswani import VaswaniGenerationMixin

    private = {name for name, value in vars(VaswaniGenerationMixin).items()
               if name.startswith("_") and not name.startswith("__") and callable(value)}
    helpers = set()
    hooks = private - helpers
    assert hooks == {"_expand_inputs_for_generation", "_prepare_cache_for_generation", "_beam_search",
                     "_update_finished_beams", "_reorder_cache", "_prepare_generated_length", "_sample"}
    assert not helpers & set(dir(GenerationMixin))  # our helpers override nothing
    for name in hooks - {"_reorder_cache"}:
        assert name in dir(GenerationMixin), name
    assert "self._reorder_cache(" in inspect.getsource(GenerationMixin._beam_search)
    for name in hooks:
        assert "# Private hook: " in inspect.getsource(getattr(VaswaniGenerationMixin, name)), name


# The in-place self-attention cache (`VaswaniSelfAttentionCacheLayer`) -------------------------------------------------


def _steps(seed: int = 0, batch: int = 6, heads: int = 2, head_dim: int = 4, steps: int = 7):
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        length = 3 if step == 0 else 1  # a prefix first, then one position at a time
        yield (torch.randn(batch, heads, length, head_dim, generator=generator),
               torch.randn(batch, heads, length, head_dim, generator=generator),
               torch.randint(0, batch, (batch,), generator=generator))


@pytest.mark.parametrize("capacity", [0, 2, 64])
def test_cache_layer_holds_what_dynamic_layer_holds(capacity):
    ours, reference = VaswaniSelfAttentionCacheLayer(capacity), DynamicLayer()
    for keys, values, beam_idx in _steps():
        got, expected = ours.update(keys, values), reference.update(keys, values)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        ours.reorder_cache(beam_idx)
        reference.reorder_cache(beam_idx)
        assert torch.equal(ours.keys, reference.keys) and torch.equal(ours.values, reference.values)
        assert ours.get_seq_length() == reference.get_seq_length()
    assert ours.get_seq_length() == 9
    ours.crop(-2)
    reference.crop(-2)
    assert torch.equal(ours.keys, reference.keys) and ours.get_seq_length() == 7
    for layer in (ours, reference):
        layer.batch_select_indices(torch.tensor([4, 1]))
        layer.batch_repeat_interleave(3)
    assert ours.keys.shape == (6, 2, 7, 4)
    assert torch.equal(ours.keys, reference.keys) and torch.equal(ours.values, reference.values)
    keys, values, _ = next(_steps(seed=1))
    got, expected = ours.update(keys, values), reference.update(keys, values)  # still appends after all that
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    with pytest.raises(ValueError, match="negative"):
        ours.crop(3)
    ours.reset()
    assert ours.get_seq_length() == 0


def test_cache_layer_writes_in_place_within_its_capacity():
    layer = VaswaniSelfAttentionCacheLayer(capacity=16)
    pointers = set()
    for keys, values, beam_idx in _steps(steps=10):
        layer.update(keys, values)
        pointers.add(layer.keys.data_ptr())
        layer.reorder_cache(beam_idx)
        pointers.add(layer.keys.data_ptr())
    assert len(pointers) == 2  # the buffer and its spare, swapped at each reorder: nothing new allocated


def test_generate_uses_the_in_place_cache_unless_given_one():
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    seen = []
    hook = model.model.decoder.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("cache")), with_kwargs=True)
    model.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=5)
    assert isinstance(seen[-1], EncoderDecoderCache)
    assert isinstance(seen[-1].self_attention_cache, VaswaniSelfAttentionCache)
    assert all(isinstance(layer, VaswaniSelfAttentionCacheLayer) for layer in seen[-1].self_attention_cache.layers)
    seen.clear()
    mine = EncoderDecoderCache(DynamicCache(), DynamicCache())
    model.generate(input_ids=ids, attention_mask=mask, num_beams=1, max_new_tokens=5, past_key_values=mine)
    assert seen[-1] is mine and type(mine.self_attention_cache.layers[0]) is DynamicLayer
    hook.remove()
