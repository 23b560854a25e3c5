"""The model (§3): attention kernels and masks, positional encoding, cache, loss, initialization, parameter counts,
and the behaviour transformers' common model tests expect (save/load, tied weights, resizing, batching); and, as a
hypothesis property, outputs of the right shape, finite and independent of padding for arbitrary batch sizes, lengths
and padding contents."""

import contextlib
import math
import warnings

import pytest
import torch
from helpers import GERMAN, padded_batch, tiny_config, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from transformers import (
    AttentionInterface,
    AutoModel,
    AutoModelForSeq2SeqLM,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    Trainer,
    TrainingArguments,
)
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import find_labels

import vaswani_hf.configuration_vaswani as configuration_vaswani
import vaswani_hf.modeling_vaswani as modeling
from vaswani_hf import VaswaniConfig, VaswaniForConditionalGeneration, VaswaniModel
from vaswani_hf.decoding.translate import translate_sentences
from vaswani_hf.fast_paths_vaswani import training_fast_paths
from vaswani_hf.modeling_vaswani import CACHE_NAME, cross_entropy_loss, shift_tokens_right, sinusoidal_table

ATOL = 1e-5


def labels_for(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ids.masked_fill(mask == 0, -100)


# §3.2 attention kernels and masks ----------------------------------------------------------------------------------


def test_default_implementation_is_sdpa_and_eager_matches_it_with_padding():
    model = tiny_model()
    assert model.config._attn_implementation == "sdpa"
    ids, mask = padded_batch(length=9)
    target, target_mask = padded_batch(seed=1, length=7)
    inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=target, decoder_attention_mask=target_mask)
    with torch.no_grad():
        sdpa = model(**inputs)
        model.set_attn_implementation("eager")
        assert model.config._attn_implementation == "eager"
        eager = model(**inputs)
        unmasked = model(input_ids=ids, decoder_input_ids=target)
    torch.testing.assert_close(eager.logits, sdpa.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(eager.encoder_last_hidden_state, sdpa.encoder_last_hidden_state, atol=ATOL, rtol=0)
    # control: a kernel that dropped the masks is 1.0 off, 10^5 times ATOL
    assert (unmasked.logits - sdpa.logits).abs().max() > 1e-2
    # and through from_config / from_pretrained's keyword
    eager_model = VaswaniForConditionalGeneration._from_config(model.config, attn_implementation="eager")
    assert eager_model.config._attn_implementation == "eager"


def test_attention_goes_through_transformers_attention_interface():
    calls = []

    def counting_attention(module, query, key, value, attention_mask, **kwargs):
        calls.append((module.is_cross_attention, module.is_causal, tuple(query.shape), tuple(key.shape)))
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("vaswani_counting", counting_attention)
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    target = torch.randint(4, 99, (3, 5))
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
        model.set_attn_implementation("vaswani_counting")
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    torch.testing.assert_close(logits, reference)
    # 2 encoder self-attentions, 2 decoder self-attentions (causal), 2 encoder-decoder attentions
    assert sorted(c[:2] for c in calls) == [(False, False)] * 2 + [(False, True)] * 2 + [(True, False)] * 2
    heads, head_dim = 4, 8
    assert (True, False, (3, heads, 5, head_dim), (3, heads, 9, head_dim)) in calls


def test_eager_attention_is_equation_1():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 6, 5), torch.randn(2, 3, 6, 5)
    module = torch.nn.Module().eval()
    out, probs = modeling.eager_attention_forward(module, q, k, v, None, scaling=5**-0.5)
    expected = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(5), dim=-1) @ v  # (B, H, Tq, Dh)
    torch.testing.assert_close(out, expected.transpose(1, 2))
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 3, 4))


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_decoder_cannot_see_future_tokens(implementation):
    model = tiny_model()
    model.set_attn_implementation(implementation)
    ids, mask = padded_batch(length=8)
    target = torch.randint(4, 99, (3, 10))
    for t in range(9):
        changed = target.clone()
        changed[:, t + 1:] = torch.randint(4, 99, changed[:, t + 1:].shape)
        with torch.no_grad():
            a = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
            b = model(input_ids=ids, attention_mask=mask, decoder_input_ids=changed).logits
        torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=ATOL, rtol=0)
        assert (a[:, t + 1:] - b[:, t + 1:]).abs().max() > 1e-3  # the later positions do see their own tokens


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_padded_source_positions_are_invisible(implementation):
    model = tiny_model()
    model.set_attn_implementation(implementation)
    ids, mask = padded_batch(length=9)
    scrambled = ids.clone()
    scrambled[mask == 0] = torch.randint(4, 99, (int((mask == 0).sum()),))
    target = torch.randint(4, 99, (3, 6))
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target)
        b = model(input_ids=scrambled, attention_mask=mask, decoder_input_ids=target)
        unmasked = model(input_ids=scrambled, decoder_input_ids=target)
    torch.testing.assert_close(a.logits, b.logits, atol=ATOL, rtol=0)
    kept = mask.bool()
    torch.testing.assert_close(a.encoder_last_hidden_state[kept], b.encoder_last_hidden_state[kept], atol=ATOL,
                               rtol=0)
    # without the mask the padding is seen: the check above could fail
    assert (unmasked.logits[1:] - a.logits[1:]).abs().max() > 1e-3


