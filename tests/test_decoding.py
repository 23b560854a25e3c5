"""The paper's decoding (§6.1): beam 4, GNMT length penalty, max length = source length + 50."""

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import EOS, PAD, copy_sources, trained_copy_model

from vaswani_hf.decoding.paper import (
    FinishedHypotheses,
    SourceLengthLimitLogitsProcessor,
    beam_search_hypotheses,
    gnmt_length_penalty,
    hf_length_penalty,
    max_output_lengths,
    paper_generate,
)


@pytest.fixture(scope="module")
def model():
    return trained_copy_model(steps=40)


@pytest.fixture(scope="module")
def batch():
    return copy_sources(seed=1, batch=8)


def test_penalties_follow_their_formulas():
    assert gnmt_length_penalty(7, 0.6) == pytest.approx(2**0.6)  # ((5 + 7) / 6) ** 0.6
    assert gnmt_length_penalty(1, 0.6) == pytest.approx(1.0)
    assert hf_length_penalty(7, 0.6) == pytest.approx(7**0.6)
    lengths = torch.tensor([1.0, 10.0, 30.0])
    assert torch.allclose(gnmt_length_penalty(lengths, 0.0), torch.ones(3))
    assert torch.allclose(gnmt_length_penalty(lengths, 1.0), (5 + lengths) / 6)


def test_the_two_penalties_can_choose_differently():
    # A: 2 tokens, log p = -1.0; B: 6 tokens, log p = -1.6.
    # gnmt: A -1.0 / 1.097 = -0.912 > B -1.6 / 1.439 = -1.112 -> A;  hf: A -1.0 / 1.516 = -0.660 < B -0.546 -> B.
    hyps = FinishedHypotheses(sequences=torch.zeros(1, 2, 7, dtype=torch.long), scores=torch.tensor([[-1.0, -1.6]]),
                              lengths=torch.tensor([[2, 6]]), valid=torch.tensor([[True, True]]))
    assert hyps.best(0.6, "gnmt").item() == 0
    assert hyps.best(0.6, "hf").item() == 1
    assert torch.allclose(hyps.rescore(0.6, "gnmt"), torch.tensor([[-1.0 / (7 / 6) ** 0.6, -1.6 / (11 / 6) ** 0.6]]))
    with pytest.raises(ValueError, match="length_penalty_style"):
        hyps.rescore(0.6, "fairseq")


def test_max_output_lengths():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert max_output_lengths(mask).tolist() == [53, 54]
    assert max_output_lengths(mask, 1.5, 2).tolist() == [6, 8]  # int(4.5 + 2), int(6 + 2)
    with pytest.raises(ValueError, match="at least 1"):
        max_output_lengths(mask, 0.0, 0)


def test_limit_processor_maps_beam_rows_to_sentences():
    # 2 sentences x 3 beams; each hypothesis has generated 2 tokens (start token + 2).
    processor = SourceLengthLimitLogitsProcessor(torch.tensor([3, 4]), eos_token_id=EOS)
    scores = torch.log_softmax(torch.randn(6, 10, generator=torch.Generator().manual_seed(0)), dim=-1)
    out = processor(torch.ones(6, 3, dtype=torch.long), scores.clone())
    # Sentence 0 (rows 0-2): the next token is its 3rd and last: only </s> remains, with its own log-prob.
    assert torch.isinf(out[:3]).sum().item() == 3 * 9
    assert torch.equal(out[:3, EOS], scores[:3, EOS])
    # Sentence 1 (rows 3-5) may still produce 2 tokens: untouched.
    assert torch.equal(out[3:], scores[3:])
    with pytest.raises(ValueError, match="2 sentences"):
        processor(torch.ones(5, 3, dtype=torch.long), scores[:5])


def _teacher_forced_log_prob(model, ids, mask, hypothesis, length):
    """Sum of log p(y_t | y_<t, x) over the |Y| generated tokens (</s> included) by one forward pass."""
    decoder_input = hypothesis[None, :length]  # start token + y_1 .. y_{|Y|-1}
    targets = hypothesis[1 : length + 1]
    logits = model(input_ids=ids[None], attention_mask=mask[None], decoder_input_ids=decoder_input).logits[0]
    return F.log_softmax(logits.double(), dim=-1).gather(1, targets[:, None]).sum().item()


