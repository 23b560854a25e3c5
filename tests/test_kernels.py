"""The CPU fast paths (`kernels_vaswani.py`) compute what the plain model computes, are installed where they are
promised, and leave the model plain outside.

- `cpu_dropout` (`CPUDropout`, a cheaper random mask) has dropout's distribution, scale and gradient;
- "vaswani_sdpa" runs `cpu_attention_forward` (in fp32) on a CPU in bf16 and with attention dropout, and torch's
  SDPA otherwise;
- `generate()` multiplies with packed weights (`inference_fast_paths`; MKL's packed sgemm, else oneDNN's layout),
  one packing for every row count, giving `nn.Linear`'s outputs, packing once per call, falling back to `nn.Linear`
  where packing fails, for several threads at once;
- fp32 CPU training linears in oneDNN (`OneDNNLinear`, where `cpu_training_matmul` finds it much faster than BLAS)
  give `nn.Linear`'s outputs and gradients, only in fp32 training steps;
- the fused output projection and loss (`cpu_projected_cross_entropy`) is the cross-entropy of the projection;
- the training forward of `training_fast_paths` (the label-smoothed loss, the step on the unpadded tokens of a
  right-padded batch, the fused loss) gives the plain padded step's loss and gradients to float rounding, in post-LN
  and pre-LN, with gaps in the labels, under gradient checkpointing and under bf16 autocast (on a model trained on the
  copy task, whose loss depends on where each token is); batches where unpadding would change a result (a left-padded
  or empty source row) or gain nothing (no padding), and calls that need every position, keep the padded layout;
- the training commands' trainer runs its steps with every CPU fast path installed, and a model built, loaded, trained
  or decoded is made of plain modules afterwards.

Each tolerance has a control beside it: the bug it guards against (masks or scaling lost, bf16 rounding inside an fp32
path, a wrong divisor, correlated dropout draws, an unpadded row misplaced or a token dropped) computed and shown to
miss it by orders of magnitude. Every test here depends on the kernels the CPU's instruction set picks: conftest marks
them `isa`.
"""

import contextlib
import copy
import os
import threading

import pytest
import torch
import torch.nn.functional as F
from helpers import padded_batch, tiny_model, trained_copy_model
from torch import nn

from vaswani_hf import fast_paths_vaswani, kernels_vaswani
from vaswani_hf.fast_paths_vaswani import inference_fast_paths, training_fast_paths
from vaswani_hf.kernels_vaswani import (
    CPUDropout,
    OneDNNLinear,
    _onednn_grad_weight,
    _onednn_linear,
    cpu_dropout,
    unpad_batch,
)
from vaswani_hf.modeling_vaswani import cross_entropy_loss

PLAIN_TYPES = {"Linear", "Dropout", "LayerNorm", "Embedding"}


def module_types(model) -> set[str]:
    """The types of the model's modules with parameters or dropout: plain torch modules on a plain model."""
    return {type(m).__name__ for m in model.modules() if isinstance(m, (nn.Linear, nn.Dropout, nn.LayerNorm,
                                                                         nn.Embedding))}