def test_decoder_padding_mask_hides_padded_target_keys():
    # Left padding: right padding lies in every real position's future, hidden by the causal mask alone.
    model = tiny_model()
    ids, mask = padded_batch(length=6)
    target = torch.randint(4, 99, (3, 8))
    target_mask = torch.ones_like(target)
    target_mask[:, :3] = 0
    scrambled = target.clone()
    scrambled[:, :3] = torch.randint(4, 99, (3, 3))
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target, decoder_attention_mask=target_mask)
        b = model(input_ids=ids, attention_mask=mask, decoder_input_ids=scrambled, decoder_attention_mask=target_mask)
        unmasked = model(input_ids=ids, attention_mask=mask, decoder_input_ids=scrambled)
    torch.testing.assert_close(a.logits[:, 3:], b.logits[:, 3:], atol=ATOL, rtol=0)
    # control: without the target mask the padded keys are seen: 2.5 off, 10^5 times ATOL
    assert (unmasked.logits[:, 3:] - a.logits[:, 3:]).abs().max() > 1e-2


def test_output_attentions_and_hidden_states_counts_shapes_and_masks():
    model = tiny_model()  # sdpa: output_attentions runs the eager reference
    ids, mask = padded_batch(length=9)
    target = torch.randint(4, 99, (3, 5))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target, output_attentions=True,
                    output_hidden_states=True)
    assert len(out.encoder_attentions) == 2 and len(out.decoder_attentions) == 2 and len(out.cross_attentions) == 2
    assert all(a.shape == (3, 4, 9, 9) for a in out.encoder_attentions)
    assert all(a.shape == (3, 4, 5, 5) for a in out.decoder_attentions)
    assert all(a.shape == (3, 4, 5, 9) for a in out.cross_attentions)
    assert len(out.encoder_hidden_states) == 3 and len(out.decoder_hidden_states) == 3  # embeddings + 2 layers
    assert all(h.shape == (3, 9, 32) for h in out.encoder_hidden_states)
    assert all(h.shape == (3, 5, 32) for h in out.decoder_hidden_states)
    torch.testing.assert_close(out.encoder_hidden_states[-1], out.encoder_last_hidden_state)
    for probs in out.encoder_attentions + out.cross_attentions:
        torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]))
        assert probs.masked_select(~mask.bool()[:, None, None, :].expand_as(probs)).max() < 1e-6
    for probs in out.decoder_attentions:
        assert torch.triu(probs, diagonal=1).abs().max() == 0  # no attention to later positions
    # the embeddings layer output: scaled embeddings plus positions (dropout is off in eval)
    expected = model.model.shared(ids) * math.sqrt(32) + sinusoidal_table(9, 32)
    torch.testing.assert_close(out.encoder_hidden_states[0], expected)
    assert out.encoder_attentions is not None and model(input_ids=ids, decoder_input_ids=target).encoder_attentions \
        is None


# §3.5 positional encoding ------------------------------------------------------------------------------------------


def test_sinusoidal_table_matches_the_formula_by_hand():
    d_model = 6
    table = sinusoidal_table(50, d_model)
    for pos in (0, 1, 2, 7, 49):
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-7)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-7)
    # hand-computed values: PE(1, 0) = sin 1, PE(1, 1) = cos 1, PE(1, 2) = sin(1 / 10000^(1/3)) = sin(0.0464159)
    assert table[1, :3].tolist() == pytest.approx([0.8414710, 0.5403023, 0.0463992], abs=1e-6)
    odd = sinusoidal_table(3, 5)  # odd widths end with a sine
    assert odd[2, 4].item() == pytest.approx(math.sin(2 / 10000 ** (4 / 5)), abs=1e-7)


def test_sinusoidal_encoding_is_not_saved_and_is_right_after_from_pretrained(tmp_path):
    model = tiny_model(max_position_embeddings=16)
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as handle:
        keys = list(handle.keys())
    assert not any("embed_positions" in key for key in keys)
    reloaded = VaswaniForConditionalGeneration.from_pretrained(tmp_path)
    for stack in (reloaded.model.encoder, reloaded.model.decoder):
        assert stack.embed_positions.weight.shape == (16, 32)
        torch.testing.assert_close(stack.embed_positions.weight, sinusoidal_table(16, 32))
    assert not any("embed_positions" in name for name, _ in reloaded.named_parameters())


def test_inputs_longer_than_the_table_work_and_match_a_larger_table():
    short = tiny_model(seed=4, max_position_embeddings=8)
    long = tiny_model(seed=4, max_position_embeddings=64)
    ids = torch.randint(4, 99, (2, 13))
    target = torch.randint(4, 99, (2, 11))
    with torch.no_grad():
        a = short(input_ids=ids, decoder_input_ids=target).logits
        b = long(input_ids=ids, decoder_input_ids=target).logits
    assert a.shape == (2, 11, 99)
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    # control: positions past the table clamped to its last row are 1.1 off, 10^5 times ATOL
    with torch.no_grad():
        for stack in (long.model.encoder, long.model.decoder):
            stack.embed_positions.weight[8:] = stack.embed_positions.weight[7]
        clamped = long(input_ids=ids, decoder_input_ids=target).logits
    assert (clamped - b).abs().max() > 1e-2
    # incremental decoding past the table too
    generated = short.generate(input_ids=ids, num_beams=1, do_sample=False, min_new_tokens=12, max_new_tokens=12)
    assert generated.shape == (2, 13)


def test_learned_positions_refuse_too_long_inputs():
    model = tiny_model(position_embedding_type="learned", max_position_embeddings=8)
    with pytest.raises(ValueError, match="longer than max_position_embeddings=8"):
        model(input_ids=torch.randint(4, 99, (1, 9)), decoder_input_ids=torch.ones(1, 3, dtype=torch.long))


