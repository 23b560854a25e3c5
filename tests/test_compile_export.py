"""The forward pass traces whole: no host syncs and no data-dependent Python branches on the traced path.

- `torch.export` with dynamic batch and lengths gives eager's logits, on other shapes than it was traced with;
- `torch.onnx.export(dynamo=True)` gives eager's logits on padded batches under onnxruntime (extra `[onnx]`);
- `torch._dynamo.explain` finds no graph break in the training forward, and a `fullgraph=True` compiled training
  step (forward, loss, backward) equals eager; `torch.compile` of the forward matches eager, and `generate()` with a
  compiled forward gives eager's beams;
- the checks the traced path no longer makes still run in eager mode (`check_input_ids`, the position table);
- transformers' own ExecuTorch wrapper (`Seq2SeqLMExportableModule`) exports the encoder and the decoder with a static
  cache, and its greedy loop gives `generate()`'s greedy tokens;
- a decoder step with its KV cache (`vaswani_hf.decoding.exported`), exported with `torch.export` and to ONNX through
  dynamo (run by onnxruntime): greedy and beam-4 loops over the exported graphs give `generate()`'s tokens on a trained
  copy model where beam search and greedy search disagree; a step that forgets its cache or a beam loop that does not
  reorder it are shown to miss.
"""

import copy

import pytest
import torch
from helpers import (
    BOS,
    EOS,
    PAD,
    copy_sources,
    padded_batch,
    sentences_differing_from_greedy,
    tiny_model,
    trained_copy_model,
)

from vaswani_hf.inputs_vaswani import check_input_ids

ATOL = 1e-5


