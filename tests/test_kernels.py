"""The CPU kernels (`kernels_vaswani.py`) compute what the plain paths compute.

- `apply_dropout` on a CPU (`CPUDropout`, a cheaper random mask) has dropout's distribution, scale and gradient, and
  `residual_dropout` (`CPUDropoutAdd`) is the residual plus that;
- "sdpa" attention on a CPU in bf16, and in fp32 training steps, runs `cpu_attention_forward` (fp32 scores; torch's
  CPU flash kernel is slow in bf16 and in its fp32 backward);
- oneDNN-packed linears (`packed_cpu_linears`) give `nn.Linear`'s outputs in `generate()`, are packed once while the
  weights stay unchanged, and fall back to `nn.Linear` where packing fails;
- fp32 CPU training linears in oneDNN (where `cpu_training_matmul` finds it much faster than BLAS) give
  `nn.Linear`'s outputs and gradients, only in fp32 training steps;
- the fused output projection and loss of a CPU training step (`cpu_projected_cross_entropy`) is the cross-entropy of
  the projection;
- CPU training on the real tokens of a padded batch (`RealTokens`: the source positions the attention mask keeps,
  each target row's positions up to its last label, the projection and loss at the labelled positions) gives the
  padded layout's loss, gradients and labelled logits (`RealTokens.enabled = False`) to float rounding, in post-LN and
  pre-LN, with left- and right-padded sources and gaps in the labels, under gradient checkpointing and under bf16
  autocast (on a model trained on the copy task, whose loss depends on where each token is); batches where it would
  change a result (a source row that is all padding) or gain nothing (no padding), and calls that need every position
  (eval, attention probabilities, hidden states), keep the padded layout.

Each tolerance has a control beside it: the bug it guards against (masks or scaling lost, bf16 rounding inside an fp32
path, a wrong divisor, correlated dropout draws, a packed row misplaced or a token dropped) computed and shown to miss
it by orders of magnitude. Every test here depends on the kernels the CPU's instruction set picks: conftest marks them
`isa`.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import padded_batch, sentences_differing_from_greedy, tiny_model, trained_copy_model

from vaswani_hf import kernels_vaswani
from vaswani_hf.kernels_vaswani import RealTokens, VaswaniLinear
from vaswani_hf.modeling_vaswani import apply_dropout, residual_dropout


def bf16_rounded_linears(model):
    """Control: a copy of `model` with every linear weight rounded to bf16, what a fast fp32 path that multiplied in
    bf16 (oneDNN's bf16 fpmath mode, say) would compute."""
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for module in rounded.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(module.weight.bfloat16().float())
    return rounded


def test_cpu_dropout_keeps_one_minus_p_and_scales_the_kept_elements():
    torch.manual_seed(0)
    x = torch.rand(1001, 999) + 0.5  # no zeros, odd element count
    for p in (0.1, 0.3):
        out = apply_dropout(x, p, training=True)
        kept = out.ne(0)
        # 1M Bernoulli(1 - p) draws: standard deviation of the kept fraction < 5e-4 (a rate off by 0.005 exceeds it)
        assert abs(kept.float().mean().item() - (1 - p)) < 2.5e-3
        torch.testing.assert_close(out[kept], x[kept] / (1 - p), rtol=1e-6, atol=0)
    # independent draws: the four elements one 64-bit draw decides (its 16-bit quarters) are not correlated
    keep = apply_dropout(x, 0.5, training=True).ne(0).flatten().float()
    quarters = keep[: keep.numel() // 4 * 4].view(-1, 4)
    for i in range(4):
        for j in range(i + 1, 4):
            assert abs((quarters[:, i] * quarters[:, j]).mean().item() - 0.25) < 3e-3
    assert abs(quarters.prod(1).mean().item() - 0.0625) < 2e-3
    # control: quarters decided by one shared bit would give 0.5 and 0.5, a hundred times the tolerances
    shared = (torch.rand(quarters.shape[0]) < 0.5).float()[:, None].expand(-1, 4)
    assert abs((shared[:, 0] * shared[:, 1]).mean().item() - 0.25) > 0.2
    assert abs(shared.prod(1).mean().item() - 0.0625) > 0.2


def test_cpu_dropout_gradient_is_the_mask_times_the_scale():
    torch.manual_seed(1)
    x = (torch.rand(64, 33) + 0.5).requires_grad_()
    out = apply_dropout(x, 0.1, training=True)
    weights = torch.randn(64, 33)
    (out * weights).sum().backward()
    expected = out.detach().ne(0).float() * weights / 0.9
    torch.testing.assert_close(x.grad, expected, rtol=1e-6, atol=1e-7)


def test_residual_dropout_on_a_cpu_is_the_residual_plus_the_dropped_out_sublayer():
    torch.manual_seed(4)
    residual = torch.randn(301, 65, requires_grad=True)
    x = (torch.rand(301, 65) + 0.5).requires_grad_()
    out = residual_dropout(residual, x, 0.1, training=True)
    kept = (out - residual).detach().abs().gt(1e-6)  # x > 0.5 everywhere: a kept element moves the sum
    assert abs(kept.float().mean().item() - 0.9) < 1e-2
    torch.testing.assert_close(out, residual + torch.where(kept, x / 0.9, 0.0), rtol=1e-6, atol=1e-6)
    weights = torch.randn(301, 65)
    (out * weights).sum().backward()
    torch.testing.assert_close(residual.grad, weights)
    torch.testing.assert_close(x.grad, torch.where(kept, weights / 0.9, 0.0), rtol=1e-6, atol=1e-7)
    # the same random numbers as residual + apply_dropout: one mask per call, drawn the same way
    torch.manual_seed(5)
    fused = residual_dropout(residual.detach(), x.detach(), 0.3, training=True)
    torch.manual_seed(5)
    torch.testing.assert_close(fused, residual.detach() + apply_dropout(x.detach(), 0.3, training=True))
    # a bf16 sublayer output (autocast) on an fp32 residual: the sum is fp32, as residual + dropout(x) would be
    assert residual_dropout(residual.detach(), x.detach().bfloat16(), 0.1, training=True).dtype == torch.float32
    assert torch.equal(residual_dropout(residual, x, 0.1, training=False), residual + x)
    assert torch.equal(residual_dropout(residual, x, 1.0, training=True), residual)  # F.dropout's answer for p = 1
    with pytest.raises(RuntimeError):  # shapes that do not add up fail as residual + x does, not silently
        residual_dropout(residual, x[:, :64], 0.1, training=True)


def test_cpu_dropout_is_seeded_identity_in_eval_and_keeps_the_dtype():
    x = torch.rand(8, 16) + 0.5
    torch.manual_seed(3)
    first = apply_dropout(x, 0.1, training=True)
    torch.manual_seed(3)
    assert torch.equal(apply_dropout(x, 0.1, training=True), first)
    assert apply_dropout(x, 0.1, training=False) is x and apply_dropout(x, 0.0, training=True) is x
    assert apply_dropout(x.bfloat16(), 0.1, training=True).dtype == torch.bfloat16
    assert apply_dropout(x, 1.0, training=True).eq(0).all()  # F.dropout's answer for p = 1
    assert apply_dropout(torch.empty(0, 4), 0.1, training=True).shape == (0, 4)


def record_cpu_attention(monkeypatch) -> tuple[list, object]:
    """Record the query dtype of every `cpu_attention_forward` call; returns the record and the real function."""
    from vaswani_hf import modeling_vaswani

    calls = []
    real = modeling_vaswani.cpu_attention_forward
    monkeypatch.setattr(modeling_vaswani, "cpu_attention_forward",
                        lambda module, query, *args, **kwargs: calls.append(query.dtype) or real(module, query, *args,
                                                                                                  **kwargs))
    return calls, real


def labelled_batch():
    ids, mask = padded_batch(length=9)
    return ids, mask, ids.masked_fill(mask.eq(0), -100)


def test_sdpa_in_bf16_on_cpu_computes_the_scores_in_fp32(monkeypatch):
    from vaswani_hf import modeling_vaswani

    calls, half = record_cpu_attention(monkeypatch)
    # a copy model: its loss depends on what attention reads (an untrained model's is about ln V whatever it reads)
    model = trained_copy_model(steps=100, attn_implementation="sdpa")
    ids, mask, labels = copy_task_batch()
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, labels=labels)
        assert not calls  # fp32: torch's SDPA
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = model(input_ids=ids, attention_mask=mask, labels=labels)
            broken, recording = {}, modeling_vaswani.cpu_attention_forward  # controls: mask, 1 / sqrt(d_k) dropped
            for bug, change in (("mask", dict(attention_mask=None)), ("scaling", dict(scaling=1.0))):
                monkeypatch.setattr(modeling_vaswani, "cpu_attention_forward",
                                    lambda module, query, key, value, attention_mask, change=change, **kwargs:
                                    half(module, query, key, value, **{"attention_mask": attention_mask, **kwargs,
                                                                       **change}))
                broken[bug] = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            monkeypatch.setattr(modeling_vaswani, "cpu_attention_forward", recording)
        bf16 = copy.deepcopy(model).to(torch.bfloat16)(input_ids=ids, attention_mask=mask, labels=labels)
    assert calls == [torch.bfloat16] * 2 * 6  # 2 encoder + 2x2 decoder attentions, in each bf16 forward
    assert bf16.logits.dtype == torch.bfloat16 and 0.5 < reference.loss < 3.0  # ln 24 = 3.18 untrained: 1.16 here
    for half_precision in (autocast, bf16):
        torch.testing.assert_close(half_precision.loss.float(), reference.loss, rtol=0.02, atol=0.02)  # 6e-4 here
    # the controls move the loss by 3.3 and 0.8: 100 and 25 times the tolerance
    for bug, loss in broken.items():
        assert abs(float(loss) - float(reference.loss)) > 0.3, bug
    # the scores are fp32: the same as an fp32 softmax of the bf16 inputs' scores, not of bf16-rounded scores
    generator = torch.Generator().manual_seed(6)
    query, key, value = (torch.randn(2, 2, 5, 8, generator=generator).mul(8).bfloat16() for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = half(model.model.encoder.layers[0].self_attn, query, key, value, None, scaling=8**-0.5)
    probs = torch.softmax(query.float() @ key.float().transpose(2, 3) * 8**-0.5, dim=-1)
    expected = (probs.bfloat16().float() @ value.float()).transpose(1, 2)
    # two bf16 steps of the bf16 output (at most 0.4 of the tolerance here); bf16-rounded scores exceed it 21 times
    tolerance = dict(rtol=8e-3, atol=1e-3)
    torch.testing.assert_close(out.float(), expected, **tolerance)
    rounded_scores = torch.softmax((query @ key.transpose(2, 3) * 8**-0.5).float(), dim=-1)
    control = (rounded_scores.bfloat16().float() @ value.float()).transpose(1, 2)
    excess = (control - expected).abs() / (tolerance["atol"] + tolerance["rtol"] * expected.abs())
    assert excess.max() > 5


def test_sdpa_in_fp32_training_on_cpu_keeps_torchs_kernel_unless_attention_dropout(monkeypatch):
    calls, _ = record_cpu_attention(monkeypatch)
    sdpa_calls = []
    real_sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *args, **kwargs: sdpa_calls.append(1) or real_sdpa(*args, **kwargs))
    ids, mask, labels = labelled_batch()
    model = tiny_model(attn_implementation="sdpa", dropout=0.0).train()
    results = {}
    for kernel in ("sdpa", "eager"):  # eager: the reference of Eq. 1, written out
        model.config._attn_implementation = kernel
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        results[kernel] = loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert calls == [] and len(sdpa_calls) == 6  # 2 encoder + 2x2 decoder attentions, in the sdpa step only
    torch.testing.assert_close(results["sdpa"][0], results["eager"][0], rtol=1e-6, atol=1e-6)
    for got, expected in zip(results["sdpa"][1], results["eager"][1], strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # control: self-attention scaled by 2 / sqrt(d_k) moves the loss by 7e-3 and some gradient by 7e-2, thousands of
    # times the tolerances
    model.config._attn_implementation = "eager"
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
    # attention dropout (not the paper's): the plain kernel, which draws the cheaper dropout mask
    model.config._attn_implementation = "sdpa"
    for layer in (*model.model.encoder.layers, *model.model.decoder.layers):
        for attention in (layer.self_attn, getattr(layer, "encoder_attn", None)):
            if attention is not None:
                attention.dropout = 0.1
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    assert calls == [torch.float32] * 6 and len(sdpa_calls) == 6 and torch.isfinite(loss)


needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(),
    reason="this torch has no oneDNN: the packed CPU path does not exist and generate() runs nn.Linear, which "
           "test_generation.py covers")


@needs_onednn
def test_packed_linears_compute_what_nn_linear_computes(monkeypatch):
    calls = []
    onednn_linear = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: calls.append(1) or onednn_linear(*args))
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    decoder_ids = torch.randint(3, 99, (3, 5), generator=torch.Generator().manual_seed(4))
    state_size = len(model.state_dict())
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        with model.cpu_packed_linears() as packed:
            assert packed and model.lm_head.packed_weight is not None
            attention = model.model.encoder.layers[0].self_attn
            assert attention.fused_inputs.packed_weight is not None  # q|k|v stacked, one matrix
            assert attention.fused_inputs.weight.shape == (96, 32)
            assert "fused_inputs" not in dict(model.named_modules()) and len(model.state_dict()) == state_size
            fast = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
            with model.cpu_packed_linears() as nested:
                assert not nested  # the outer packing stays
            assert model.lm_head.packed_weight is not None
    assert model.lm_head.packed_weight is None  # dropped on exit
    assert all("fused_inputs" not in vars(module) for module in model.modules())  # dropped on exit
    # oneDNN ran every linear map once: 2 encoder layers x 4 (q|k|v stacked, out, fc1, fc2), 2 decoder layers x 7
    # (q|k|v, out, cross-attention q, k|v and out, fc1, fc2), and lm_head; and it gave what nn.Linear gives
    assert len(calls) == 2 * 4 + 2 * 7 + 1
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
    # control: linears multiplied in bf16 move the logits by 1.4e-2, a thousand times the tolerance
    with torch.no_grad():
        rounded = bf16_rounded_linears(model)(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    assert (rounded - plain).abs().max() > 1e-3


@needs_onednn
def test_packed_linears_leave_training_bf16_and_opt_out_alone():
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    labels = ids.masked_fill(mask.eq(0), -100)
    with model.cpu_packed_linears() as packed:
        assert packed
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss  # autograd on: nn.Linear's path
        loss.backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    with torch.autocast("cpu", dtype=torch.bfloat16), model.cpu_packed_linears() as packed:
        assert not packed
    with model.to(torch.bfloat16).cpu_packed_linears() as packed:
        assert not packed
    model = tiny_model()
    model.use_cpu_packed_linears = False
    with model.cpu_packed_linears() as packed:
        assert not packed and model.lm_head.packed_weight is None


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
        if kwargs["num_beams"] > 1:
            assert sentences_differing_from_greedy(plain, slow.sequences, kwargs, input_ids=ids, attention_mask=mask,
                                                   max_new_tokens=8) >= 1
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
        raise RuntimeError("this oneDNN cannot pack")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    with model.cpu_packed_linears() as packed:
        assert not packed and model.lm_head.packed_weight is None
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6), expected)