def test_a_very_long_input_is_refused_before_its_attention_is_allocated(monkeypatch):
    # 50,000 source positions would need a (1, 1, 50000, 50000) fp32 mask (9.3 GiB) and as many scores per head.
    model = tiny_model()
    assert model.config.max_positions == configuration_vaswani.SINUSOIDAL_MAX_POSITIONS == 16384
    allocated = []
    monkeypatch.setattr(modeling, "additive_mask", lambda blocked, dtype: allocated.append(blocked.shape))
    for source, target in ((50_000, 3), (5, 20_000)):
        with pytest.raises(ValueError, match=rf"Sequence of {max(source, target)} tokens is longer than the 16384 "
                                             r"positions this model attends over.*GiB in fp32.*Split the text"):
            model(input_ids=torch.randint(4, 99, (1, source)), attention_mask=torch.ones(1, source, dtype=torch.long),
                  decoder_input_ids=torch.ones(1, target, dtype=torch.long))
    assert all(max(shape) <= 5 for shape in allocated)  # refused before a mask of the long side was built
    assert model.model.encoder.embed_positions.weight.shape[0] == 64  # nor was the table grown
    larger = tiny_model(max_position_embeddings=20_000)
    assert larger.config.max_positions == 20_000  # the config raises the limit
    learned = tiny_model(position_embedding_type="learned", max_position_embeddings=8)
    assert learned.config.max_positions == 8


def test_translate_sentences_refuses_an_over_long_sentence_before_any_batch(tiny_tokenizer, monkeypatch):
    from vaswani_hf.decoding.translate import translate_sentences

    calls = []

    def generate(model, **kwargs):
        calls.append(kwargs["input_ids"].shape)
        return model.generate(**kwargs)

    sentences = ["Ein Hund läuft am Strand entlang."] * 4 + ["Ein Hund " * 30]
    for overrides, pattern in ((dict(position_embedding_type="learned", max_position_embeddings=40),
                                r"sentence 4: Sequence of \d+ tokens is longer than max_position_embeddings=40"),
                               (dict(max_position_embeddings=8), None)):
        model = tiny_model(vocab_size=len(tiny_tokenizer), **overrides)
        if pattern is None:  # sinusoidal: over the table is fine, over the limit (40 here) is not
            monkeypatch.setattr(configuration_vaswani, "SINUSOIDAL_MAX_POSITIONS", 40)
            pattern = r"sentence 4: Sequence of \d+ tokens is longer than the 40 positions this model attends over"
        with pytest.raises(ValueError, match=pattern + ".*nothing was translated"):
            translate_sentences(model, tiny_tokenizer, sentences, batch_size=2, generate_fn=generate)
        assert calls == []
    # Without the long one, outputs stop at the last position a learned model has (40, the start token included),
    # where sources of 23 tokens would allow 50 more.
    model = tiny_model(vocab_size=len(tiny_tokenizer), position_embedding_type="learned",
                       max_position_embeddings=40)
    assert len(tiny_tokenizer(sentences[0])["input_ids"]) == 23 and len(tiny_tokenizer(sentences[4])["input_ids"]) > 40
    translate_sentences(model, tiny_tokenizer, sentences[:4], batch_size=2, generate_fn=generate, num_beams=2,
                        min_new_tokens=60)
    assert len(calls) == 2


def test_sinusoidal_positions_extrapolate_past_the_table(tiny_tokenizer):
    # The table holds 8 positions; the source has 30+ tokens and the output 12. The encodings are computed on the
    # fly, exactly as a model with a bigger table (the same weights: the table is not a parameter) has them.
    short = tiny_model(seed=3, vocab_size=len(tiny_tokenizer), max_position_embeddings=8)
    long = tiny_model(seed=3, vocab_size=len(tiny_tokenizer), max_position_embeddings=128)
    sentence = " ".join(GERMAN[:4])
    batch = tiny_tokenizer([sentence], return_tensors="pt")
    assert batch["input_ids"].shape[1] > 8 * 3
    with torch.no_grad():
        logits = short(**batch, decoder_input_ids=batch["input_ids"][:, :20]).logits
        reference = long(**batch, decoder_input_ids=batch["input_ids"][:, :20]).logits
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
    kwargs = dict(num_beams=2, max_new_tokens=12)
    out = translate_sentences(short, tiny_tokenizer, [sentence, GERMAN[5]], **kwargs)
    assert out == translate_sentences(long, tiny_tokenizer, [sentence, GERMAN[5]], **kwargs)


# Cache and incremental decoding -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_incremental_decoding_with_the_cache_matches_a_full_forward(name):
    """Under either name of the cache keyword: `past_key_values` (transformers < 5.24) or `cache` (>= 5.24)."""
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    target = torch.randint(4, 99, (3, 7))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old name is deprecated on 5.24+
        full = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
        encoder_outputs = model.get_encoder()(input_ids=ids, attention_mask=mask)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        steps = []
        for t in range(7):
            out = model(encoder_outputs=encoder_outputs, attention_mask=mask, decoder_input_ids=target[:, t: t + 1],
                        use_cache=True, **{name: cache})
            cache = getattr(out, CACHE_NAME)
            steps.append(out.logits)
    assert isinstance(cache, EncoderDecoderCache) and cache.get_seq_length() == 7
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)
    assert (torch.cat(steps, dim=1)[:, 1:] - full[:, :-1]).abs().max() > 0.1  # control: one position off (4.0)