class _Logits(torch.nn.Module):
    """The model as a function of four tensors, returning logits (what export and ONNX take)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                          decoder_attention_mask=decoder_attention_mask, use_cache=False).logits


def _inputs(seed: int, batch: int, source: int, target: int):
    ids, mask = padded_batch(seed=seed, batch=batch, length=source)
    decoder_ids, decoder_mask = padded_batch(seed=seed + 1, batch=batch, length=target)
    return ids, mask, decoder_ids, decoder_mask


def _dynamic_shapes():
    batch, source, target = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("source", min=2, max=60), \
        torch.export.Dim("target", min=2, max=60)
    return ({0: batch, 1: source}, {0: batch, 1: source}, {0: batch, 1: target}, {0: batch, 1: target})


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_with_dynamic_shapes_equals_eager(strict):
    model = tiny_model(seed=1)
    wrapper = _Logits(model)
    exported = torch.export.export(wrapper, _inputs(0, 3, 9, 7), dynamic_shapes=_dynamic_shapes(), strict=strict)
    for seed, batch, source, target in ((2, 2, 5, 11), (3, 5, 13, 9), (4, 1, 3, 2)):
        inputs = _inputs(seed, batch, source, target)
        if batch > 1:
            assert inputs[1].eq(0).any()  # padded rows: the mask matters
        with torch.no_grad():
            expected = wrapper(*inputs)
        torch.testing.assert_close(exported.module()(*inputs), expected, atol=ATOL, rtol=0)


def test_exported_graph_keeps_the_mask_even_when_traced_unpadded():
    # Tracing on a batch without padding must not freeze "no mask" into the graph (the old `.all()` shortcut).
    model = tiny_model(seed=1)
    wrapper = _Logits(model)
    ids, _, decoder_ids, _ = _inputs(0, 3, 9, 7)
    full = torch.ones_like(ids), torch.ones_like(decoder_ids)
    exported = torch.export.export(wrapper, (ids, full[0], decoder_ids, full[1]), dynamic_shapes=_dynamic_shapes(),
                                   strict=False)
    inputs = _inputs(5, 3, 9, 7)
    with torch.no_grad():
        expected = wrapper(*inputs)
        unmasked = wrapper(inputs[0], torch.ones_like(inputs[1]), inputs[2], torch.ones_like(inputs[3]))
    torch.testing.assert_close(exported.module()(*inputs), expected, atol=ATOL, rtol=0)
    # control: the graph with "no mask" frozen in would be 0.77 off, 10^5 times ATOL
    assert (unmasked - expected).abs().max() > 0.1


def test_onnx_export_through_dynamo_equals_eager_under_onnxruntime(tmp_path):
    pytest.importorskip("onnxscript", reason="ONNX export needs onnxscript: pip install 'vaswani-hf[onnx]'")
    onnxruntime = pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'vaswani-hf[onnx]'")
    model = tiny_model(seed=1)
    wrapper = _Logits(model)
    path = tmp_path / "model.onnx"
    torch.onnx.export(wrapper, _inputs(0, 3, 9, 7), str(path), dynamo=True, dynamic_shapes=_dynamic_shapes(),
                      input_names=["input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask"],
                      output_names=["logits"])
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    for seed, batch, source, target in ((2, 4, 11, 6), (3, 2, 5, 9)):
        inputs = _inputs(seed, batch, source, target)
        with torch.no_grad():
            expected = wrapper(*inputs)
        (logits,) = session.run(None, {name: tensor.numpy() for name, tensor in zip(names, inputs, strict=True)})
        torch.testing.assert_close(torch.from_numpy(logits), expected, atol=1e-4, rtol=0)
        # control: the same graph given masks of ones (padding attended) is 0.6 to 1.2 off, 10^4 times the tolerance
        ones = {name: tensor.numpy() for name, tensor in zip(names, inputs, strict=True)}
        ones.update(attention_mask=torch.ones_like(inputs[1]).numpy(),
                    decoder_attention_mask=torch.ones_like(inputs[3]).numpy())
        assert (torch.from_numpy(session.run(None, ones)[0]) - expected).abs().max() > 0.1


def _training_batch(seed: int = 0):
    ids, mask = padded_batch(seed=seed, batch=4, length=10)
    labels, _ = padded_batch(seed=seed + 1, batch=4, length=8)
    labels = labels.masked_fill(labels.eq(0), -100)
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def test_training_forward_has_no_graph_breaks():
    torch._dynamo.reset()
    model = tiny_model(seed=1, dropout=0.1, attention_dropout=0.1).train()
    explanation = torch._dynamo.explain(lambda **batch: model(**batch).loss)(**_training_batch())
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_fullgraph_compiled_training_step_equals_eager():
    torch._dynamo.reset()
    eager = tiny_model(seed=1, dropout=0.0).train()
    compiled = copy.deepcopy(eager)
    step = torch.compile(lambda batch: compiled(**batch).loss, fullgraph=True, backend="aot_eager")
    batch = _training_batch()
    expected = eager(**batch).loss
    expected.backward()
    loss = step(batch)
    loss.backward()
    torch.testing.assert_close(loss, expected, atol=ATOL, rtol=0)
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters(), strict=True):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)
    # control: a step that attended to the padding (the mask traced away) moves the loss by 3e-2, 3000 times ATOL, and
    # some gradient by thousands of times its tolerance
    compiled.zero_grad()
    unmasked = compiled(**{**batch, "attention_mask": torch.ones_like(batch["attention_mask"])}).loss
    unmasked.backward()
    assert abs(float(unmasked.detach()) - float(expected.detach())) > 1e-3
    excess = max(((b.grad - a.grad).abs() / (1e-5 + 1e-4 * a.grad.abs())).max()
                 for a, b in zip(eager.parameters(), compiled.parameters(), strict=True) if a.grad is not None)
    assert excess > 100


def test_eager_checks_still_hold_off_the_traced_path():
    model = tiny_model()
    with pytest.raises(ValueError, match="input_ids holds token id 120, outside this model's vocabulary of 99"):
        check_input_ids(torch.tensor([[5, 120]]), 99)
    with pytest.raises(ValueError, match="holds token id -1"):
        check_input_ids(torch.tensor([[5, -1]]), 99, "decoder_input_ids")
    check_input_ids(torch.tensor([[5, 98]]), 99)
    # The sinusoidal table is sized from the config and grows (outside compiled code) for longer inputs.
    table = model.model.encoder.embed_positions
    assert table.weight.shape[0] == model.config.max_position_embeddings == 64
    with torch.no_grad():
        model(input_ids=torch.randint(4, 99, (1, 70)), decoder_input_ids=torch.ones(1, 3, dtype=torch.long))
    assert table.weight.shape[0] >= 70
    table.reserve(10)  # never shrinks
    assert table.weight.shape[0] >= 70


def test_transformers_seq2seq_exportable_module_exports_and_its_greedy_loop_matches_generate():
    # transformers' ExecuTorch path (integrations.executorch): torch.export of get_encoder() and of get_decoder() with
    # a static cache, then its own greedy loop, which reads `outputs[0]` of the decoder and starts from token 0.
    executorch = pytest.importorskip("transformers.integrations.executorch")
    model = trained_copy_model(steps=60, decoder_start_token_id=0)  # trained to start from 0, as the loop does
    exportable = executorch.Seq2SeqLMExportableModule(model, batch_size=1, max_hidden_seq_length=64,
                                                      max_cache_length=32).export()
    ids, mask = copy_sources(seed=3, batch=4)
    outputs = []
    for row in range(ids.shape[0]):
        prompt = ids[row: row + 1, : int(mask[row].sum())]
        exported = exportable.generate(prompt, max_new_tokens=16)
        expected = model.generate(input_ids=prompt, num_beams=1, do_sample=False, max_new_tokens=15)[0].tolist()
        expected = expected[: expected.index(EOS) + 1] if EOS in expected else expected
        assert exported == expected
        outputs.append(tuple(exported))
    # sentences, not one token repeated: different per source, ended by </s> where the model learned to copy
    assert len(set(outputs)) == len(outputs) and sum(output[-1] == EOS for output in outputs) >= 2


# Generation on exported graphs: encoder + decoder step with its KV cache ----------------------------------------------

MAX_LENGTH = 20


@pytest.fixture(scope="module")
def copy_generation():
    """A copy model trained 200 steps (good enough to copy most sentences, unsure enough that beam 4 and greedy
    disagree on some), 48 sources of 2-12 words, and `generate()`'s greedy and beam-4 (length penalty 0.6) tokens."""
    model = trained_copy_model(steps=200)
    ids, mask = copy_sources(seed=5, batch=48, max_len=12)
    assert mask.eq(0).any(), "padded rows: the source mask matters"
    with torch.no_grad():
        greedy = model.generate(input_ids=ids, attention_mask=mask, num_beams=1, do_sample=False,
                                max_length=MAX_LENGTH)
        beam = model.generate(input_ids=ids, attention_mask=mask, num_beams=4, length_penalty=0.6,
                              max_length=MAX_LENGTH)
    tokens = dict(max_length=MAX_LENGTH, decoder_start_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    return model, ids, mask, greedy, beam, tokens


def _sentences(sequences: torch.Tensor) -> list[list[int]]:
    return [[t for t in row if t != 0] for row in sequences.tolist()]


def test_beam_differs_from_greedy_on_the_export_inputs(copy_generation):
    model, ids, mask, greedy, beam, _ = copy_generation
    differing = sum(g != b for g, b in zip(_sentences(greedy), _sentences(beam), strict=True))
    assert differing >= 4, f"beam 4 and greedy disagree on {differing} of {len(ids)} sources"  # 12 of 48 here
    assert sum(row[-1] == 2 for row in _sentences(beam)) >= 40, "sentences ended by </s>, not noise"


def test_exported_step_logits_equal_the_full_forward(copy_generation):
    from vaswani_hf.decoding.exported import torch_export_generation

    model, ids, mask, greedy, _, _ = copy_generation
    encoder, step = (program.module() for program in torch_export_generation(model))
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, decoder_input_ids=greedy).logits  # (B, T, V)
        cross = encoder(ids, mask)
        cache = cross.new_zeros(*cross.shape[:4], 0, cross.shape[-1])
        steps, shifted = [], []
        for position in range(greedy.shape[1]):
            logits, cache = step(greedy[:, position: position + 1], cache, cross, mask)
            steps.append(logits)
            # control: the same step with its cache one position short (the previous token forgotten)
            shifted.append(step(greedy[:, position: position + 1], cache[..., :-2, :], cross, mask)[0]
                           if position >= 2 else logits)
    torch.testing.assert_close(torch.stack(steps, 1), expected, atol=1e-4, rtol=0)
    # fp32 rounding of logits up to ~3 leaves 1.3e-5; the control misses the 1e-4 tolerance by five orders (11 here)
    assert (torch.stack(shifted, 1) - expected).abs().max() > 1.0