@torch.no_grad()
@pytest.mark.parametrize("style,alpha", [("gnmt", 0.6), ("gnmt", 2.0), ("hf", 0.6)])
def test_pick_is_the_argmax_of_a_brute_force_rescoring(model, batch, style, alpha):
    ids, mask = batch
    hyps = beam_search_hypotheses(model, ids, mask, num_beams=4)
    chosen = paper_generate(model, ids, mask, num_beams=4, alpha=alpha, length_penalty_style=style)
    penalty = (lambda n: ((5 + n) / 6) ** alpha) if style == "gnmt" else (lambda n: n**alpha)
    assert hyps.valid.all()
    picks = []
    for i in range(ids.shape[0]):
        rescored = []
        for k in range(4):
            sequence, length = hyps.sequences[i, k], int(hyps.lengths[i, k])
            assert sequence[length].item() == EOS and not sequence[1:length].eq(EOS).any()
            log_prob = _teacher_forced_log_prob(model, ids[i], mask[i], sequence, length)
            assert log_prob == pytest.approx(hyps.scores[i, k].item(), abs=1e-4)  # scores are raw sums, </s> included
            if i == 0:  # control: a sum without </s>'s log-probability is 0.9 or more off, 10^4 times the tolerance
                without_eos = _teacher_forced_log_prob(model, ids[i], mask[i], sequence, length - 1)
                assert abs(without_eos - hyps.scores[i, k].item()) > 0.1
            rescored.append(log_prob / penalty(length))
        best = max(range(4), key=rescored.__getitem__)
        picks.append(best)
        length = int(hyps.lengths[i, best])
        assert chosen[i, : length + 1].tolist() == hyps.sequences[i, best, : length + 1].tolist()
        assert chosen[i, length + 1 :].eq(PAD).all()
    if (style, alpha) != ("gnmt", 0.6):  # the penalty overrules the raw ranking somewhere (else the test is weak)
        assert any(picks)


@torch.no_grad()
def test_hf_style_equals_transformers_generate(model, batch):
    ids, mask = batch
    ours = paper_generate(model, ids, mask, num_beams=4, alpha=0.6, length_penalty_style="hf")
    reference = model.generate(input_ids=ids, attention_mask=mask, num_beams=4, length_penalty=0.6,
                               early_stopping=True, max_length=80)
    assert ours.tolist() == reference[:, : ours.shape[1]].tolist()
    assert reference[:, ours.shape[1] :].eq(PAD).all()
    greedy = paper_generate(model, ids, mask, num_beams=1)  # beam search differs from it (5 of 8 sentences here)
    assert sum(a[a.ne(PAD)].tolist() != b[b.ne(PAD)].tolist() for a, b in zip(ours, greedy, strict=True)) >= 2


@torch.no_grad()
def test_greedy_equals_transformers_greedy(model, batch):
    ids, mask = batch
    ours = paper_generate(model, ids, mask, num_beams=1)
    reference = model.generate(input_ids=ids, attention_mask=mask, num_beams=1, max_length=80)
    assert ours.tolist() == reference.tolist()


@torch.no_grad()
@pytest.mark.parametrize("num_beams", [1, 4])
def test_max_length_is_source_length_plus_50(num_beams):
    model = trained_copy_model(steps=0, seed=1)  # untrained, never choosing </s>: every output runs to its limit
    ids, mask = copy_sources(seed=3, batch=3, min_len=2, max_len=9)
    src_len = mask.sum(1)
    assert len(set(src_len.tolist())) > 1
    out = paper_generate(model, ids, mask, num_beams=num_beams)
    lengths = out[:, 1:].ne(PAD).sum(1)  # generated tokens, </s> included
    assert lengths.tolist() == (src_len + 50).tolist()
    assert out[torch.arange(3), lengths].tolist() == [EOS] * 3
    assert out.shape[1] == 1 + int(src_len.max()) + 50


@torch.no_grad()
def test_saved_generation_settings_do_not_leak_in(model, batch):
    ids, mask = batch
    expected = paper_generate(model, ids, mask)
    saved = model.generation_config
    model.generation_config = saved.__class__.from_dict(saved.to_dict())
    model.generation_config.no_repeat_ngram_size = 1
    model.generation_config.min_length = 30
    try:
        assert paper_generate(model, ids, mask).tolist() == expected.tolist()
        assert model.generation_config.no_repeat_ngram_size == 1  # restored afterwards
    finally:
        model.generation_config = saved


def test_bad_input_raises_clear_errors(model, batch):
    ids, mask = batch
    with pytest.raises(ValueError, match="alpha must be >= 0"):
        paper_generate(model, ids, mask, alpha=-0.5)
    with pytest.raises(ValueError, match="length_penalty_style"):
        paper_generate(model, ids, mask, length_penalty_style="wu")
    with pytest.raises(ValueError, match="attention_mask has shape"):
        paper_generate(model, ids, mask[:, :-1])
    with pytest.raises(ValueError, match=r"\(B, S\) integer tensor"):
        paper_generate(model, ids[0])
    with pytest.raises(ValueError, match="num_beams"):
        paper_generate(model, ids, mask, num_beams=0)
    with pytest.raises(ValueError, match="num_beams >= 2"):
        beam_search_hypotheses(model, ids, mask, num_beams=1)
    assert math.isfinite(gnmt_length_penalty(3, 0.6))