def test_the_cache_under_both_names_is_refused():
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    with pytest.raises(ValueError, match="Pass the cache once"):
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :1], use_cache=True, cache=cache,
              past_key_values=cache)


# Training: gradient checkpointing, loss, Trainer ----------------------------------------------------------------------


def _grads(model, **inputs):
    model.zero_grad()
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_gives_the_same_gradients():
    model = tiny_model(dropout=0.0).train()
    ids, mask = padded_batch(length=9)
    labels = labels_for(*padded_batch(seed=2, length=7))
    loss, grads = _grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable  # 5.17
    enable()
    calls = []
    # a submodule inside the checkpointed layer runs again in the backward pass (the layer's own hooks stay outside)
    hook = model.model.encoder.layers[0].fc1.register_forward_hook(lambda *args: calls.append(1))
    loss_ckpt, grads_ckpt = _grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    hook.remove()
    assert len(calls) == 2  # recomputed: checkpointing is really on
    torch.testing.assert_close(loss_ckpt, loss)
    assert grads.keys() == grads_ckpt.keys() and len(grads) > 50
    for name in grads:
        torch.testing.assert_close(grads_ckpt[name], grads[name], atol=1e-6, rtol=1e-5, msg=name)
    # control: a recomputation that lost the layers' masks (keyword arguments not passed again) moves some gradient
    # by 6 x 10^4 times its tolerance
    _, unmasked = _grads(model, input_ids=ids, labels=labels)
    assert max(((unmasked[name] - grads[name]).abs() / (1e-6 + 1e-5 * grads[name].abs())).max() for name in grads) > 100


def test_loss_is_mean_token_cross_entropy_over_labelled_positions():
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    labels = labels_for(*padded_batch(seed=2, length=7))
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    log_probs = out.logits.log_softmax(-1)
    kept = labels != -100
    picked = log_probs[kept].gather(-1, labels[kept][:, None]).squeeze(-1)
    torch.testing.assert_close(out.loss, -picked.sum() / kept.sum())
    assert kept.sum() == 7 + 5 + 3
    assert abs(out.loss.item() + picked.sum().item() / kept.numel()) > 1.0  # control: padded positions counted: 1.7
    # the decoder input is the labels shifted right behind <s>, padding where labels are -100
    decoder_input = shift_tokens_right(labels, 0, 1)
    assert decoder_input[:, 0].tolist() == [1, 1, 1] and (decoder_input[:, 1:] == labels[:, :-1].clamp(min=0)).all()
    torch.testing.assert_close(model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_input).logits,
                               out.logits)


@pytest.mark.parametrize("training", [True, False])
def test_a_batch_without_labels_has_a_finite_zero_loss_that_keeps_the_graph(training):
    # fairseq's: the sum over no tokens is 0; transformers' mean over none would be 0 / 0 = NaN. In training also the
    # label-smoothed loss of the training commands (training_fast_paths: fused on a CPU).
    model = tiny_model().train(training)
    ids, mask = padded_batch(length=9)
    nothing = torch.full((3, 5), -100)
    for smoothed in (False, True):
        for extra in (dict(), dict(num_items_in_batch=0), dict(num_items_in_batch=torch.tensor(0))):
            with training_fast_paths(model, 0.1) if smoothed else contextlib.nullcontext():
                loss = model(input_ids=ids, attention_mask=mask, labels=nothing, **extra).loss
            assert loss.item() == 0.0 and loss.requires_grad
            model.zero_grad()
            loss.backward()
            assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    some = nothing.clone()
    some[1, :2] = torch.tensor([5, 2])
    loss = model(input_ids=ids, attention_mask=mask, labels=some).loss
    assert loss.item() > 1.0  # one labelled row: an ordinary loss