@needs_onednn
def test_generate_packs_once_while_the_weights_are_unchanged(monkeypatch):
    packs = []
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda *args: packs.append(1) or reorder(*args))
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    first = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6)
    per_packing = len(packs)
    assert per_packing == 2 * 4 + 2 * 7 + 1  # every linear map, the stacked input projections once each
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6), first)
    assert len(packs) == per_packing  # the second call reused the packed weights
    assert model.lm_head.packed_weight is None  # outside generate() nothing is packed
    with torch.no_grad():
        model.model.decoder.layers[1].self_attn.v_proj.bias.add_(1.0)  # inside a stacked q|k|v matrix
    changed = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, output_scores=True,
                             return_dict_in_generate=True)
    assert len(packs) == 2 * per_packing  # packed again
    reference = tiny_model()
    reference.use_cpu_packed_linears = False
    with torch.no_grad():
        reference.model.decoder.layers[1].self_attn.v_proj.bias.add_(1.0)
    expected = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, output_scores=True,
                                  return_dict_in_generate=True)
    assert torch.equal(changed.sequences, expected.sequences)
    model.keep_packed_cpu_linears = False
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6)
    assert len(packs) == 4 * per_packing  # without keeping, every call packs


@needs_onednn
@pytest.mark.parametrize("update", ["fused_adam_in_eval_mode", "fused_adam_as_trainer_does"])
def test_weights_packed_by_one_generate_are_not_reused_after_the_weights_change(update):
    """Packed weights kept between generate() calls must follow every change of the weights, including torch's fused
    Adam, which writes parameters without advancing their version counter (an evaluation during training would
    otherwise decode with the weights of the previous evaluation)."""
    import copy

    model = tiny_model(dropout=0.0).eval()
    ids, mask = padded_batch(length=9)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6)  # packs and keeps
    assert model.__dict__.get("_packed_cpu_linears") is not None
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05, fused=True)
    labels, _ = padded_batch(seed=3, length=7)
    if update == "fused_adam_as_trainer_does":
        model.train()  # Trainer: train mode for the steps, eval mode for the evaluation's generate()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    optimizer.step()  # the version counters stay where they were
    model.eval()
    fresh = copy.deepcopy(model)  # the kept packing is not copied
    assert "_packed_cpu_linears" not in fresh.__dict__
    fresh.keep_packed_cpu_linears = False
    expected = fresh.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, output_scores=True,
                              return_dict_in_generate=True)
    got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, output_scores=True,
                         return_dict_in_generate=True)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(expected.scores))


