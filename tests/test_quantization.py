"""CPU int8 in PyTorch: `torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)`, the plain
call, quantizes every linear map of the model (they are plain `nn.Linear`s, which the function matches by exact type),
and the quantized model translates as the fp32 one does.

The model is small (d_model 64, 2+2 layers, a joint BPE of 2,000 tokens learned from the shipped Multi30k train set)
and trained for 300 steps on Multi30k De->En, so that it ends its sentences and beam search has choices to make (an
untrained model repeats one token to the length limit, where any quantization agrees with fp32). Its translations of
Multi30k test2016 are compared with fp32's, and a broken quantization (one layer's int8 weights zeroed) beside them
misses every threshold by far.
"""

import warnings

import pytest
import sacrebleu
import torch
from helpers import multi30k_batch, multi30k_tokenizer, padded_batch, tiny_model, trained_multi30k_model
from torch import nn

from vaswani_hf import VaswaniForConditionalGeneration
from vaswani_hf.data import multi30k_file, read_lines

SENTENCES = 256  # of Multi30k test2016's source side
BATCH = 64
DECODING = dict(max_new_tokens=40)
# int8 weights (per-tensor scales) and int8 activations move the logits of this weakly trained model by about 1 %:
# about half the sentences decode identically and the rest differ after a near tie, so the int8 output scores ~80 BLEU
# against fp32's; one zeroed layer gives ~6 and no identical sentence.
MIN_BLEU_AGAINST_FP32 = 60.0
MIN_IDENTICAL = 0.35
# BLEU against the references: fp32 ~8 (greedy) and ~9.5 (beam 4); int8 within a few tenths; a zeroed layer ~2.6.
MAX_BLEU_DROP = 1.5


def _quantize(model: nn.Module) -> nn.Module:
    with warnings.catch_warnings():  # torch.ao.quantization is deprecated in favour of torchao; the call still works
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)


def _is_quantized(module: nn.Module) -> bool:
    return type(module).__module__.startswith("torch.ao.nn.quantized.dynamic")


def test_quantize_dynamic_finds_every_linear_map_and_the_model_still_generates():
    model = tiny_model()
    quantized = _quantize(model)
    # 6 attentions (2 encoder self, 2 decoder self, 2 encoder-decoder) x 4 projections, 4 layers x 2 FFN linears and
    # the output projection
    assert sum(_is_quantized(module) for module in quantized.modules()) == 6 * 4 + 4 * 2 + 1
    assert not [name for name, module in quantized.named_modules() if isinstance(module, nn.Linear)]
    assert {type(module) for module in model.modules() if isinstance(module, nn.Linear)} == {nn.Linear}  # a copy
    assert isinstance(quantized.model.decoder.layers[1].encoder_attn.v_proj.weight(), torch.Tensor)
    ids, mask = padded_batch(length=9)
    for settings in (dict(num_beams=4), dict(num_beams=1, do_sample=False)):
        sequences = quantized.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, **settings)
        assert sequences.shape == (3, 7) and sequences[:, 0].eq(model.config.decoder_start_token_id).all()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids).logits
        int8 = quantized(input_ids=ids, attention_mask=mask, decoder_input_ids=ids).logits
    assert not torch.equal(int8, logits)  # int8 products ran
    torch.testing.assert_close(int8, logits, atol=0.05 * logits.abs().max().item(), rtol=0)


@pytest.fixture(scope="module")
def tokenizer():
    return multi30k_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer) -> VaswaniForConditionalGeneration:
    """300 Adam steps of 32 Multi30k De->En pairs (loss ~3.4, from ~7.6)."""
    return trained_multi30k_model(tokenizer, steps=300)


@pytest.fixture(scope="module")
def test_set() -> tuple[list[str], list[str]]:
    return read_lines(multi30k_file("test", "de"))[:SENTENCES], read_lines(multi30k_file("test", "en"))[:SENTENCES]


def _translate(model, tokenizer, sentences: list[str], **settings) -> list[str]:
    texts = []
    for start in range(0, len(sentences), BATCH):
        ids = model.generate(**multi30k_batch(tokenizer, sentences[start:start + BATCH]), **DECODING, **settings)
        texts += [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]
    return texts


def _zero_one_layer(quantized: nn.Module) -> nn.Module:
    """A broken quantization: the int8 weights of one decoder FFN linear all zero (its bias kept)."""
    fc2 = quantized.model.decoder.layers[1].fc2
    zero = torch.quantize_per_tensor(torch.zeros_like(fc2.weight().dequantize()), 0.1, 0, torch.qint8)
    fc2.set_weight_bias(zero, fc2.bias())
    return quantized


@pytest.mark.parametrize("settings", [dict(num_beams=1), dict(num_beams=4, length_penalty=0.6)],
                         ids=["greedy", "beam4"])
def test_int8_translations_agree_with_fp32(model, tokenizer, test_set, settings):
    sources, references = test_set
    fp32 = _translate(model, tokenizer, sources, **settings)
    fp32_bleu = sacrebleu.corpus_bleu(fp32, [references]).score
    assert fp32_bleu > 5.0  # the model translates: agreement below is not that of two models emitting one token
    for quantized, broken in ((_quantize(model), False), (_zero_one_layer(_quantize(model)), True)):
        int8 = _translate(quantized, tokenizer, sources, **settings)
        identical = sum(a == b for a, b in zip(int8, fp32, strict=True)) / len(fp32)
        against_fp32 = sacrebleu.corpus_bleu(int8, [fp32]).score
        drop = fp32_bleu - sacrebleu.corpus_bleu(int8, [references]).score
        good = identical >= MIN_IDENTICAL and against_fp32 >= MIN_BLEU_AGAINST_FP32 and drop <= MAX_BLEU_DROP
        assert good != broken, (broken, identical, against_fp32, drop)
        if broken:  # each measure alone tells the broken one apart
            assert identical < MIN_IDENTICAL / 3 and against_fp32 < MIN_BLEU_AGAINST_FP32 / 3
            assert drop > 2 * MAX_BLEU_DROP