def test_loss_is_plain_cross_entropy_and_the_training_commands_smooth_it():
    """transformers' convention: forward returns the plain cross-entropy; the training commands train on the
    label-smoothed loss of §5.4 (training_fast_paths, in training mode), which is `cross_entropy_loss` with
    epsilon_ls: (1 - eps) NLL + eps times the cross-entropy against the uniform distribution, per token."""
    model = tiny_model(dropout=0.0)
    ids, mask = padded_batch(length=9)
    labels = labels_for(*padded_batch(seed=2, length=7))
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    log_probs = out.logits.log_softmax(-1)[labels != -100]  # (N, V)
    nll = -log_probs.gather(-1, labels[labels != -100][:, None]).squeeze(-1)
    torch.testing.assert_close(out.loss, nll.mean())
    uniform = -log_probs.mean(-1)  # cross-entropy against the uniform distribution
    expected = (0.9 * nll + 0.1 * uniform).mean()
    torch.testing.assert_close(cross_entropy_loss(out.logits, labels, label_smoothing=0.1), expected)
    with training_fast_paths(model, 0.1):
        assert model(input_ids=ids, attention_mask=mask, labels=labels).loss.item() == pytest.approx(
            out.loss.item(), rel=1e-6)  # eval mode: the plain loss, as eval_loss
        smoothed = model.train()(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(smoothed, expected, rtol=1e-5, atol=1e-6)
    assert abs(smoothed.item() - out.loss.item()) > 1e-3
    assert model.train()(input_ids=ids, attention_mask=mask, labels=labels).loss.item() == pytest.approx(
        out.loss.item(), rel=1e-5)  # outside it, the model is plain again
    with pytest.raises(ValueError, match="takes no label_smoothing.*label_smoothing_factor"):
        model(input_ids=ids, attention_mask=mask, labels=labels, label_smoothing=0.1)


def test_loss_is_exact_under_gradient_accumulation():
    """Summing two micro-batches' losses, each divided by the whole batch's token count (as Trainer passes
    num_items_in_batch), gives the full-batch loss and gradients; a mean of per-micro-batch means does not."""
    model = tiny_model(dropout=0.0).train()
    ids, mask = padded_batch(batch=4, length=9)
    target, target_mask = padded_batch(seed=5, batch=4, length=8)
    target_mask[:2] = 1  # uneven token counts between the two halves: 16 vs 6 + 2
    labels = labels_for(target, target_mask)
    full_loss, full_grads = _grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    total = int((labels != -100).sum())
    model.zero_grad()
    summed = 0.0
    naive = 0.0
    for half in (slice(0, 2), slice(2, 4)):
        loss = model(input_ids=ids[half], attention_mask=mask[half], labels=labels[half],
                     num_items_in_batch=torch.tensor(total)).loss
        loss.backward()
        summed += loss.item()
        naive += model(input_ids=ids[half], attention_mask=mask[half], labels=labels[half]).loss.item() / 2
    assert summed == pytest.approx(full_loss.item(), rel=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, full_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    assert abs(naive - full_loss.item()) > 1e-3  # what a per-micro-batch mean gets wrong


def test_trainer_label_smoothing_factor_matches_the_recipes_loss(tmp_path):
    """A plain Trainer's label_smoothing_factor, on the model's logits, gives `cross_entropy_loss`'s smoothed loss."""
    model = tiny_model(dropout=0.0)
    ids, mask = padded_batch(length=9)
    labels = labels_for(*padded_batch(seed=2, length=7))
    logits = model(input_ids=ids, attention_mask=mask, labels=labels).logits
    own = cross_entropy_loss(logits, labels, label_smoothing=0.1)
    args = TrainingArguments(output_dir=str(tmp_path), label_smoothing_factor=0.1, report_to=[], use_cpu=True)
    trainer = Trainer(model=model, args=args)
    assert trainer.label_smoother is not None
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels,
                  decoder_input_ids=model.prepare_decoder_input_ids_from_labels(labels))
    with torch.no_grad():
        via_trainer = trainer.compute_loss(model, inputs)
    torch.testing.assert_close(via_trainer, own.detach())
    # and the model's plain loss differs from it
    plain = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert abs(plain.item() - own.item()) > 1e-3


@pytest.mark.parametrize("trainer_kind", ["trainer", "seq2seq", "seq2seq_generate"])
def test_trainer_takes_only_labels_for_labels_and_evaluates_with_eval_loss_and_label_ids(tmp_path, trainer_kind):
    """`Trainer` takes every `forward` parameter named like "label" for a label (`find_labels`): only `labels`, so a
    plain `Trainer`'s or `Seq2SeqTrainer`'s `evaluate()` returns the unsmoothed `eval_loss` and `predict()` the
    `label_ids`, with or without `predict_with_generate`."""
    assert find_labels(VaswaniForConditionalGeneration) == ["labels"]
    model = tiny_model(dropout=0.0)
    ids, mask = padded_batch(batch=4, length=9)
    labels = labels_for(*padded_batch(seed=2, batch=4, length=7))
    examples = [dict(input_ids=ids[i], attention_mask=mask[i], labels=labels[i]) for i in range(4)]
    options = dict(output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to=[], use_cpu=True)
    if trainer_kind == "trainer":
        trainer = Trainer(model=model, args=TrainingArguments(**options), eval_dataset=examples)
    else:
        args = Seq2SeqTrainingArguments(**options, predict_with_generate=trainer_kind == "seq2seq_generate",
                                        generation_max_length=6)
        trainer = Seq2SeqTrainer(model=model, args=args, eval_dataset=examples)
    with torch.no_grad():
        plain_output = model.eval()(input_ids=ids, attention_mask=mask, labels=labels)
        plain = plain_output.loss.item()
        smoothed = cross_entropy_loss(plain_output.logits, labels, label_smoothing=0.1).item()
    assert abs(plain - smoothed) > 1e-3
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(plain, rel=1e-5)
    prediction = trainer.predict(examples)
    assert prediction.metrics["test_loss"] == pytest.approx(plain, rel=1e-5)
    label_ids = torch.as_tensor(prediction.label_ids)  # Seq2SeqTrainer pads them to the generation length
    assert torch.equal(label_ids[:, : labels.shape[1]], labels) and label_ids[:, labels.shape[1]:].eq(0).all()
    predictions = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    if trainer_kind == "seq2seq_generate":  # token ids from generate(), starting with the decoder start token
        assert predictions.shape[0] == 4 and (predictions[:, 0] == model.config.decoder_start_token_id).all()
    else:  # the logits
        assert tuple(predictions.shape) == (*labels.shape, model.config.vocab_size)


# Inputs, determinism, batching -------------------------------------------------------------------------------------


def test_inputs_embeds_are_equivalent_to_input_ids():
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    target = torch.randint(4, 99, (3, 5))
    with torch.no_grad():
        by_ids = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
        embed = model.get_input_embeddings()
        by_embeds = model(inputs_embeds=embed(ids), attention_mask=mask, decoder_inputs_embeds=embed(target)).logits
    torch.testing.assert_close(by_embeds, by_ids)


def test_eval_is_deterministic_and_train_mode_applies_dropout():
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    target = torch.randint(4, 99, (3, 5))
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
        b = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
        assert torch.equal(a, b)
        model.train()
        c = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    assert (a - c).abs().max() > 1e-3


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_a_padded_batch_equals_each_sentence_alone(implementation):
    model = tiny_model()
    model.set_attn_implementation(implementation)
    ids, mask = padded_batch(length=9)
    target, target_mask = padded_batch(seed=1, length=7)
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target,
                        decoder_attention_mask=target_mask).logits
        for row in range(3):
            n, m = int(mask[row].sum()), int(target_mask[row].sum())
            alone = model(input_ids=ids[row: row + 1, :n], decoder_input_ids=target[row: row + 1, :m]).logits
            torch.testing.assert_close(batched[row: row + 1, :m], alone, atol=ATOL, rtol=0)
        # control: the padded row read without its source mask is 0.7 off, 10^5 times ATOL
        unmasked = model(input_ids=ids, decoder_input_ids=target, decoder_attention_mask=target_mask).logits
        assert (unmasked[2, :m] - alone[0]).abs().max() > 1e-2


