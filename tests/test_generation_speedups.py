"""What makes generate() cheaper than transformers' defaults gives exactly what the defaults give.

- `_expand_inputs_for_generation` keeps one encoder row per sentence, and encoder-decoder attention groups the
  beams (or samples) of a sentence against it (`generation_vaswani.group_queries`);
- `_reorder_cache` follows the beams in the self-attention cache only;
- the self-attention cache is `VaswaniSelfAttentionCache` (written in place, no concatenation), not `DynamicCache`;
- `logits_to_keep` projects only the positions asked for;
- `torch.compile` of the forward matches eager;
- the private GenerationMixin hooks overridden exist in the installed transformers, and each says why.
"""


import pytest
import torch
from helpers import padded_batch, sentences_differing_from_greedy, tiny_model
from transformers import GenerationMixin
from transformers.cache_utils import DynamicCache

from vaswani_hf import VaswaniForConditionalGeneration

SHORT = dict(max_new_tokens=8)


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
    model.use_cpu_packed_linears = False  # k_proj itself runs (not the packed k|v matrix), so the hook sees it
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
def test_decoder_rows_may_share_encoder_rows(attn):
    """k consecutive decoder rows per encoder row give what repeating the encoder output k times gives."""
    model = tiny_model(attn_implementation=attn)
    ids, mask = padded_batch(length=9)
    decoder_ids = torch.randint(3, 99, (6, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        encoder = model.get_encoder()(input_ids=ids, attention_mask=mask)
        repeated = type(encoder)(last_hidden_state=encoder.last_hidden_state.repeat_interleave(2, dim=0))
        expected = model(encoder_outputs=repeated, attention_mask=mask.repeat_interleave(2, dim=0),
                         decoder_input_ids=decoder_ids, output_attentions=True)
        shared = model(encoder_outputs=encoder, attention_mask=mask, decoder_input_ids=decoder_ids,
                       output_attentions=True)
        torch.testing.assert_close(shared.logits, expected.logits, rtol=1e-5, atol=1e-5)
        # control: encoder rows tiled instead of repeated (rows paired with the wrong sentences): 1.3 off, 10^5 times
        tiled = type(encoder)(last_hidden_state=encoder.last_hidden_state.repeat(2, 1, 1))
        wrong = model(encoder_outputs=tiled, attention_mask=mask.repeat(2, 1), decoder_input_ids=decoder_ids)
        assert (wrong.logits - expected.logits).abs().max() > 0.1
        for ours, reference in zip(shared.cross_attentions, expected.cross_attentions, strict=True):
            assert ours.shape == reference.shape == (6, 4, 4, 9)
            torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
        shared = model(encoder_outputs=encoder, attention_mask=mask, decoder_input_ids=decoder_ids)  # sdpa path
        torch.testing.assert_close(shared.logits, expected.logits, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="decoder rows for 3 encoder rows"):
            model(encoder_outputs=encoder, attention_mask=mask, decoder_input_ids=decoder_ids[:4])


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


def test_torch_compile_forward_matches_eager():
    """torch.compile of the training forward (loss and logits) matches eager. Compiling a tiny model on CPU takes
    5-20 s (graph breaks at the data-dependent input checks). torch ships inductor, and the project's machines have
    the C++ compiler it needs, so a failure to compile is a failure of this test."""
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    labels = ids.masked_fill(mask.eq(0), -100)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, labels=labels)
        compiled = torch.compile(model)
        out = compiled(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # control: a graph that lost the padding mask: logits 0.8 off, loss 0.06 (10^3 times)
        unmasked = model(input_ids=ids, attention_mask=torch.ones_like(mask), labels=labels)
    assert (unmasked.logits - expected.logits).abs().max() > 0.1
    assert abs(float(unmasked.loss) - float(expected.loss)) > 1e-4


def test_torch_compile_decoding_matches_eager():
    """generate() with a compiled forward (the decoding steps, the in-place cache, the grouped cross-attention)
    gives eager's beams. It recompiles as the cached length grows (the cache's length is a Python int); about 20 s
    on 2 cores for this tiny model."""
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    expected = model.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=4)
    model.forward = torch.compile(model.forward)
    out = model.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=4)
    assert torch.equal(out, expected)
    assert sentences_differing_from_greedy(tiny_model(), expected, dict(num_beams=4), input_ids=ids,
                                           attention_mask=mask, max_new_tokens=4) >= 1


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
    from helpers import copy_sources, trained_copy_model

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


def test_the_private_generation_hooks_overridden_are_transformers_own_and_say_why():
    """An override of a GenerationMixin method that transformers renamed or dropped would silently stop running: every
    private method of `VaswaniGenerationMixin` that is not its own helper is one that the installed GenerationMixin
    defines (or, for `_reorder_cache`, calls), and each says why the public API cannot do its work."""
    import inspect

    from vaswani_hf.generation_vaswani import VaswaniGenerationMixin

    private = {name for name, value in vars(VaswaniGenerationMixin).items()
               if name.startswith("_") and not name.startswith("__") and callable(value)}
    helpers = {"_length_limit_for", "_finished_sentences_step"}
    hooks = private - helpers
    assert hooks == {"_expand_inputs_for_generation", "_prepare_cache_for_generation", "_beam_search",
                     "_update_finished_beams", "_reorder_cache"}
    assert not helpers & set(dir(GenerationMixin))  # our helpers override nothing
    for name in hooks - {"_reorder_cache"}:
        assert name in dir(GenerationMixin), name
    assert "self._reorder_cache(" in inspect.getsource(GenerationMixin._beam_search)
    for name in hooks:
        assert "# Private hook: " in inspect.getsource(getattr(VaswaniGenerationMixin, name)), name
