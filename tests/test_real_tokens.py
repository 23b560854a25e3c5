"""CPU training on the real tokens of a padded batch (`RealTokens`) computes what the padded layout computes.

A training step on a CPU runs the position-wise layers on the real tokens only: the source positions the attention
mask keeps, each target row's positions up to its last label, and the output projection and loss the labelled
positions. With dropout off, the loss, every gradient and the logits at labelled positions are those of the padded
layout (`RealTokens.enabled = False`) to float rounding, in post-LN and pre-LN, with left- and right-padded sources and
gaps in the labels, under gradient checkpointing and under bf16 autocast (on a model trained on the copy task, whose
loss depends on where each token is). Packing with a bug (a row misplaced, a token dropped) is shown to miss each
tolerance by orders of magnitude. Batches where it would change a result (a source row that is all padding) or gain
nothing (no padding), and calls that need every position (eval, attention probabilities, hidden states), keep the
padded layout.
"""

import pytest
import torch
from helpers import tiny_model

from vaswani_hf.kernels_vaswani import RealTokens

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
    from helpers import trained_copy_model

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