def test_bad_inputs_raise_clear_errors():
    model = tiny_model()
    ids = torch.randint(4, 99, (2, 5))
    with pytest.raises(ValueError, match="input_ids holds token id 120, outside this model's vocabulary of 99"):
        model(input_ids=torch.tensor([[5, 120]]), decoder_input_ids=ids)
    with pytest.raises(ValueError, match=r"needs decoder_input_ids \(or decoder_inputs_embeds\)"):
        model.model(input_ids=ids)
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model(input_ids=ids, inputs_embeds=torch.zeros(2, 5, 32), decoder_input_ids=ids)


def test_the_stacks_return_model_outputs_and_tuples_on_request():
    # get_encoder()/get_decoder() are what transformers' export and generation helpers call directly.
    from transformers.modeling_outputs import BaseModelOutput, BaseModelOutputWithPastAndCrossAttentions

    model = tiny_model()
    ids, mask = padded_batch(length=9)
    with torch.no_grad():
        encoded = model.get_encoder()(input_ids=ids, attention_mask=mask)
        decoded = model.get_decoder()(input_ids=ids[:, :4], encoder_hidden_states=encoded.last_hidden_state,
                                      encoder_attention_mask=mask, use_cache=True, output_attentions=True)
        assert type(encoded) is BaseModelOutput and type(decoded) is BaseModelOutputWithPastAndCrossAttentions
        assert decoded[0] is decoded.last_hidden_state and decoded.last_hidden_state.shape == (3, 4, 32)
        assert isinstance(getattr(decoded, CACHE_NAME), EncoderDecoderCache)
        assert len(decoded.attentions) == len(decoded.cross_attentions) == 2
        as_tuple = model.get_decoder()(input_ids=ids[:, :4], encoder_hidden_states=encoded.last_hidden_state,
                                       encoder_attention_mask=mask, return_dict=False)
        assert type(as_tuple) is tuple and len(as_tuple) == 1
        torch.testing.assert_close(as_tuple[0], decoded.last_hidden_state)
        assert type(model.get_encoder()(input_ids=ids, return_dict=False)) is tuple
        model.config.return_dict = False  # transformers' config switch
        assert type(model.get_encoder()(input_ids=ids)) is tuple
        assert type(model(input_ids=ids, decoder_input_ids=ids)) is tuple


def test_a_label_outside_the_vocabulary_is_named_even_in_the_last_position():
    model = tiny_model()
    labels = torch.tensor([[5, 6, 7, 99]])  # the last label never becomes a decoder input
    with pytest.raises(ValueError, match="labels hold token id 99, outside this model's target vocabulary of 99"):
        model(input_ids=torch.tensor([[5, 6, 2]]), labels=labels)
    labels[0, -1] = -100
    assert torch.isfinite(model(input_ids=torch.tensor([[5, 6, 2]]), labels=labels).loss)


# Initialization (fairseq's, Xavier-uniform linears) -----------------------------------------------------------------


def test_initialization():
    torch.manual_seed(0)
    config = tiny_config(vocab_size=4000, d_model=64, d_ff=256, encoder_layers=1, decoder_layers=1,
                         tie_word_embeddings=False)
    model = VaswaniForConditionalGeneration(config)
    layer = model.model.decoder.layers[0]
    for linear in (layer.fc1, layer.fc2, layer.self_attn.out_proj, layer.encoder_attn.out_proj):
        fan_out, fan_in = linear.weight.shape
        bound = math.sqrt(6 / (fan_in + fan_out))  # Xavier/Glorot uniform
        assert linear.weight.abs().max() <= bound
        assert linear.weight.abs().max() > 0.98 * bound
        assert linear.weight.var().item() == pytest.approx(bound**2 / 3, rel=0.1)
        assert linear.bias.abs().max() == 0
    for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.encoder_attn.q_proj,
                   layer.encoder_attn.k_proj, layer.encoder_attn.v_proj):
        bound = math.sqrt(6 / (4 * 64))  # each (D, D) block Xavier-uniform with gain 1/sqrt(2), as fairseq
        assert linear.weight.abs().max() <= bound and linear.weight.abs().max() > 0.98 * bound
        assert linear.weight.var().item() == pytest.approx(bound**2 / 3, rel=0.1)
    for weight in (model.model.shared.weight, model.lm_head.weight):
        assert weight.std().item() == pytest.approx(64**-0.5, rel=0.03)  # N(0, d_model^-0.5)
        assert weight.mean().abs().item() < 0.01
    assert model.model.shared.weight[0].abs().max() == 0  # padding row
    assert torch.equal(layer.final_layer_norm.weight, torch.ones(64))
    assert torch.equal(layer.final_layer_norm.bias, torch.zeros(64))