def test_torch_export_greedy_and_beam_loops_give_generates_tokens(copy_generation):
    from vaswani_hf.decoding.exported import beam_search, greedy_search, torch_export_generation

    model, ids, mask, greedy, beam, tokens = copy_generation
    encoder, step = (program.module() for program in torch_export_generation(model))
    assert torch.equal(greedy_search(encoder, step, ids, mask, **tokens), greedy)
    assert torch.equal(beam_search(encoder, step, ids, mask, num_beams=4, length_penalty=0.6, **tokens), beam)
    # one sentence without padding: batch 1 and a mask of ones stay dynamic in the graph
    length = int(mask[0].sum())
    with torch.no_grad():
        alone = model.generate(input_ids=ids[:1, :length], num_beams=4, max_length=MAX_LENGTH)
    assert torch.equal(beam_search(encoder, step, ids[:1, :length], mask[:1, :length], **tokens), alone)


def test_onnx_exported_greedy_and_beam_loops_give_generates_tokens(copy_generation, tmp_path):
    pytest.importorskip("onnxscript", reason="ONNX export needs onnxscript: pip install 'vaswani-hf[onnx]'")
    pytest.importorskip("onnxruntime", reason="needs onnxruntime: pip install 'vaswani-hf[onnx]'")
    from vaswani_hf.decoding.exported import (
        beam_search,
        greedy_search,
        onnx_export_generation,
        onnx_generation_functions,
    )

    model, ids, mask, greedy, beam, tokens = copy_generation
    paths = onnx_export_generation(model, tmp_path)
    assert [p.name for p in paths] == ["encoder.onnx", "decoder_step.onnx"]
    # the two graphs and their external weights ("<name>.data"), moved in from a staging folder that is gone
    assert {p.name.removesuffix(".data") for p in tmp_path.iterdir()} == {"decoder_step.onnx", "encoder.onnx"}
    encode, step = onnx_generation_functions(*paths)
    assert torch.equal(greedy_search(encode, step, ids, mask, **tokens), greedy)
    assert torch.equal(beam_search(encode, step, ids, mask, num_beams=4, length_penalty=0.6, **tokens), beam)