def bf16_rounded_linears(model):
    """Control: a copy of `model` with every linear weight rounded to bf16, what a fast fp32 path that multiplied in
    bf16 (oneDNN's bf16 fpmath mode, say) would compute."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for module in rounded.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(module.weight.bfloat16().float())
    return rounded


# Dropout ---------------------------------------------------------------------------------------------------------


def test_cpu_dropout_keeps_one_minus_p_and_scales_the_kept_elements():
    torch.manual_seed(0)
    x = torch.rand(1001, 999) + 0.5  # no zeros, odd element count
    for p in (0.1, 0.3):
        out = cpu_dropout(x, p, training=True)
        kept = out.ne(0)
        # 1M Bernoulli(1 - p) draws: standard deviation of the kept fraction < 5e-4 (a rate off by 0.005 exceeds it)
        assert abs(kept.float().mean().item() - (1 - p)) < 2.5e-3
        torch.testing.assert_close(out[kept], x[kept] / (1 - p), rtol=1e-6, atol=0)
    # independent draws: the four elements one 64-bit draw decides (its 16-bit quarters) are not correlated
    keep = cpu_dropout(x, 0.5, training=True).ne(0).flatten().float()
    quarters = keep[: keep.numel() // 4 * 4].view(-1, 4)
    for i in range(4):
        for j in range(i + 1, 4):
            assert abs((quarters[:, i] * quarters[:, j]).mean().item() - 0.25) < 3e-3
    assert abs(quarters.prod(1).mean().item() - 0.0625) < 2e-3
    # control: quarters decided by one shared bit would give 0.5 and 0.5, a hundred times the tolerances
    shared = (torch.rand(quarters.shape[0]) < 0.5).float()[:, None].expand(-1, 4)
    assert abs((shared[:, 0] * shared[:, 1]).mean().item() - 0.25) > 0.2
    assert abs(shared.prod(1).mean().item() - 0.0625) > 0.2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_dropout_float_mask_is_the_threshold_rule_on_the_random_quarters(dtype):
    """The float mask clamp(q - t + 1, 0, 1) keeps exactly the elements whose 16-bit quarter q is >= t, and the
    output is `where(keep, x, 0) * scale` rounded as `F.dropout` rounds it, bit for bit."""
    x = (torch.rand(257, 63) + 0.5).to(dtype)  # an element count that is not a multiple of 4
    p = 0.1
    torch.manual_seed(5)
    out = cpu_dropout(x, p)
    torch.manual_seed(5)
    bits = torch.empty((x.numel() + 3) // 4, dtype=torch.int64).random_(-(2**63), None)
    keep = bits.view(torch.int16)[: x.numel()].view(x.shape) >= -(2**15) + round(p * 2**16)
    assert torch.equal(out, torch.where(keep, x, 0.0).mul_(1 / (1 - p)))
    assert 0 < int((~keep).sum()) < x.numel()


def test_dropout_keep_mask_is_the_same_rule_in_every_dtype_and_at_the_ends_of_p():
    """The bf16 mask (clamped 16-bit integers) keeps what the fp32 one (clamped floats) keeps, for every 16-bit q,
    also where p is so close to 0 or 1 that t - 1 or t leaves the int16 range."""
    from vaswani_hf.kernels_vaswani import _dropout_keep_mask
    every_q = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    for p in (1e-6, 2**-16, 0.1, 0.5, 0.9, 1 - 2**-16, 1 - 1e-6):
        threshold = -(2**15) + round(p * 2**16)
        expected = (every_q.int() >= threshold).float()
        assert torch.equal(_dropout_keep_mask(every_q, p, torch.bfloat16).float(), expected), p
        assert torch.equal(_dropout_keep_mask(every_q, p, torch.float32).ne(0).float(), expected), p
    assert 0 < int(_dropout_keep_mask(every_q, 0.1, torch.bfloat16).sum()) < 2**16


def test_cpu_dropout_gradient_is_the_mask_times_the_scale():
    torch.manual_seed(1)
    x = (torch.rand(64, 33) + 0.5).requires_grad_()
    out = CPUDropout(0.1)(x)
    weights = torch.randn(64, 33)
    (out * weights).sum().backward()
    expected = out.detach().ne(0).float() * weights / 0.9
    torch.testing.assert_close(x.grad, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_dropout_backward_keeps_two_bytes_and_is_f_dropouts_gradient_bit_for_bit(dtype):
    """The backward pass applies the forward pass's mask and scale, rounded as `F.dropout`'s backward rounds them
    (`where(keep, g, 0) * scale` in the dtype), from 2 bytes kept per element (the random integers in fp32, the 0/1
    mask in bf16)."""
    p = 0.1
    x = (torch.rand(257, 63) + 0.5).to(dtype).requires_grad_()
    grad = torch.randn(257, 63).to(dtype)
    torch.manual_seed(7)
    out = cpu_dropout(x, p)
    kept = [(t.numel(), t.element_size()) for t in out.grad_fn.saved_tensors]
    out.backward(grad)
    torch.manual_seed(7)
    bits = torch.empty((x.numel() + 3) // 4, dtype=torch.int64).random_(-(2**63), None)
    keep = bits.view(torch.int16)[: x.numel()].view(x.shape) >= -(2**15) + round(p * 2**16)
    expected = torch.where(keep, grad, 0.0).mul_(1 / (1 - p))
    assert torch.equal(x.grad, expected)
    assert not torch.equal(x.grad, torch.where(keep, grad, 0.0))  # the scale is applied
    assert kept == [(x.numel(), 2)]


def test_cpu_dropout_is_seeded_identity_in_eval_and_keeps_the_dtype():
    x = torch.rand(8, 16) + 0.5
    torch.manual_seed(3)
    first = cpu_dropout(x, 0.1)
    torch.manual_seed(3)
    assert torch.equal(cpu_dropout(x, 0.1), first)
    assert torch.equal(cpu_dropout(x, 0.1, training=False), x) and torch.equal(cpu_dropout(x, 0.0), x)
    assert torch.equal(CPUDropout(0.1).eval()(x), x)
    assert cpu_dropout(x.bfloat16(), 0.1).dtype == torch.bfloat16
    assert cpu_dropout(x, 1.0).eq(0).all()  # F.dropout's answer for p = 1
    assert cpu_dropout(torch.empty(0, 4), 0.1).shape == (0, 4)


# Attention ("vaswani_sdpa") -----------------------------------------------------------------------------------------


def record_cpu_attention(monkeypatch) -> tuple[list, object]:
    """Record the query dtype of every `cpu_attention_forward` call; returns the record and the real function."""
    calls = []
    real = kernels_vaswani.cpu_attention_forward
    monkeypatch.setattr(kernels_vaswani, "cpu_attention_forward",
                        lambda module, query, *args, **kwargs: calls.append(query.dtype) or real(module, query, *args,
                                                                                                  **kwargs))
    return calls, real


def test_bf16_attention_on_a_cpu_computes_the_scores_in_fp32(monkeypatch):
    calls, half = record_cpu_attention(monkeypatch)
    # a copy model: its loss depends on what attention reads (an untrained model's is about ln V whatever it reads)
    model = trained_copy_model(steps=100, attn_implementation="vaswani_sdpa")
    ids, mask, labels = copy_task_batch(left_padded=True)
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, labels=labels)
        assert not calls  # fp32: torch's SDPA
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = model(input_ids=ids, attention_mask=mask, labels=labels)
            broken, recording = {}, kernels_vaswani.cpu_attention_forward  # controls: mask, 1 / sqrt(d_k) dropped
            for bug, change in (("mask", dict(attention_mask=None)), ("scaling", dict(scaling=1.0))):
                monkeypatch.setattr(kernels_vaswani, "cpu_attention_forward",
                                    lambda module, query, key, value, attention_mask, scaling, dropout, change=change:
                                    half(module, query, key, value, **{"attention_mask": attention_mask,
                                                                       "scaling": scaling, "dropout": dropout,
                                                                       **change}))
                broken[bug] = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            monkeypatch.setattr(kernels_vaswani, "cpu_attention_forward", recording)
        bf16 = copy.deepcopy(model).to(torch.bfloat16)(input_ids=ids, attention_mask=mask, labels=labels)
    assert calls == [torch.bfloat16] * 2 * 6  # 2 encoder + 2x2 decoder attentions, in each bf16 forward
    assert bf16.logits.dtype == torch.bfloat16 and 0.5 < reference.loss < 3.0  # ln 24 = 3.18 untrained
    for half_precision in (autocast, bf16):
        torch.testing.assert_close(half_precision.loss.float(), reference.loss, rtol=0.02, atol=0.02)
    # the controls move the loss by 0.27 (mask) and 0.14 (scaling): 13 and 7 times the tolerance
    for bug, loss in broken.items():
        assert abs(float(loss) - float(reference.loss)) > 0.1, bug
    # the scores and both products are fp32: Eq. 1 in fp32 on the bf16 inputs, rounded to bf16 once at the end, not
    # a softmax of bf16-rounded scores
    generator = torch.Generator().manual_seed(6)
    query, key, value = (torch.randn(2, 2, 5, 8, generator=generator).mul(8).bfloat16() for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = half(model.model.encoder.layers[0].self_attn, query, key, value, None, scaling=8**-0.5)
    probs = torch.softmax(query.float() @ key.float().transpose(2, 3) * 8**-0.5, dim=-1)
    expected = (probs @ value.float()).transpose(1, 2)
    # one bf16 rounding of the output (2^-9 relative); bf16-rounded scores exceed it tens of times
    tolerance = dict(rtol=4e-3, atol=1e-4)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, **tolerance)
    rounded_scores = torch.softmax((query @ key.transpose(2, 3) * 8**-0.5).float(), dim=-1)
    control = (rounded_scores.bfloat16().float() @ value.float()).transpose(1, 2)
    excess = (control - expected).abs() / (tolerance["atol"] + tolerance["rtol"] * expected.abs())
    assert excess.max() > 5, excess.max()


def test_fp32_training_attention_keeps_torchs_kernel_unless_attention_dropout(monkeypatch):
    calls, _ = record_cpu_attention(monkeypatch)
    sdpa_calls = []
    real_sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *args, **kwargs: sdpa_calls.append(1) or real_sdpa(*args, **kwargs))
    ids, mask = padded_batch(length=9)
    labels = ids.masked_fill(mask.eq(0), -100)
    model = tiny_model(dropout=0.0).train()
    results = {}
    for kernel in ("vaswani_sdpa", "eager"):  # eager: the reference of Eq. 1, written out
        model.config._attn_implementation = kernel
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        results[kernel] = loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert calls == [] and len(sdpa_calls) == 6  # 2 encoder + 2x2 decoder attentions, in the vaswani_sdpa step
    torch.testing.assert_close(results["vaswani_sdpa"][0], results["eager"][0], rtol=1e-6, atol=1e-6)
    for got, expected in zip(results["vaswani_sdpa"][1], results["eager"][1], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # control: self-attention scaled by 2 / sqrt(d_k) moves the loss by 7e-3 and some gradient by 7e-2, thousands of
    # times the tolerances
    for layer in (*model.model.encoder.layers, *model.model.decoder.layers):
        layer.self_attn.scaling *= 2
    model.zero_grad()
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    assert abs(float(loss.detach()) - float(results["eager"][0])) > 1e-3
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert max((got - expected).abs().max() for got, expected in zip(grads, results["eager"][1], strict=True)) > 1e-2
    for layer in (*model.model.encoder.layers, *model.model.decoder.layers):
        layer.self_attn.scaling /= 2
    # attention dropout (not the paper's): the CPU kernel, which draws the cheaper dropout mask
    model.config._attn_implementation = "vaswani_sdpa"
    for module in model.modules():
        if hasattr(module, "is_cross_attention"):
            module.dropout = 0.1
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    assert calls == [torch.float32] * 6 and len(sdpa_calls) == 6 and torch.isfinite(loss)


# Packed linears in generate() (`inference_fast_paths`) ---------------------------------------------------------------


needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(),
    reason="this torch has no oneDNN: the packed CPU path does not exist and generate() runs nn.Linear, which "
           "test_generation.py covers")


@needs_onednn
def test_packed_linears_compute_what_nn_linear_computes(monkeypatch):
    calls = []
    packed_linear = kernels_vaswani.packed_linear
    monkeypatch.setattr(kernels_vaswani, "packed_linear", lambda *args: calls.append(1) or packed_linear(*args))
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    decoder_ids = torch.randint(3, 99, (3, 5), generator=torch.Generator().manual_seed(4))
    state = model.state_dict()
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        with inference_fast_paths(model):
            assert type(model.lm_head) is OneDNNLinear and model.lm_head.packed_weight is not None
            assert model.config._attn_implementation == "vaswani_sdpa"
            assert model.state_dict().keys() == state.keys()  # the same parameters, names and tensors
            assert all(model.state_dict()[name].data_ptr() == tensor.data_ptr() for name, tensor in state.items())
            fast = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
            with inference_fast_paths(model):  # nested: the outer installation stays
                pass
            assert model.lm_head.packed_weight is not None
    assert module_types(model) == PLAIN_TYPES and model.config._attn_implementation == "sdpa"  # undone on exit
    assert not any({"packed_weight", "stacked"} & set(vars(m)) for m in model.modules())
    # the packed product ran every linear map once, the input projections of an attention stacked into one: 2 encoder
    # layers x 4 (q|k|v, out, fc1, fc2), 2 decoder layers x 7 (q|k|v, out, cross-attention q, k|v and out, fc1, fc2),
    # and lm_head; and it gave what nn.Linear gives
    assert len(calls) == 2 * 4 + 2 * 7 + 1
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
    # control: linears multiplied in bf16 move the logits by 1.4e-2, a thousand times the tolerance
    with torch.no_grad():
        rounded = bf16_rounded_linears(model)(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    assert (rounded - plain).abs().max() > 1e-3


@needs_onednn
@pytest.mark.parametrize("library", ["mkl", "onednn"])
def test_one_packing_computes_nn_linear_for_every_row_count(library):
    """A weight packed once (`pack_for_inference`) serves every row count a beam search passes as sentences finish
    (MKL's packed sgemm is packed for 64 rows and computes any), 2-D and 3-D inputs, and an empty one."""
    if library == "mkl" and not kernels_vaswani.has_mkl_packed_linear():
        pytest.skip("this torch build has no MKL: pack_for_inference packs for oneDNN, the other case")
    torch.manual_seed(0)
    weight, bias = torch.randn(300, 48) / 7, torch.randn(300)
    packed = kernels_vaswani.pack_for_inference(weight, library)
    assert packed[2] == library
    for rows in (1, 3, 4, 17, 63, 64, 65, 128, 130, 257):
        x = torch.randn(rows, 48)
        expected = F.linear(x, weight, bias)
        got = kernels_vaswani.packed_linear(x, packed, bias)
        assert got.shape == (rows, 300)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kernels_vaswani.packed_linear(x, packed), x @ weight.T, rtol=1e-5, atol=1e-5)
    x = torch.randn(5, 13, 48)
    torch.testing.assert_close(kernels_vaswani.packed_linear(x, packed, bias), F.linear(x, weight, bias),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(kernels_vaswani.packed_linear(torch.randn(0, 48), packed, bias), torch.empty(0, 300))
    # control: another weight's packing is off by orders of magnitude more than the tolerance
    other = kernels_vaswani.pack_for_inference(weight.roll(1, dims=0), library)
    assert (kernels_vaswani.packed_linear(x, other, bias) - F.linear(x, weight, bias)).abs().max() > 0.1


def test_inference_packing_takes_mkl_where_torch_has_it():
    """On x86 builds (torch with MKL) the decoding products read MKL's packed layout, the faster one there
    (docs/performance.md); elsewhere oneDNN's."""
    if not (torch.backends.mkl.is_available() or torch.backends.mkldnn.is_available()):
        pytest.skip("this torch has neither MKL nor oneDNN: generate() runs nn.Linear (test_generation.py)")
    expected = "mkl" if torch.backends.mkl.is_available() else "onednn"
    assert kernels_vaswani.pack_for_inference(torch.randn(8, 4))[2] == expected
    with pytest.raises(ValueError, match='library must be "mkl" or "onednn"'):
        kernels_vaswani.pack_for_inference(torch.randn(8, 4), "blas")


@needs_onednn
def test_packed_linears_leave_training_bf16_and_opt_out_alone():
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    labels = ids.masked_fill(mask.eq(0), -100)
    with inference_fast_paths(model):
        assert model.lm_head.packed_weight is not None
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss  # autograd on: nn.Linear's path
        loss.backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    with torch.autocast("cpu", dtype=torch.bfloat16), inference_fast_paths(model):
        assert type(model.lm_head) is nn.Linear
    with inference_fast_paths(model.to(torch.bfloat16)):
        assert type(model.lm_head) is nn.Linear
    model = tiny_model()
    with inference_fast_paths(model, packed_linears=False):
        assert type(model.lm_head) is nn.Linear and model.config._attn_implementation == "vaswani_sdpa"
    hooked = tiny_model()
    hooked.lm_head.register_forward_hook(lambda module, args, out: None)  # as an adapter or offloading would
    attention = hooked.model.encoder.layers[0].self_attn
    attention.v_proj.register_forward_hook(lambda module, args, out: None)
    with inference_fast_paths(hooked):
        assert type(hooked.lm_head) is nn.Linear and type(hooked.model.encoder.layers[0].fc1) is OneDNNLinear
        assert type(attention.v_proj) is nn.Linear and attention.q_proj.stacked is None  # q and k unstacked too
        assert attention.q_proj.packed_weight is not None and attention.k_proj.packed_weight is not None


@needs_onednn
@pytest.mark.parametrize("kwargs", [dict(num_beams=4), dict(num_beams=1, do_sample=False)])
def test_generate_with_packed_linears_matches_and_sees_changed_weights(kwargs):
    model, plain = tiny_model(), tiny_model()
    plain.use_cpu_packed_linears = False
    ids, mask = padded_batch(length=9)
    for round_ in range(2):
        fast = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, output_scores=True,
                              max_new_tokens=8, **kwargs)
        slow = plain.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, output_scores=True,
                              max_new_tokens=8, **kwargs)
        assert torch.equal(fast.sequences, slow.sequences)
        for step_fast, step_slow in zip(fast.scores, slow.scores, strict=True):
            finite = torch.isfinite(step_slow)
            torch.testing.assert_close(step_fast[finite], step_slow[finite], rtol=1e-4, atol=1e-5)
        with torch.no_grad():  # an update between calls (as an optimizer step would make) must be seen
            for candidate in (model, plain):
                candidate.model.decoder.layers[0].fc2.weight.mul_(3.0)
                candidate.lm_head.weight.add_(0.5)