# fp32 CPU training linears in oneDNN (`kernels_vaswani.trains_with_onednn`, `cpu_training_matmul`)


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
    onednn_linear = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: calls.append(1) or onednn_linear(*args))
    torch.manual_seed(0)
    fast = VaswaniLinear(in_features, out_features, bias=bias)
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
    onednn_linear = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *args: calls.append(1) or onednn_linear(*args))
    linear = VaswaniLinear(8, 16)
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
    model = tiny_model()
    linear = model.model.encoder.layers[0].fc1
    model.train()
    assert kernels_vaswani.trains_with_onednn(linear, torch.randn(2, 32))
    with torch.no_grad():
        assert not kernels_vaswani.trains_with_onednn(linear, torch.randn(2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not kernels_vaswani.trains_with_onednn(linear, torch.randn(2, 32))
    assert not kernels_vaswani.trains_with_onednn(linear, torch.randn(2, 32, dtype=torch.float64))
    model.eval()
    assert not kernels_vaswani.trains_with_onednn(linear, torch.randn(2, 32))
    model.train()
    monkeypatch.setattr(kernels_vaswani, "cpu_training_matmul", lambda: "blas")
    assert not kernels_vaswani.trains_with_onednn(linear, torch.randn(2, 32))


@needs_onednn
def test_a_training_step_in_onednn_equals_the_blas_step(monkeypatch):
    results = {}
    for library in ("blas", "onednn"):
        monkeypatch.setattr(kernels_vaswani, "cpu_training_matmul", lambda library=library: library)
        calls = []
        onednn_linear = torch.ops.mkldnn._linear_pointwise
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                            lambda *args, calls=calls, onednn_linear=onednn_linear: calls.append(1)
                            or onednn_linear(*args))
        model = tiny_model(dropout=0.0).train()
        ids, mask = padded_batch(length=9)
        labels = torch.randint(4, 99, (3, 6), generator=torch.Generator().manual_seed(1))
        labels[2, 4:] = -100
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
    expected = F.cross_entropy(hidden @ weight.t(), labels, reduction="sum", label_smoothing=label_smoothing) / 41
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    loss = kernels_vaswani.cpu_projected_cross_entropy(hidden, weight, labels, label_smoothing, divisor)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    # control: this call's 37 rows as the divisor move the loss by 11 % of itself, 10^4 times the tolerance
    assert abs(float(loss.detach()) * 41 / 37 - float(expected.detach())) > 1e-2
    grads = torch.autograd.grad(loss * 3, (hidden, weight), retain_graph=True)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want * 3, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="cannot run backward again.*skip_logits=False"):
        torch.autograd.grad(loss, (hidden, weight))  # its buffer now holds the softmax: refused, not wrong