def test_broken_caches_miss_generates_tokens(copy_generation):
    # Controls for the two tests above, on the unexported modules: what a wrong cache does to the tokens.
    from vaswani_hf.decoding.exported import (
        VaswaniExportableDecoderStep,
        VaswaniExportableEncoder,
        beam_search,
        greedy_search,
    )

    model, ids, mask, greedy, beam, tokens = copy_generation
    encoder, step = VaswaniExportableEncoder(model), VaswaniExportableDecoderStep(model)
    assert torch.equal(beam_search(encoder, step, ids, mask, **tokens), beam)

    def forgetful(decoder_input_ids, self_key_values, cross_key_values, attention_mask):
        return step(decoder_input_ids, self_key_values[..., :0, :], cross_key_values, attention_mask)

    kept = {}

    def unreordered(decoder_input_ids, self_key_values, cross_key_values, attention_mask):
        # the cache as the previous step left it, not as beam search reordered it for the surviving hypotheses
        logits, kept["cache"] = step(decoder_input_ids, kept.get("cache", self_key_values), cross_key_values,
                                     attention_mask)
        return logits, kept["cache"]

    wrong = sum(a != b for a, b in zip(_sentences(greedy_search(encoder, forgetful, ids, mask, **tokens)),
                                       _sentences(greedy), strict=True))
    assert wrong >= 24, f"a step without its cache still gave generate()'s greedy tokens on {48 - wrong} of 48"
    wrong = sum(a != b for a, b in zip(_sentences(beam_search(encoder, unreordered, ids, mask, **tokens)),
                                       _sentences(beam), strict=True))
    assert wrong >= 4, f"beam search without the cache reorder still gave generate()'s tokens on {48 - wrong} of 48"


def test_exported_step_reaches_max_length_past_the_position_table():
    from vaswani_hf.decoding.exported import greedy_search, torch_export_generation

    model = tiny_model(seed=1, max_position_embeddings=8)  # sinusoidal: the table grows to max_length first
    encoder, step = (program.module() for program in torch_export_generation(model, max_length=20,
                                                                             max_source_length=9))
    ids, mask = padded_batch(seed=2, batch=3, length=9)
    with torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=mask, num_beams=1, do_sample=False, max_length=20)
    assert expected.shape[1] == 20  # past the 8 positions the model was built with
    assert torch.equal(greedy_search(encoder, step, ids, mask, max_length=20, decoder_start_token_id=1,
                                     eos_token_id=2, pad_token_id=0), expected)
    learned = tiny_model(position_embedding_type="learned", max_position_embeddings=8)
    with pytest.raises(ValueError, match="longer than max_position_embeddings=8"):
        torch_export_generation(learned, max_length=20)


def test_exporting_generation_refuses_a_model_in_training_mode():
    from vaswani_hf.decoding.exported import VaswaniExportableDecoderStep, torch_export_generation

    model = tiny_model(seed=1).train()
    with pytest.raises(ValueError, match=r"eval mode \(model.eval\(\)\): in training mode dropout"):
        torch_export_generation(model)
    with pytest.raises(ValueError, match="eval mode"):
        VaswaniExportableDecoderStep(model)


# torch.compile of the forward and of decoding -------------------------------------------------------------------------


def test_torch_compile_forward_matches_eager():
    """torch.compile of the training forward (loss and logits) matches eager. torch ships inductor, and CI has the C++
    compiler it needs, so a failure to compile is a failure of this test."""
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
    gives eager's beams. It recompiles as the cached length grows (the cache's length is a Python int)."""
    model = tiny_model(seed=4)  # a tiny random model whose beams differ from greedy search within 4 tokens
    ids, mask = padded_batch(length=9)
    expected = model.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=4)
    model.forward = torch.compile(model.forward)
    out = model.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=4)
    assert torch.equal(out, expected)
    assert sentences_differing_from_greedy(tiny_model(seed=4), expected, dict(num_beams=4), input_ids=ids,
                                           attention_mask=mask, max_new_tokens=4) >= 1