@needs_onednn
def test_generate_falls_back_to_nn_linear_when_packing_fails(monkeypatch):
    model, plain = tiny_model(), tiny_model()
    plain.use_cpu_packed_linears = False
    ids, mask = padded_batch(length=9)
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6)

    def refuse(weight, batch_size):
        raise RuntimeError("this build cannot pack")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    monkeypatch.setattr(torch.ops.mkl, "_mkl_reorder_linear_weight", refuse)
    with inference_fast_paths(model):
        assert type(model.lm_head) is nn.Linear
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6), expected)


@needs_onednn
def test_generate_packs_the_weights_as_they_are_at_every_call(monkeypatch):
    packs = []
    pack = fast_paths_vaswani.pack_for_inference
    monkeypatch.setattr(fast_paths_vaswani, "pack_for_inference", lambda *args: packs.append(1) or pack(*args))
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6)
    per_packing = len(packs)
    assert per_packing == 2 * 4 + 2 * 7 + 1  # every linear map, an attention's input projections stacked in one
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6), first)
    assert len(packs) == 2 * per_packing  # nothing is kept from one call to the next
    assert module_types(model) == PLAIN_TYPES  # outside generate() nothing is swapped
    assert not any("packed_weight" in m.__dict__ or "stacked" in m.__dict__ for m in model.modules())