def test_no_split_modules_are_the_layers():
    assert VaswaniForConditionalGeneration._no_split_modules == ["VaswaniEncoderLayer", "VaswaniDecoderLayer"]
    assert all(hasattr(modeling, name) for name in VaswaniForConditionalGeneration._no_split_modules)
    model = tiny_model()
    assert {type(m).__name__ for m in model.modules()} >= set(VaswaniForConditionalGeneration._no_split_modules)


# Parameter counts (Table 3) ------------------------------------------------------------------------------------------


def _count(config: VaswaniConfig) -> int:
    with torch.device("meta"):
        model = VaswaniForConditionalGeneration(config)
    return sum(p.numel() for p in model.parameters())  # shared parameters counted once


def test_parameter_count_of_the_base_model_is_exact():
    assert _count(VaswaniConfig.base()) == 63_082_496
    # what is counted: one shared 37000 x 512 matrix + 6 encoder layers x 3,152,384 + 6 decoder layers x 4,204,032
    assert 37000 * 512 + 6 * 3_152_384 + 6 * 4_204_032 == 63_082_496
    # vocab_size 3: the smallest vocabulary that holds <pad>, <s> and </s>
    config = tiny_config(d_model=512, num_heads=8, d_ff=2048, vocab_size=3)
    with torch.device("meta"):
        model = VaswaniForConditionalGeneration(config)
    assert sum(p.numel() for p in model.model.encoder.layers[0].parameters()) == 3_152_384
    assert sum(p.numel() for p in model.model.decoder.layers[0].parameters()) == 4_204_032


def test_parameter_count_of_the_big_model_is_about_213m():
    assert _count(VaswaniConfig.big()) == pytest.approx(213e6, rel=0.01)
    assert _count(VaswaniConfig.big()) == 214_245_376  # the number VaswaniConfig's docstring gives


def test_untied_embeddings_add_their_matrices_to_the_count():
    shared = _count(tiny_config())
    assert _count(tiny_config(tie_word_embeddings=False)) == shared + 99 * 32
    assert _count(tiny_config(tie_word_embeddings=False, share_encoder_decoder_embeddings=False)) == \
        shared + 2 * 99 * 32


# Save/load, tied weights, resizing -----------------------------------------------------------------------------------


def _assert_tied(model):
    shared = model.model.shared.weight
    for weight in (model.model.encoder.embed_tokens.weight, model.model.decoder.embed_tokens.weight,
                   model.lm_head.weight):
        assert weight is shared
        assert weight.data_ptr() == shared.data_ptr()


def test_save_and_load_round_trip_keeps_logits_and_one_tied_matrix(tmp_path):
    model = tiny_model()
    _assert_tied(model)
    ids, mask = padded_batch(length=9)
    target = torch.randint(4, 99, (3, 5))
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as handle:
        keys = list(handle.keys())
    assert [k for k in keys if "embed" in k or "lm_head" in k or "shared" in k] == ["model.shared.weight"]
    for cls in (VaswaniForConditionalGeneration, AutoModelForSeq2SeqLM):
        reloaded = cls.from_pretrained(tmp_path).eval()
        assert type(reloaded) is VaswaniForConditionalGeneration
        _assert_tied(reloaded)
        with torch.no_grad():
            logits = reloaded(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
        assert torch.equal(logits, expected)
    base = AutoModel.from_pretrained(tmp_path)
    assert type(base) is VaswaniModel
    with torch.no_grad():
        hidden = base(input_ids=ids, attention_mask=mask, decoder_input_ids=target).last_hidden_state
    torch.testing.assert_close(hidden @ model.model.shared.weight.T, expected)


def test_untied_model_saves_and_loads_both_matrices(tmp_path):
    model = tiny_model(tie_word_embeddings=False)
    assert model.lm_head.weight is not model.model.shared.weight
    model.save_pretrained(tmp_path)
    reloaded = VaswaniForConditionalGeneration.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight is not reloaded.model.shared.weight
    torch.testing.assert_close(reloaded.lm_head.weight, model.lm_head.weight)
    torch.testing.assert_close(reloaded.model.shared.weight, model.model.shared.weight)


def test_training_a_tied_model_keeps_one_matrix():
    model = tiny_model().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ids, mask = padded_batch(length=9)
    before = model.model.shared.weight.detach().clone()
    model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
    optimizer.step()
    _assert_tied(model)
    assert not torch.equal(model.model.shared.weight, before)


@pytest.mark.parametrize("new_size", [120, 80])
def test_resize_token_embeddings(new_size, tmp_path):
    model = tiny_model()
    old = model.model.shared.weight.detach().clone()
    model.resize_token_embeddings(new_size)
    assert model.config.vocab_size == new_size
    assert model.model.shared.weight.shape == (new_size, 32)
    assert model.lm_head.weight.shape == (new_size, 32)
    _assert_tied(model)
    kept = min(99, new_size)
    torch.testing.assert_close(model.model.shared.weight[:kept], old[:kept])
    ids = torch.tensor([[5, new_size - 1, 2]])
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (1, 3, new_size) and torch.isfinite(out.loss)
    model.save_pretrained(tmp_path)
    reloaded = VaswaniForConditionalGeneration.from_pretrained(tmp_path)
    assert reloaded.config.vocab_size == new_size and reloaded.lm_head.weight.shape == (new_size, 32)
    _assert_tied(reloaded)


@pytest.mark.parametrize("overrides", [dict(share_encoder_decoder_embeddings=False),
                                       dict(share_encoder_decoder_embeddings=False, target_vocab_size=57),
                                       dict(tie_word_embeddings=False)])
def test_resize_token_embeddings_without_full_sharing(overrides, tmp_path):
    model = tiny_model(**overrides)
    target_size = overrides.get("target_vocab_size", 99)
    model.resize_token_embeddings(120, mean_resizing=False)
    assert model.config.vocab_size == 120
    assert model.model.encoder.embed_tokens.weight.shape == (120, 32)
    if overrides.get("share_encoder_decoder_embeddings") is False:
        # only the source vocabulary changes; the config keeps describing the decoder
        assert model.config.decoder_vocab_size == target_size
        assert model.model.decoder.embed_tokens.weight.shape == (target_size, 32)
        assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
    else:
        assert model.lm_head.weight.shape == (120, 32) and model.lm_head.weight is not model.model.shared.weight
    model.save_pretrained(tmp_path)
    reloaded = VaswaniForConditionalGeneration.from_pretrained(tmp_path)
    ids, target = torch.tensor([[5, 119, 2]]), torch.tensor([[1, 40]])
    torch.testing.assert_close(reloaded(input_ids=ids, decoder_input_ids=target).logits,
                               model(input_ids=ids, decoder_input_ids=target).logits)
    # transformers' resizing puts a new plain nn.Linear in place of an untied lm_head: generate() still runs (packed)
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=4), reloaded.generate(input_ids=ids,
                                                                                         max_new_tokens=4))