def test_projected_cross_entropy_declines_where_it_does_not_apply():
    hidden, weight, labels = torch.randn(5, 4), torch.randn(7, 4), torch.tensor([0, 1, 2, 3, 6])
    project = kernels_vaswani.cpu_projected_cross_entropy
    assert project(hidden.bfloat16(), weight.bfloat16(), labels) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert project(hidden, weight, labels) is None
    assert project(hidden[None], weight, labels) is None
    assert project(hidden, weight, labels) is not None


def test_a_training_step_with_a_label_outside_the_vocabulary_is_refused_before_the_fused_loss():
    model = tiny_model().train()
    ids, mask = padded_batch(length=9)
    labels = ids.masked_fill(mask.eq(0), -100)
    labels[0, -1] = 99  # the last column never becomes a decoder input; rows 1 and 2 are padded: packing applies
    with pytest.raises(ValueError, match="labels hold token id 99, outside this model's target vocabulary of 99"):
        model(input_ids=ids, attention_mask=mask, labels=labels)


# Training on the real tokens of a padded batch (`RealTokens`) ---------------------------------------------------------


ORIGINAL_INIT = RealTokens.__init__


def batch(seed: int = 0):
    """Four sources of length 9: row 1 right-padded by 4, row 2 left-padded by 2; labels of length 7 with -100 at the
    end of rows 0 and 2 and a -100 inside row 3 (a position without loss followed by labelled ones)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 99, (4, 9), generator=generator)
    mask = torch.ones(4, 9, dtype=torch.long)
    mask[1, 5:] = 0
    mask[2, :2] = 0
    ids[mask == 0] = 0
    labels = torch.randint(4, 99, (4, 7), generator=generator)
    labels[0, 4:] = -100
    labels[2, 6:] = -100
    labels[3, 2] = -100
    return ids, mask, labels


def copy_task_batch():
    """`batch()`'s layout on the copy task (vocabulary 24), for a model trained on it: four sources of 9 positions,
    row 1 right-padded by 4, row 2 left-padded by 2; labels the source's words and </s>, with a -100 inside row 3."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.zeros(4, 9, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for row, length in enumerate((9, 5, 7, 9)):
        sentence = torch.cat([torch.randint(4, 24, (length - 1,), generator=generator), torch.tensor([2])])
        start = 2 if row == 2 else 0
        ids[row, start: start + length], mask[row, start: start + length] = sentence, 1
        labels[row, :length] = sentence
    labels[3, 2] = -100
    return ids, mask, labels