@needs_onednn
@pytest.mark.parametrize("update", ["fused_adam_in_eval_mode", "fused_adam_as_trainer_does"])
def test_weights_packed_by_one_generate_are_not_reused_after_the_weights_change(update):
    """generate() decodes with the weights as they are, after torch's fused Adam too, which writes parameters without
    advancing their version counter (an evaluation during training decodes with the weights of that step)."""
    model = tiny_model(dropout=0.0).eval()
    ids, mask = padded_batch(length=9)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05, fused=True)
    labels, _ = padded_batch(seed=3, length=7)
    if update == "fused_adam_as_trainer_does":
        model.train()  # Trainer: train mode for the steps, eval mode for the evaluation's generate()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    optimizer.step()  # the version counters stay where they were
    model.eval()
    fresh = copy.deepcopy(model)
    assert module_types(fresh) == PLAIN_TYPES
    fresh.use_cpu_packed_linears = False
    expected = fresh.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, output_scores=True,
                              return_dict_in_generate=True)
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, output_scores=True,
                         return_dict_in_generate=True)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(expected.scores))


def test_one_model_decodes_for_several_threads_at_once():
    """The fast paths are installed by the first call and undone by the last; the beam search state of each call
    is its own: four threads decoding different batches get what each batch gets alone."""
    model = trained_copy_model(steps=40)
    batches = [padded_batch(seed=seed, length=9, vocab=24) for seed in range(4)]
    alone = [model.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=12)
             for ids, mask in batches]
    results, errors, start = {}, [], threading.Barrier(4)

    def decode(index):
        try:
            start.wait()
            for _ in range(3):
                ids, mask = batches[index]
                results[index] = model.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=12)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for index, expected in enumerate(alone):
        assert torch.equal(results[index], expected)
    assert len({tuple(out[0].tolist()) for out in alone}) > 1  # the batches translate differently
    assert module_types(model) == PLAIN_TYPES and model.config._attn_implementation == "sdpa"
    assert not fast_paths_vaswani._INSTALLED


# fp32 CPU training linears in oneDNN (`OneDNNLinear`, `cpu_training_matmul`) -----------------------------------------


def onednn_linear(in_features: int, out_features: int, bias: bool = True) -> OneDNNLinear:
    linear = nn.Linear(in_features, out_features, bias=bias)
    linear.__class__ = OneDNNLinear  # as training_fast_paths swaps it
    return linear


@needs_onednn
@pytest.mark.parametrize("rows_shape,in_features,out_features", [
    ((16,), 8, 64),  # weight gradient as (x^T g)^T: in * (rows + out) < out * rows
    ((16,), 64, 8),  # weight gradient as g^T x
    ((3, 7), 24, 24),  # a (B, L, D) input
])
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_training_linear_computes_what_nn_linear_computes(monkeypatch, rows_shape, in_features,
                                                                 out_features, bias):
    monkeypatch.setattr(kernels_vaswani, "cpu_training_matmul", lambda: "onednn")
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: calls.append(1) or real(*args))
    torch.manual_seed(0)
    fast = onednn_linear(in_features, out_features, bias=bias)
    plain = torch.nn.Linear(in_features, out_features, bias=bias)
    plain.load_state_dict(fast.state_dict())
    x = torch.randn(*rows_shape, in_features)
    upstream = torch.randn(*rows_shape, out_features)
    outputs, grads = [], []
    for module in (fast, plain):
        leaf = x.clone().requires_grad_()
        y = module(leaf)
        (y * upstream).sum().backward()
        outputs.append(y)
        grads.append([leaf.grad] + [p.grad for p in module.parameters()])
    assert len(calls) == 3  # forward, input gradient, weight gradient
    assert outputs[0].shape == outputs[1].shape
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
    for fast_grad, plain_grad in zip(*grads, strict=True):
        assert fast_grad.shape == plain_grad.shape and fast_grad.is_contiguous()
        torch.testing.assert_close(fast_grad, plain_grad, rtol=1e-5, atol=1e-5)
    # control: the product in bf16 moves the output by about 5e-3, hundreds of times the tolerance
    rounded = F.linear(x.bfloat16().float(), plain.weight.bfloat16().float(), plain.bias)
    assert (rounded - outputs[1]).abs().max() > 1e-3


@needs_onednn
def test_onednn_training_linear_computes_only_the_gradients_asked_for(monkeypatch):
    monkeypatch.setattr(kernels_vaswani, "cpu_training_matmul", lambda: "onednn")
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: calls.append(1) or real(*args))
    linear = onednn_linear(8, 16)
    linear.weight.requires_grad_(False)  # a frozen base layer, as under LoRA
    x = torch.randn(5, 8, requires_grad=True)
    linear(x).sum().backward()
    assert len(calls) == 2 and linear.weight.grad is None  # forward and input gradient only
    torch.testing.assert_close(x.grad, linear.weight.sum(0).expand(5, 8), rtol=1e-5, atol=1e-5)
    assert linear.bias.grad is not None and torch.equal(linear.bias.grad, torch.full((16,), 5.0))
    calls.clear()
    linear.weight.requires_grad_(True)
    linear(torch.randn(5, 8)).sum().backward()  # the input needs no gradient
    assert len(calls) == 2 and linear.weight.grad is not None