def test_checkpoints_with_fused_input_projections_still_load(tmp_path):
    # Checkpoints written when self-attention had one fused `qkv_proj` (D -> 3D) and encoder-decoder attention a
    # fused `kv_proj` (D -> 2D) load into the separate q_proj, k_proj, v_proj, with the same outputs.
    from safetensors.torch import load_file, save_file

    model = tiny_model(seed=4)
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    old = {}
    for key, tensor in state.items():
        for part in ("q_proj", "k_proj", "v_proj"):
            if f".{part}." in key:
                attention, suffix = key.split(f".{part}.")
                if attention.endswith("encoder_attn") and part != "q_proj":
                    old[f"{attention}.kv_proj.{suffix}"] = torch.cat(
                        [state[f"{attention}.k_proj.{suffix}"], state[f"{attention}.v_proj.{suffix}"]])
                elif not attention.endswith("encoder_attn"):
                    old[f"{attention}.qkv_proj.{suffix}"] = torch.cat(
                        [state[f"{attention}.{p}.{suffix}"] for p in ("q_proj", "k_proj", "v_proj")])
                else:
                    old[key] = tensor
                break
        else:
            old[key] = tensor
    assert any(".qkv_proj." in key for key in old) and any(".kv_proj." in key for key in old)
    assert not any(".k_proj." in key for key in old)
    save_file(old, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reloaded = VaswaniForConditionalGeneration.from_pretrained(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    ids, mask = padded_batch(length=9)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids, attention_mask=mask, decoder_input_ids=ids).logits,
                                   model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids).logits)


# Properties (hypothesis): arbitrary batch sizes, lengths and padding --------------------------------------------------


@st.composite
def padded_batches(draw):
    """A right-padded batch with arbitrary sizes, lengths and padding contents, and the unpadded rows."""
    batch = draw(st.integers(1, 4))
    source_lengths = draw(st.lists(st.integers(1, 12), min_size=batch, max_size=batch))
    target_lengths = draw(st.lists(st.integers(1, 10), min_size=batch, max_size=batch))
    seed = draw(st.integers(0, 2**31 - 1))
    fill = draw(st.sampled_from(["pad", "random"]))  # what sits under the mask must not matter
    extra_source = draw(st.integers(0, 3))  # padding even past the longest row
    generator = torch.Generator().manual_seed(seed)
    vocab = 99

    def pad(lengths, extra):
        width = max(lengths) + extra
        ids = torch.randint(4, vocab, (len(lengths), width), generator=generator)
        mask = torch.zeros(len(lengths), width, dtype=torch.long)
        for row, n in enumerate(lengths):
            mask[row, :n] = 1
            if fill == "pad":
                ids[row, n:] = 0
        return ids, mask

    source, source_mask = pad(source_lengths, extra_source)
    target, target_mask = pad(target_lengths, 0)
    return source, source_mask, source_lengths, target, target_mask, target_lengths


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(padded_batches(), st.sampled_from(["sdpa", "eager"]), st.booleans())
def test_outputs_have_the_right_shape_are_finite_and_ignore_padding(data, implementation, pre_ln):
    source, source_mask, source_lengths, target, target_mask, target_lengths = data
    model = tiny_model(seed=1, normalize_before=pre_ln)
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        out = model(input_ids=source, attention_mask=source_mask, decoder_input_ids=target,
                    decoder_attention_mask=target_mask)
        batch, width = target.shape
        assert out.logits.shape == (batch, width, 99)
        assert out.encoder_last_hidden_state.shape == (batch, source.shape[1], 32)
        assert torch.isfinite(out.logits).all() and torch.isfinite(out.encoder_last_hidden_state).all()
        for row in range(batch):
            n, m = source_lengths[row], target_lengths[row]
            alone = model(input_ids=source[row: row + 1, :n], decoder_input_ids=target[row: row + 1, :m])
            torch.testing.assert_close(out.logits[row: row + 1, :m], alone.logits, atol=1e-5, rtol=0)
            torch.testing.assert_close(out.encoder_last_hidden_state[row: row + 1, :n],
                                       alone.encoder_last_hidden_state, atol=1e-5, rtol=0)