def broken_packing(monkeypatch, mask, bug: str) -> None:
    """Controls: packing of the source's real tokens with a bug. "misplaced": right-padded row 1 read as left-padded
    (its first four tokens left out, four padding positions taken in); "dropped": row 0's first token left out."""
    original = RealTokens.__init__

    def init(self, keep):
        if torch.equal(keep.bool(), mask.bool()):
            keep = keep.bool().clone()
            if bug == "misplaced":
                keep[1] = keep[1].flip(0)
            else:
                keep[0, 0] = False
        original(self, keep)

    monkeypatch.setattr(RealTokens, "__init__", init)


def step(model, ids, mask, labels, packed: bool, monkeypatch, bug: str | None = None, **kwargs):
    """One forward/backward in training mode (packing with `bug`, see `broken_packing`); returns loss, logits,
    encoder output and the gradients."""
    monkeypatch.setattr(RealTokens, "enabled", packed)
    monkeypatch.setattr(RealTokens, "__init__", ORIGINAL_INIT)
    if bug is not None:
        broken_packing(monkeypatch, mask, bug)
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, label_smoothing=0.1, **kwargs)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out, grads


def needed_positions(labels):
    return labels.ne(-100).flip(1).cumsum(1).flip(1) > 0


@pytest.mark.parametrize("normalize_before", [False, True])
def test_packed_step_equals_the_padded_step(normalize_before, monkeypatch):
    model = tiny_model(dropout=0.0, normalize_before=normalize_before).train()
    ids, mask, labels = batch()
    fused, fused_grads = step(model, ids, mask, labels, True, monkeypatch)  # projection and loss fused: no logits
    packed, packed_grads = step(model, ids, mask, labels, True, monkeypatch, skip_logits=False)
    padded, padded_grads = step(model, ids, mask, labels, False, monkeypatch)
    assert fused.logits is None and padded.logits.shape == (4, 7, 99)
    torch.testing.assert_close(packed.loss, padded.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused.loss, padded.loss, rtol=1e-6, atol=1e-6)
    labelled = labels.ne(-100)
    torch.testing.assert_close(packed.logits[labelled], padded.logits[labelled], rtol=1e-5, atol=1e-5)
    assert packed.logits[~labelled].abs().max() == 0  # the output projection ran on labelled positions only
    assert fused_grads.keys() == padded_grads.keys()
    for name, grad in padded_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    real = mask.bool()
    torch.testing.assert_close(packed.encoder_last_hidden_state[real], padded.encoder_last_hidden_state[real],
                               rtol=1e-5, atol=1e-5)
    assert packed.encoder_last_hidden_state[~real].abs().max() == 0  # left-out positions are zeros
    assert packed_grads.keys() == padded_grads.keys() and len(packed_grads) > 20
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # Controls: packing that misplaces or drops a source token misses each tolerance above by orders of magnitude
    # (post-LN here: loss 4e-2 and 6e-3 against 1e-6, labelled logits 1.9 and 0.6 and encoder outputs 2.8 and 2.4
    # against 1e-5, some gradient 9e-2 and 5e-2 against 1e-6 + 1e-4 |g|).
    for bug in ("misplaced", "dropped"):
        broken, broken_grads = step(model, ids, mask, labels, True, monkeypatch, bug=bug, skip_logits=False)
        assert abs(float((broken.loss - padded.loss).detach())) > 1e-3, bug
        assert (broken.logits[labelled] - padded.logits[labelled]).abs().max() > 0.1, bug
        assert (broken.encoder_last_hidden_state[real] - padded.encoder_last_hidden_state[real]).abs().max() > 0.5
        assert max((broken_grads[name] - grad).abs().max() for name, grad in padded_grads.items()) > 1e-2, bug