@needs_onednn
def test_onednn_training_path_takes_only_fp32_training_steps(monkeypatch):
    monkeypatch.setattr(kernels_vaswani, "cpu_training_matmul", lambda: "onednn")
    linear = onednn_linear(32, 16).train()
    assert linear.trains_with_onednn(torch.randn(2, 32))
    with torch.no_grad():
        assert not linear.trains_with_onednn(torch.randn(2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not linear.trains_with_onednn(torch.randn(2, 32))
    assert not linear.trains_with_onednn(torch.randn(2, 32, dtype=torch.float64))
    assert not linear.eval().trains_with_onednn(torch.randn(2, 32))
    monkeypatch.setattr(kernels_vaswani, "cpu_training_matmul", lambda: "blas")
    assert not linear.train().trains_with_onednn(torch.randn(2, 32))


@needs_onednn
def test_a_training_step_in_onednn_equals_the_blas_step(monkeypatch):
    results = {}
    ids, mask = padded_batch(length=9)
    labels = torch.randint(4, 99, (3, 6), generator=torch.Generator().manual_seed(1))
    labels[2, 4:] = -100
    for library in ("blas", "onednn"):
        monkeypatch.setattr(kernels_vaswani, "cpu_training_matmul", lambda library=library: library)
        calls = []
        real = torch.ops.mkldnn._linear_pointwise
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                            lambda *args, calls=calls, real=real: calls.append(1) or real(*args))
        model = tiny_model(dropout=0.0).train()
        with training_fast_paths(model, 0.0):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        results[library] = (loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        monkeypatch.undo()
        # 3 products per linear (forward, input and weight gradients): encoder 2 x 6, decoder 2 x 10, lm_head
        assert len(calls) == (0 if library == "blas" else 3 * (2 * 6 + 2 * 10 + 1))
    torch.testing.assert_close(results["onednn"][0], results["blas"][0], rtol=1e-5, atol=1e-6)
    assert results["onednn"][1].keys() == results["blas"][1].keys() and len(results["blas"][1]) > 40
    for name, grad in results["blas"][1].items():
        torch.testing.assert_close(results["onednn"][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # control: linears multiplied in bf16 move some gradient by 4e-2, far beyond 1e-6 + 1e-4 |g|
    monkeypatch.setattr(kernels_vaswani, "cpu_training_matmul", lambda: "blas")
    rounded = bf16_rounded_linears(tiny_model(dropout=0.0)).train()
    rounded(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    excess = max(((p.grad - results["blas"][1][name]).abs() / (1e-6 + 1e-4 * results["blas"][1][name].abs())).max()
                 for name, p in rounded.named_parameters() if p.grad is not None)
    assert excess > 10


@pytest.mark.parametrize("rows_shape", [(37,), (3, 7), (64,)])  # padded to 64 rows; a (B, L, D) input; no padding
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_training_linear_computes_what_autocast_computes(rows_shape, bias):
    torch.manual_seed(0)
    fast, plain = onednn_linear(24, 40, bias=bias).train(), nn.Linear(24, 40, bias=bias)
    plain.load_state_dict(fast.state_dict())
    x, upstream = torch.randn(*rows_shape, 24), torch.randn(*rows_shape, 40)
    results = []
    for module in (fast, plain):
        leaf = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = module(leaf)
        (y.float() * upstream).sum().backward()
        results.append([y, leaf.grad, *(p.grad for p in module.parameters())])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fast.trains_in_bf16(x.requires_grad_()) == kernels_vaswani.onednn_bf16()
    assert not fast.trains_in_bf16(x)  # fp32: not this path
    for got, want in zip(*results, strict=True):  # autocast's dtypes: bf16 output, fp32 gradients
        assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
        assert _relative_error(got, want) < 4e-3  # the same bf16 products, summed in another order at most
    # control: the weight's gradient of all rows but one is 10 % and more off, the padded rows must add nothing
    dropped = upstream.reshape(-1, 40)[1:].t() @ x.reshape(-1, 24)[1:]
    assert _relative_error(dropped, results[1][2]) > 0.05



def test_bf16_training_linears_on_one_input_pad_it_once_and_again_when_it_changes(monkeypatch):
    calls = []
    padded_once = kernels_vaswani._rows_padded
    monkeypatch.setattr(kernels_vaswani, "_rows_padded",
                        lambda x, dtype: (x.shape[1] == 24 and calls.append(x.shape)) or padded_once(x, dtype))
    torch.manual_seed(0)
    linears = [nn.Linear(24, 40) for _ in range(3)]  # W^Q, W^K, W^V reading one input
    leaf = torch.randn(3, 7, 24, requires_grad=True)
    x = leaf * 1.0

    def fast(linear, x):
        return kernels_vaswani._Bf16LinearFunction.apply(x, linear.weight, linear.bias)

    def plain(linear, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return linear(x)

    outputs = [fast(linear, x) for linear in linears]
    assert calls == [(21, 24)]  # one padded copy for the three products
    for output, linear in zip(outputs, linears, strict=True):
        assert _relative_error(output, plain(linear, x)) < 4e-3
    sum(o.float().sum() for o in outputs).backward()  # the shared copy serves all three backward passes
    plain_leaf = leaf.detach().clone().requires_grad_()
    sum(plain(linear, plain_leaf * 1.0).float().sum() for linear in linears).backward(inputs=[plain_leaf])
    assert _relative_error(leaf.grad, plain_leaf.grad) < 4e-3
    with torch.no_grad():
        x.mul_(-2.0)  # changed in place: padded again, not the stale copy
        again = fast(linears[0], x)
        fast(linears[1], x.clone())  # another tensor of the same values: padded anew
    assert calls == [(21, 24), (21, 24), (21, 24)]
    assert _relative_error(again, plain(linears[0], x)) < 4e-3
    assert _relative_error(again, outputs[0]) > 0.5  # control: the stale copy gives the old product


REUSE_PROBE = """
import sys, torch
sys.path.insert(0, {root!r})
from torch import nn
from vaswani_hf.kernels_vaswani import OneDNNLinear, cpu_projected_cross_entropy
weight = torch.randn(300, 256)
for cls in (OneDNNLinear, nn.Linear):
    linear = nn.Linear(256, 1024)
    linear.__class__ = cls  # as training_fast_paths swaps it, or left plain
    for rows in (705, 740, 768):  # three row counts of one multiple of 64 (768), as three training steps bring
        print("rows", flush=True)
        x = torch.randn(rows, 256, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = linear.train()(x)
            loss = cpu_projected_cross_entropy(x, weight, torch.zeros(rows, dtype=torch.long), 0.1, rows) \
                if cls is OneDNNLinear else None
        (y.float().sum() + (0 if loss is None else loss)).backward()
"""


def test_bf16_training_products_reuse_onednns_kernels_across_row_counts():
    import subprocess
    import sys

    from helpers import ROOT
    out = subprocess.run([sys.executable, "-c", REUSE_PROBE.format(root=str(ROOT))], capture_output=True, text=True,
                         check=True, env={**os.environ, "ONEDNN_VERBOSE": "profile_create"}).stdout
    created = [[]]  # per call: oneDNN's report of each computation it compiled ("miss") or found cached ("hit")
    for line in out.splitlines():
        if line.startswith("rows"):
            created.append([])
        elif ",primitive,create" in line and "cache_" in line:
            created[-1].append("hit" if "cache_hit" in line.split(",")[3] else "miss")
    fast, plain = created[1:4], created[4:7]
    if not kernels_vaswani.onednn_bf16():  # no oneDNN or no native bf16: torch's own kernels, nothing compiled
        assert not any(fast + plain), out[-1000:]
        return
    # the linear's 3 products and the fused loss's (2 or 3: torch may take g^T x outside oneDNN): compiled for the
    # first row count, reused for the next two
    assert len(fast[0]) >= 5 and [len(call) for call in fast] == [len(fast[0])] * 3, fast
    assert set(fast[0]) == {"miss"} and set(fast[1] + fast[2]) == {"hit"}, fast
    # control: autocast's nn.Linear multiplies 705 and 740 rows with kernels of their own
    assert set(plain[0] + plain[1]) == {"miss"} and len(plain[1]) == 3, plain


@pytest.mark.parametrize("onednn_seconds,blas_seconds,expected", [(1.0, 1.3, "onednn"), (1.0, 1.25, "blas"),
                                                                  (1.0, 0.5, "blas")])
def test_cpu_training_matmul_takes_onednn_only_when_clearly_faster(monkeypatch, onednn_seconds, blas_seconds,
                                                                   expected):
    monkeypatch.delenv("VASWANI_CPU_MATMUL", raising=False)
    monkeypatch.setattr(kernels_vaswani, "has_onednn_linear", lambda: True)
    timings = iter([onednn_seconds, blas_seconds])
    monkeypatch.setattr(kernels_vaswani, "_best_seconds", lambda function: next(timings))
    kernels_vaswani.cpu_training_matmul.cache_clear()
    try:
        assert kernels_vaswani.cpu_training_matmul() == expected
    finally:
        kernels_vaswani.cpu_training_matmul.cache_clear()


@pytest.mark.parametrize("value,expected", [("blas", "blas"), ("ONEDNN", "onednn"), ("bogus", ValueError)])
def test_cpu_training_matmul_follows_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv("VASWANI_CPU_MATMUL", value)
    monkeypatch.setattr(kernels_vaswani, "has_onednn_linear", lambda: True)
    monkeypatch.setattr(kernels_vaswani, "_best_seconds", lambda function: pytest.fail("measured despite the override"))
    kernels_vaswani.cpu_training_matmul.cache_clear()
    try:
        if expected is ValueError:
            with pytest.raises(ValueError, match="VASWANI_CPU_MATMUL='bogus'.*'onednn' or 'blas'"):
                kernels_vaswani.cpu_training_matmul()
        else:
            assert kernels_vaswani.cpu_training_matmul() == expected
        monkeypatch.setattr(kernels_vaswani, "has_onednn_linear", lambda: False)
        kernels_vaswani.cpu_training_matmul.cache_clear()
        if expected is not ValueError:
            assert kernels_vaswani.cpu_training_matmul() == "blas"  # no oneDNN: BLAS whatever is asked
    finally:
        kernels_vaswani.cpu_training_matmul.cache_clear()


# The fused output projection and loss of a CPU training step --------------------------------------------------------


@pytest.mark.parametrize("library", ["blas", "onednn"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_projected_cross_entropy_equals_cross_entropy_of_the_projection(library, label_smoothing, monkeypatch):
    if library == "onednn" and not kernels_vaswani.has_onednn_linear():
        pytest.skip("this torch has no oneDNN linear operators")
    monkeypatch.setattr(kernels_vaswani, "cpu_training_matmul", lambda: library)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, 16, generator=generator).requires_grad_()
    weight = torch.randn(53, 16, generator=generator).mul(0.5).requires_grad_()
    labels = torch.randint(0, 53, (37,), generator=generator)
    divisor = torch.tensor(41)  # Trainer's count over the whole accumulated batch, not this call's 37 rows
    expected = cross_entropy_loss(hidden @ weight.t(), labels, divisor, label_smoothing)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    loss = kernels_vaswani.cpu_projected_cross_entropy(hidden, weight, labels, label_smoothing, divisor)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    # control: this call's 37 rows as the divisor move the loss by 11 % of itself, 10^4 times the tolerance
    assert abs(float(loss.detach()) * 41 / 37 - float(expected.detach())) > 1e-2
    grads = torch.autograd.grad(loss * 3, (hidden, weight), retain_graph=True)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want * 3, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="cannot run backward again.*from the model's logits"):
        torch.autograd.grad(loss, (hidden, weight))  # its buffer now holds the softmax: refused, not wrong


def test_projected_cross_entropy_declines_where_it_does_not_apply():
    hidden, weight, labels = torch.randn(5, 4), torch.randn(7, 4), torch.tensor([0, 1, 2, 3, 6])
    project = kernels_vaswani.cpu_projected_cross_entropy
    assert project(hidden.bfloat16(), weight.bfloat16(), labels) is None  # bf16 weights: not autocast's step
    with torch.autocast("cpu", dtype=torch.float16):
        assert project(hidden, weight, labels) is None
    assert project(hidden[None], weight, labels) is None
    assert project(hidden, weight, labels) is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert project(hidden, weight, labels) is not None


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_projected_cross_entropy_under_bf16_autocast_equals_autocasts_projection_and_loss(label_smoothing):
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(61, 32, generator=generator).requires_grad_()
    weight = torch.randn(300, 32, generator=generator).mul(0.3).requires_grad_()
    labels = torch.randint(0, 300, (61,), generator=generator)
    divisor = torch.tensor(70)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = cross_entropy_loss(F.linear(hidden, weight), labels, divisor, label_smoothing)
        loss = kernels_vaswani.cpu_projected_cross_entropy(hidden, weight, labels, label_smoothing, divisor)
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    grads = torch.autograd.grad(loss * 2, (hidden, weight))
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)  # the same bf16 logits, the same fp32 loss
    for got, want in zip(grads, expected_grads, strict=True):
        assert got.dtype == torch.float32 and _relative_error(got, want * 2) < 1e-2  # bf16 products: 2^-8 each
    # control: the other label smoothing moves the gradients by 10 % and more, ten times the tolerance
    with torch.autocast("cpu", dtype=torch.bfloat16):
        other = kernels_vaswani.cpu_projected_cross_entropy(hidden, weight, labels, 0.5 - label_smoothing, divisor)
    assert _relative_error(torch.autograd.grad(other * 2, hidden)[0], expected_grads[0] * 2) > 0.1


def test_the_fast_training_step_in_bf16_is_as_close_to_fp32_as_the_plain_autocast_step():
    # bf16's gradients of a tiny untrained model are 2^-8 products summed: the plain autocast step itself is 3-15 %
    # off the fp32 step in some tensor, and which steps come closer changes from batch to batch. So the fast bf16 step
    # (the fused loss, the unpadded tokens, rows padded for oneDNN, attention's products in fp32) is held against the
    # fp32 step on four batches, and must be about as close to it as autocast's own step.
    fast_errors, plain_errors = [], []
    for seed in range(4):
        torch.manual_seed(seed)
        model = tiny_model(dropout=0.0)
        ids, mask, labels = batch(seed)
        exact_loss, exact = step(model, ids, mask, labels, fast=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fast_loss, fast_grads = step(model, ids, mask, labels)
            plain_loss, plain_grads = step(model, ids, mask, labels, fast=False)
            _, other_grads = step(model, ids, mask, labels, label_smoothing=0.4)
        torch.testing.assert_close(fast_loss, exact_loss, rtol=1e-2, atol=1e-2)
        assert fast_grads.keys() == exact.keys() and len(exact) > 20
        names = [name for name in exact if not name.endswith("k_proj.bias")]  # exactly 0: softmax ignores q . b_K

        def error(grads, names=names, exact=exact):
            return max(_relative_error(grads[name], exact[name]) for name in names)

        fast_errors.append(error(fast_grads))
        plain_errors.append(error(plain_grads))
        # control: label smoothing 0.4 moves the gradients by 30 % and more (the untrained loss hardly: NLL ~ ln V)
        assert fast_errors[-1] < 0.2 and error(other_grads) > 0.3
    assert sum(fast_errors) <= 1.25 * sum(plain_errors), (fast_errors, plain_errors)


def test_a_training_step_with_a_label_outside_the_vocabulary_is_refused_before_the_fused_loss():
    model = tiny_model().train()
    ids, mask = padded_batch(length=9)
    labels = ids.masked_fill(mask.eq(0), -100)
    labels[0, -1] = 99  # the last column never becomes a decoder input; rows 1 and 2 are padded: unpadding applies
    with training_fast_paths(model), pytest.raises(ValueError, match="labels hold token id 99, outside this model's "
                                                                     "target vocabulary of 99"):
        model(input_ids=ids, attention_mask=mask, labels=labels)


# The training forward: unpadded tokens, label smoothing, the fused loss ----------------------------------------------


def batch(seed: int = 0):
    """Four right-padded sources of length 9 (rows 1 and 2 padded by 4 and 2); labels of length 7 with -100 at the
    end of rows 0 and 2 and a -100 inside row 3 (a position without loss followed by labelled ones)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 99, (4, 9), generator=generator)
    mask = torch.ones(4, 9, dtype=torch.long)
    mask[1, 5:] = 0
    mask[2, 7:] = 0
    ids[mask == 0] = 0
    labels = torch.randint(4, 99, (4, 7), generator=generator)
    labels[0, 4:] = -100
    labels[2, 6:] = -100
    labels[3, 2] = -100
    return ids, mask, labels


def copy_task_batch(left_padded: bool = False):
    """`batch()`'s layout on the copy task (vocabulary 24), for a model trained on it: four sources of 9 positions,
    rows 1 and 2 padded by 4 and 2 (row 2 on the left with `left_padded`); labels the source's words and </s>, with a
    -100 inside row 3."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.zeros(4, 9, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for row, length in enumerate((9, 5, 7, 9)):
        sentence = torch.cat([torch.randint(4, 24, (length - 1,), generator=generator), torch.tensor([2])])
        start = 2 if row == 2 and left_padded else 0
        ids[row, start: start + length], mask[row, start: start + length] = sentence, 1
        labels[row, :length] = sentence
    labels[3, 2] = -100
    return ids, mask, labels


def broken_unpadding(monkeypatch, bug: str) -> None:
    """Controls: unpadding with a bug. "misplaced": source row 1's tokens at positions 4.. (as if left-padded);
    "dropped": source row 0's first token left out."""
    real = fast_paths_vaswani.unpad_batch

    def unpad(inputs, labels):
        result = real(inputs, labels)
        if result is None:
            return None
        packed, target = result
        packed, cu = dict(packed), packed["cu_seq_lens_source"]
        if bug == "misplaced":
            packed["position_ids"] = packed["position_ids"].clone()
            packed["position_ids"][0, cu[1]:cu[2]] += 4
        else:
            keep = torch.ones(packed["input_ids"].shape[1], dtype=torch.bool)
            keep[0] = False
            packed["input_ids"], packed["position_ids"] = packed["input_ids"][:, keep], packed["position_ids"][:, keep]
            packed["cu_seq_lens_source"] = torch.cat([cu[:1], cu[1:] - 1])
        return packed, target

    monkeypatch.setattr(fast_paths_vaswani, "unpad_batch", unpad)


def step(model, ids, mask, labels, fast: bool = True, label_smoothing: float = 0.1, **kwargs):
    """One forward and backward in training mode: with `training_fast_paths` (`fast`), or the plain padded step
    with the loss label-smoothed from its logits; returns the loss and the gradients."""
    model.zero_grad(set_to_none=True)
    with training_fast_paths(model, label_smoothing) if fast else contextlib.nullcontext():
        out = model.train()(input_ids=ids, attention_mask=mask, labels=labels, **kwargs)
        loss = out.loss if fast else cross_entropy_loss(out.logits, labels, label_smoothing=label_smoothing)
        loss.backward()  # inside: gradient checkpointing recomputes the forward as it ran
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("normalize_before", [False, True])
def test_the_fast_training_step_equals_the_plain_padded_step(normalize_before, monkeypatch):
    model = tiny_model(dropout=0.0, normalize_before=normalize_before)
    ids, mask, labels = batch()
    fast_loss, fast_grads = step(model, ids, mask, labels)
    plain_loss, plain_grads = step(model, ids, mask, labels, fast=False)
    torch.testing.assert_close(fast_loss, plain_loss, rtol=1e-6, atol=1e-6)
    assert fast_grads.keys() == plain_grads.keys() and len(plain_grads) > 20
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fast_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # Controls: unpadding that misplaces or drops a source token misses each tolerance above by orders of magnitude.
    for bug in ("misplaced", "dropped"):
        broken_unpadding(monkeypatch, bug)
        broken_loss, broken_grads = step(model, ids, mask, labels)
        monkeypatch.undo()
        assert abs(float(broken_loss - plain_loss)) > 1e-3, bug
        assert max((broken_grads[name] - grad).abs().max() for name, grad in plain_grads.items()) > 1e-2, bug


def test_the_fast_training_step_really_runs_on_the_unpadded_tokens():
    """The FFN sees N rows (the tokens), not B * L: 30 source and 24 target positions here, of 36 and 28; the loss is
    the fused one (no logits)."""
    model = tiny_model(dropout=0.0)
    ids, mask, labels = batch()
    rows = []

    def count_rows(module, args, out):
        rows.append(args[0].numel() // args[0].shape[-1])

    handles = [layer.fc1.register_forward_hook(count_rows)
               for layer in (model.model.encoder.layers[0], model.model.decoder.layers[0])]
    with training_fast_paths(model):
        out = model.train()(input_ids=ids, attention_mask=mask, labels=labels)
    step(model, ids, mask, labels, fast=False)
    for handle in handles:
        handle.remove()
    needed = labels.ne(-100).flip(1).cumsum(1).flip(1) > 0  # each row up to its last label
    assert rows == [int(mask.sum()), int(needed.sum()), 4 * 9, 4 * 7]
    assert rows[:2] == [30, 24] and out.logits is None


def test_unpad_batch_packs_the_tokens_with_their_positions_and_lengths():
    ids, mask, labels = batch()
    decoder_ids = torch.arange(28).view(4, 7)
    packed, target = unpad_batch(dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids), labels)
    assert torch.equal(packed["input_ids"][0], ids[mask.bool()])
    assert packed["position_ids"][0].tolist() == [*range(9), *range(5), *range(7), *range(9)]
    assert packed["cu_seq_lens_source"].tolist() == [0, 9, 14, 21, 30] and packed["max_length_source"] == 9
    assert packed["cu_seq_lens_target"].tolist() == [0, 4, 11, 17, 24] and packed["max_length_target"] == 7
    assert packed["decoder_input_ids"][0].tolist() == [*range(4), *range(7, 14), *range(14, 20), *range(21, 28)]
    assert target[0, 11:17].tolist() == labels[2, :6].tolist() and target[0, 19].item() == -100  # the gap kept
    # the padded layout stays where unpadding would change a result or gain nothing
    left = mask.flip(1)
    assert unpad_batch(dict(input_ids=ids, attention_mask=left, decoder_input_ids=decoder_ids), labels) is None
    empty = mask.clone()
    empty[1] = 0
    assert unpad_batch(dict(input_ids=ids, attention_mask=empty, decoder_input_ids=decoder_ids), labels) is None
    full = torch.ones_like(mask)
    assert unpad_batch(dict(input_ids=ids, attention_mask=full, decoder_input_ids=decoder_ids),
                       labels.clamp(min=4)) is None
    assert unpad_batch(dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids,
                            decoder_attention_mask=mask), labels) is None


def test_the_padded_layout_where_unpadding_would_change_a_result_or_gain_nothing(monkeypatch):
    model = tiny_model(dropout=0.0)
    ids, mask, labels = batch()
    calls = []
    real = fast_paths_vaswani.unpad_batch
    monkeypatch.setattr(fast_paths_vaswani, "unpad_batch", lambda *args: calls.append(real(*args)) or calls[-1])
    for source_mask, targets in ((mask.flip(1), labels), (torch.ones_like(mask), labels.clamp(min=4))):
        fast_loss, fast_grads = step(model, ids, source_mask, targets)  # left-padded; no padding at all
        plain_loss, plain_grads = step(model, ids, source_mask, targets, fast=False)
        torch.testing.assert_close(fast_loss, plain_loss, rtol=1e-6, atol=1e-6)
        for name, grad in plain_grads.items():
            torch.testing.assert_close(fast_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert len(calls) == 2 and calls == [None, None]
    # eval mode, attention probabilities, hidden states: the model's own forward, its loss label-smoothed in training
    with training_fast_paths(model, 0.1):
        evaluated = model.eval()(input_ids=ids, attention_mask=mask, labels=labels)
        with_attentions = model.train()(input_ids=ids, attention_mask=mask, labels=labels, output_attentions=True)
    assert len(calls) == 2 and evaluated.logits.shape == (4, 7, 99) and len(with_attentions.cross_attentions) == 2
    torch.testing.assert_close(evaluated.loss, cross_entropy_loss(evaluated.logits, labels))
    torch.testing.assert_close(with_attentions.loss, cross_entropy_loss(with_attentions.logits, labels,
                                                                        label_smoothing=0.1))


def test_the_fast_training_step_under_gradient_checkpointing_and_bf16(monkeypatch):
    model = tiny_model(dropout=0.0)
    ids, mask, labels = batch(1)
    _, reference = step(model, ids, mask, labels, fast=False)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()  # 5.17
    _, grads = step(model, ids, mask, labels)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # control: a misplaced source row moves some gradient by 1e-1, four orders above the tolerance
    broken_unpadding(monkeypatch, "misplaced")
    _, broken = step(model, ids, mask, labels)
    assert max((broken[name] - grad).abs().max() for name, grad in reference.items()) > 1e-2
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()


def test_the_fast_training_step_in_bf16_on_a_trained_model(monkeypatch):
    # A copy model, whose loss depends on where each source token is (an untrained model's loss is about ln V
    # whatever the unpadding does), under bf16 autocast.
    model = trained_copy_model(steps=200)
    ids, mask, labels = copy_task_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast, _ = step(model, ids, mask, labels, label_smoothing=0.0)
        plain, _ = step(model, ids, mask, labels, fast=False, label_smoothing=0.0)
        broken = {}
        for bug in ("misplaced", "dropped"):
            broken_unpadding(monkeypatch, bug)
            broken[bug] = step(model, ids, mask, labels, label_smoothing=0.0)[0]
            monkeypatch.undo()
    assert fast.dtype == torch.float32 and 0.1 < plain.item() < 3.5  # ln 24 = 3.18 untrained
    torch.testing.assert_close(fast, plain, rtol=2e-2, atol=2e-2)  # bf16's resolution
    # controls: a misplaced row and a dropped token move the loss by tenths: ten times the tolerance and more
    for bug, loss in broken.items():
        assert abs(float(loss - plain)) > 0.1, bug


def test_dropout_still_trains_and_differs_between_steps():
    model = tiny_model(dropout=0.1)
    ids, mask, labels = batch()
    first, grads = step(model, ids, mask, labels)
    second, _ = step(model, ids, mask, labels)
    assert torch.isfinite(first) and first != second
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_a_hooked_or_adapted_output_projection_keeps_its_own_forward():
    """The fused loss multiplies by lm_head.weight itself; a hook on lm_head (as an adapter would change its output)
    must still shape the loss, so that step takes lm_head's forward."""
    model = tiny_model(dropout=0.0)
    ids, mask, labels = batch()
    plain, _ = step(model, ids, mask, labels)
    handle = model.lm_head.register_forward_hook(lambda module, args, out: out * 0.5)
    hooked, _ = step(model, ids, mask, labels)
    handle.remove()
    with torch.no_grad():
        half = model.train()(input_ids=ids, attention_mask=mask, labels=labels).logits * 0.5
    torch.testing.assert_close(hooked, cross_entropy_loss(half, labels, label_smoothing=0.1), rtol=1e-6, atol=1e-6)
    assert abs(float(hooked) - float(plain)) > 0.01


# Installed where promised, and plain everywhere else -----------------------------------------------------------------


def test_a_model_built_loaded_or_decoded_is_made_of_plain_modules(tmp_path):
    """What a user builds or loads: nn.Linear, nn.Dropout, nn.LayerNorm, nn.Embedding (torch's dynamic quantization,
    which matches exact types, finds every linear); the same after generate() and after a training run's context."""
    model = tiny_model()
    assert module_types(model) == PLAIN_TYPES and "forward" not in vars(model)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path)
    assert module_types(loaded) == PLAIN_TYPES
    ids, mask = padded_batch(length=9)
    loaded.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4)
    with training_fast_paths(loaded):
        assert "forward" in vars(loaded) and {"CPUDropout", "OneDNNLinear"} <= module_types(loaded)
    assert module_types(loaded) == PLAIN_TYPES and "forward" not in vars(loaded)
    assert loaded.config._attn_implementation == "sdpa"
    quantized = torch.ao.quantization.quantize_dynamic(copy.deepcopy(loaded), {nn.Linear}, dtype=torch.qint8)
    assert not any(type(m) is nn.Linear for m in quantized.modules())


def test_the_training_commands_trainer_runs_its_steps_with_every_cpu_fast_path(tmp_path, monkeypatch):
    """A fast path that silently stopped being applied would only show as a slower run: PaperTrainer's steps on a
    CPU run the training forward on unpadded tokens with the fused, label-smoothed loss, CPU dropout, oneDNN linears
    where chosen, and "vaswani_sdpa"; afterwards the model is plain again."""
    from transformers import Seq2SeqTrainingArguments

    from vaswani_training.train import PaperTrainer

    monkeypatch.setattr(kernels_vaswani, "cpu_training_matmul", lambda: "onednn")
    seen, fused, unpadded = [], [], []
    real_fused, real_unpad = fast_paths_vaswani.cpu_projected_cross_entropy, fast_paths_vaswani.unpad_batch
    monkeypatch.setattr(fast_paths_vaswani, "cpu_projected_cross_entropy",
                        lambda *args: fused.append(args[3]) or real_fused(*args))
    monkeypatch.setattr(fast_paths_vaswani, "unpad_batch", lambda *args: unpadded.append(1) or real_unpad(*args))
    model = tiny_model()
    model.model.encoder.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((module_types(model), model.config._attn_implementation,
                                                  kwargs["input_ids"].shape[0])), with_kwargs=True)
    ids, mask, labels = batch()
    examples = [dict(input_ids=ids[i], attention_mask=mask[i], labels=labels[i]) for i in range(4)]
    args = Seq2SeqTrainingArguments(str(tmp_path), max_steps=2, per_device_train_batch_size=4, use_cpu=True,
                                    report_to=[], save_strategy="no", label_smoothing_factor=0.1)
    trainer = PaperTrainer(model=model, args=args, train_dataset=examples, max_tokens=64, d_model=32, warmup=4,
                           lr_factor=1.0, data_collator=lambda rows: {k: torch.stack([r[k] for r in rows])
                                                                      for k in rows[0]})
    monkeypatch.setattr(PaperTrainer, "get_train_dataloader",
                        lambda self: torch.utils.data.DataLoader(examples, batch_size=4,
                                                                 collate_fn=self.data_collator))
    trainer.train()
    assert len(seen) == 2 and len(fused) == 2 and len(unpadded) == 2
    for types, attention, rows in seen:
        assert {"CPUDropout", "OneDNNLinear"} <= types and "Dropout" not in types and "Linear" not in types
        assert attention == "vaswani_sdpa" and rows == 1  # the batch's tokens in one row
    assert fused == [0.1, 0.1]  # the label-smoothed loss of §5.4
    assert module_types(model) == PLAIN_TYPES and "forward" not in vars(model)


def test_onednn_products_of_an_empty_batch_are_empty_or_zero():
    # A batch without labelled tokens reaches the oneDNN products with zero rows; oneDNN itself refuses a zero size,
    # so these return before calling it (and run on any torch build).
    assert _onednn_linear(torch.randn(0, 32), torch.randn(99, 32)).shape == (0, 99)
    grad_weight = _onednn_grad_weight(torch.randn(0, 32), torch.randn(0, 99))
    assert grad_weight.shape == (99, 32) and grad_weight.abs().sum().item() == 0.0
    assert torch.equal(_onednn_linear(torch.randn(5, 0), torch.randn(7, 0), torch.full((7,), 2.0)),
                       torch.full((5, 7), 2.0))