def test_the_packed_step_really_runs_on_fewer_rows(monkeypatch):
    """The FFN sees N rows (the real tokens), not B * L: 30 source and 24 target positions here, of 36 and 28."""
    model = tiny_model(dropout=0.0).train()
    ids, mask, labels = batch()
    rows = []

    def count_rows(module, args, out):
        rows.append(args[0].numel() // args[0].shape[-1])

    handles = [layer.fc1.register_forward_hook(count_rows)
               for layer in (model.model.encoder.layers[0], model.model.decoder.layers[0])]
    step(model, ids, mask, labels, True, monkeypatch)
    step(model, ids, mask, labels, False, monkeypatch)
    for handle in handles:
        handle.remove()
    assert rows == [int(mask.sum()), int(needed_positions(labels).sum()), 4 * 9, 4 * 7]
    assert rows[:2] == [30, 24]


def test_packed_step_under_gradient_checkpointing_and_bf16(monkeypatch):
    model = tiny_model(dropout=0.0).train()
    ids, mask, labels = batch(1)
    _, reference = step(model, ids, mask, labels, False, monkeypatch)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()  # 5.17
    out, grads = step(model, ids, mask, labels, True, monkeypatch)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # control: a misplaced source row moves some gradient by 1e-1, four orders above the tolerance
    _, broken = step(model, ids, mask, labels, True, monkeypatch, bug="misplaced")
    assert max((broken[name] - grad).abs().max() for name, grad in reference.items()) > 1e-2
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()


def test_packed_step_in_bf16_on_a_trained_model(monkeypatch):
    # A copy model, whose loss depends on where each source token is (an untrained model's loss is about ln V
    # whatever the packing does), under bf16 autocast.
    model = trained_copy_model(steps=200).train()
    ids, mask, labels = copy_task_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        packed, _ = step(model, ids, mask, labels, True, monkeypatch)
        padded, _ = step(model, ids, mask, labels, False, monkeypatch)
        broken = {bug: step(model, ids, mask, labels, True, monkeypatch, bug=bug)[0].loss
                  for bug in ("misplaced", "dropped")}
    assert packed.loss.dtype == torch.float32 and 0.5 < padded.loss.item() < 3.5  # ln 24 = 3.18 untrained: 2.1 here
    torch.testing.assert_close(packed.loss, padded.loss, rtol=2e-2, atol=2e-2)  # bf16's resolution; 2e-7 here
    # controls: a misplaced row moves the loss by 0.6, a dropped token by 0.2: 30 and 10 times the tolerance
    for bug, loss in broken.items():
        assert abs(float((loss - padded.loss).detach())) > 0.1, bug


def test_dropout_still_trains_and_differs_between_steps(monkeypatch):
    model = tiny_model(dropout=0.1).train()
    ids, mask, labels = batch()
    first, grads = step(model, ids, mask, labels, True, monkeypatch)
    second, _ = step(model, ids, mask, labels, True, monkeypatch)
    assert torch.isfinite(first.loss) and first.loss != second.loss
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_padded_layout_where_packing_would_change_or_gain_nothing(monkeypatch):
    model = tiny_model(dropout=0.0).train()
    ids, mask, labels = batch()
    calls = []
    original = RealTokens.__init__

    def recording(self, keep):
        calls.append(tuple(keep.shape))
        original(self, keep)

    monkeypatch.setattr(RealTokens, "__init__", recording)
    # a source row of padding only: its cross-attention is defined by the padded layout
    empty = mask.clone()
    empty[1] = 0
    model(input_ids=ids, attention_mask=empty, labels=labels)
    assert calls == [(4, 7), (4, 7)]  # the decoder and the output projection still pack; the encoder does not
    calls.clear()
    # no padding anywhere: only the labelled outputs (all of them) go to the fused projection and loss
    out = model(input_ids=ids, attention_mask=torch.ones_like(mask), labels=labels.clamp(min=4))
    assert calls == [(4, 7)] and out.logits is None
    calls.clear()
    out = model(input_ids=ids, attention_mask=torch.ones_like(mask), labels=labels.clamp(min=4), skip_logits=False)
    assert calls == [] and out.logits.shape == (4, 7, 99)
    # eval mode, attention probabilities, hidden states
    model(input_ids=ids, attention_mask=mask, labels=labels, output_attentions=True)
    model(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True)
    model.eval()
    model(input_ids=ids, attention_mask=mask, labels=labels)
    assert calls == []
    model.train()
    model(input_ids=ids, attention_mask=mask, labels=labels)
    assert calls == [(4, 9), (4, 7), (4, 9), (4, 7)]  # encoder; decoder, its view of the source; labelled outputs


def test_skip_logits_true_leaves_them_out_anywhere_with_the_same_loss():
    model = tiny_model(dropout=0.0).eval()  # eval: the padded layout and the unfused loss
    ids, mask, labels = batch()
    kept = model(input_ids=ids, attention_mask=mask, labels=labels)
    skipped = model(input_ids=ids, attention_mask=mask, labels=labels, skip_logits=True)
    assert kept.logits.shape == (4, 7, 99) and skipped.logits is None
    torch.testing.assert_close(skipped.loss, kept.loss, rtol=0, atol=0)


def test_a_hooked_or_adapted_output_projection_keeps_its_own_forward(monkeypatch):
    """The fused loss multiplies by lm_head.weight itself; a hook on lm_head (as an adapter would change its output)
    must still shape the loss, so that step takes lm_head's forward."""
    model = tiny_model(dropout=0.0).train()
    ids, mask, labels = batch()
    plain = model(input_ids=ids, attention_mask=mask, labels=labels)
    handle = model.lm_head.register_forward_hook(lambda module, args, out: out * 0.5)
    hooked = model(input_ids=ids, attention_mask=mask, labels=labels)
    handle.remove()
    assert plain.logits is None and hooked.logits is not None
    half = model(input_ids=ids, attention_mask=mask, labels=labels, skip_logits=False)
    expected = model.loss(half.logits * 0.5, labels)
    torch.testing.assert_close(hooked.loss, expected, rtol=1e-6, atol=1e-6)
    assert abs(float(hooked.loss) - float(plain.loss)) > 0.01
