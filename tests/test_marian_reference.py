"""transformers' MarianMTModel, code this project did not write, as the reference for the forward pass, greedy and
beam search (`vaswani_hf.conversion_marian`: the weights mapped, the residual stream permuted as §3.5's table is).

The model under test is small (d_model 64, 2+2 layers, a joint BPE of 2,000 tokens learned from the shipped Multi30k
train set) and trained for 200 steps on Multi30k De->En, so that it ends its sentences and beam search has choices to
make: an untrained model repeats one token to the length limit, where greedy and beam search agree and the end of
sentence, the length penalty and the finished-sentence skipping never come into play. Every comparison has a broken
variant beside it (a wrong positional permutation, a shifted label) that misses the tolerance by orders of magnitude.
"""

import contextlib
import copy

import pytest
import torch
from helpers import multi30k_batch, multi30k_tokenizer, padded_batch, tiny_model, trained_multi30k_model
from transformers import MarianConfig, MarianMTModel

from vaswani_hf import VaswaniForConditionalGeneration, conversion_marian
from vaswani_hf.conversion_marian import from_marian, marian_permutation, to_marian
from vaswani_hf.data import multi30k_file, read_lines
from vaswani_hf.fast_paths_vaswani import training_fast_paths
from vaswani_hf.kernels_vaswani import OneDNNLinear

SENTENCES = 256  # of Multi30k test2016's source side, decoded by both implementations
BATCH = 64  # sentences per generate() call: padded batches of mixed lengths
DECODING = dict(max_new_tokens=40, early_stopping=True)
BEAM = dict(num_beams=4, length_penalty=0.6)  # §6.1
GREEDY = dict(num_beams=1)
# fp32 logits of magnitude up to ~20 after 2+2 layers agree to ~1e-5 (different matrix-product orders); a wrong
# permutation of the positional basis moves them by more than 1.
LOGIT_TOLERANCE = 1e-4
# A training step: the loss relative to itself (it agrees to ~1e-7), each gradient relative to its tensor's largest
# (they agree to ~3e-5: sums over every token of the batch).
LOSS_TOLERANCE = 1e-5
GRADIENT_TOLERANCE = 1e-3
# Sentences whose fp32 tokens may differ because two candidates scored within fp32 rounding of each other: each must
# then decode identically in fp64 on both sides.
NEAR_TIES = 2

WRONG_PERMUTATIONS = {
    "identity": lambda d: torch.arange(d),  # our interleaved order taken for Marian's
    "cosines first": lambda d: torch.cat([torch.arange(1, d, 2), torch.arange(0, d, 2)]),
    "rolled by one": lambda d: torch.roll(marian_permutation(d), 1),
}


@pytest.fixture(scope="module")
def tokenizer():
    return multi30k_tokenizer()


@pytest.fixture(scope="module")
def test_pairs():
    return read_lines(multi30k_file("test", "de"))[:SENTENCES], read_lines(multi30k_file("test", "en"))[:SENTENCES]


@pytest.fixture(scope="module")
def model(tokenizer) -> VaswaniForConditionalGeneration:
    """The model under test: 200 Adam steps of 32 Multi30k De->En pairs (loss ~4, from ~7.6)."""
    return trained_multi30k_model(tokenizer, steps=200)


@pytest.fixture(scope="module")
def reference(model) -> MarianMTModel:
    return to_marian(model).eval()




def _pad_after_eos(sequences: torch.Tensor, eos: int = 2, pad: int = 0) -> torch.Tensor:
    """Every position after a row's first </s> set to <pad>: transformers' beam search fills them with </s> where the
    pad id is 0, which our `generate()` rewrites (see its docstring); the tokens up to </s> are what is compared."""
    is_eos = sequences[:, 1:].eq(eos)
    after = (is_eos.long().cumsum(1) - is_eos.long()) > 0
    return torch.cat([sequences[:, :1], sequences[:, 1:].masked_fill(after, pad)], dim=1)


def _rows(sequences: torch.Tensor) -> list[tuple[int, ...]]:
    """Each row up to and including its first </s>."""
    rows = []
    for row in _pad_after_eos(sequences).tolist():
        rows.append(tuple(row[: row.index(2, 1) + 1] if 2 in row[1:] else row))
    return rows


def _decode(model, tokenizer, sentences: list[str], **settings) -> list[tuple[int, ...]]:
    rows = []
    for start in range(0, len(sentences), BATCH):
        batch = multi30k_batch(tokenizer, sentences[start: start + BATCH])
        rows += _rows(model.generate(**batch, **DECODING, **settings))
    return rows


def _max_logit_difference(ours, marian, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Max |ours - Marian| over every position of a padded teacher-forced batch, and max |ours|."""
    decoder_input_ids = ours.prepare_decoder_input_ids_from_labels(batch["labels"])
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                  decoder_input_ids=decoder_input_ids)
    with torch.no_grad():
        a, b = ours(**inputs).logits, marian(**inputs).logits
    return (a - b).abs().max().item(), a.abs().max().item()


@pytest.fixture(scope="module")
def marian_tokens(reference, tokenizer, test_pairs) -> dict[str, list[tuple[int, ...]]]:
    return {name: _decode(reference, tokenizer, test_pairs[0], **settings)
            for name, settings in (("greedy", GREEDY), ("beam", BEAM))}


# The forward pass ----------------------------------------------------------------------------------------------------


def test_permutation_puts_sines_first():
    """Marian's dimension k < d/2 is our dimension 2k (a sine), its dimension d/2 + k our 2k + 1 (a cosine), §3.5."""
    assert marian_permutation(8).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert marian_permutation(5).tolist() == [0, 2, 4, 1, 3]
    model = tiny_model()
    ours, marian = model.model.encoder.embed_positions.weight, to_marian(model).model.encoder.embed_positions.weight
    assert torch.allclose(ours[:, marian_permutation(ours.shape[1])], marian, atol=1e-6)


def test_logits_match_on_padded_batches(model, reference, tokenizer, test_pairs):
    batch = multi30k_batch(tokenizer, *(side[:BATCH] for side in test_pairs))
    assert batch["attention_mask"].eq(0).any() and batch["labels"].eq(-100).any()  # padded on both sides
    difference, magnitude = _max_logit_difference(model, reference, batch)
    print(f"max |logits ours - Marian| = {difference:.2e} (max |logit| {magnitude:.1f}, {BATCH} padded sentences)")
    assert magnitude > 5.0 and difference <= LOGIT_TOLERANCE


@pytest.mark.parametrize("wrong", sorted(WRONG_PERMUTATIONS))
def test_wrong_permutation_misses_the_tolerance(model, tokenizer, test_pairs, monkeypatch, wrong):
    """The control: Marian built with another order of the residual stream disagrees by orders of magnitude, in logits
    and in the greedy tokens."""
    monkeypatch.setattr(conversion_marian, "marian_permutation", WRONG_PERMUTATIONS[wrong])
    broken = to_marian(model).eval()
    batch = multi30k_batch(tokenizer, *(side[:BATCH] for side in test_pairs))
    difference, _ = _max_logit_difference(model, broken, batch)
    print(f"{wrong}: max |logits ours - Marian| = {difference:.2e}")
    assert difference > 1000 * LOGIT_TOLERANCE
    ours, theirs = (_decode(m, tokenizer, test_pairs[0][:BATCH], **GREEDY) for m in (model, broken))
    assert sum(a != b for a, b in zip(ours, theirs)) > BATCH // 2


@pytest.mark.parametrize("overrides", [
    {},
    {"share_encoder_decoder_embeddings": False},
    {"share_encoder_decoder_embeddings": False, "target_vocab_size": 77},
    {"tie_word_embeddings": False},
    {"scale_embedding": False},
    {"d_model": 45, "num_heads": 3},  # odd width: Marian puts ceil(d/2) sines first
], ids=["paper", "separate-embeddings", "separate-vocabularies", "untied-softmax", "unscaled", "odd-width"])
def test_every_mappable_config_gives_the_same_logits(overrides):
    model = tiny_model(seed=3, **overrides)
    marian = to_marian(model).eval()
    ids, mask = padded_batch(seed=1, batch=3, length=9)
    target, target_mask = padded_batch(seed=2, batch=3, length=7, vocab=model.config.decoder_vocab_size)
    labels = target.masked_fill(target_mask.eq(0), -100)
    difference, _ = _max_logit_difference(model, marian, dict(input_ids=ids, attention_mask=mask, labels=labels))
    assert difference <= LOGIT_TOLERANCE
    assert torch.equal(from_marian(marian).state_dict()["lm_head.weight"], model.state_dict()["lm_head.weight"])


# Generation ----------------------------------------------------------------------------------------------------------


def _decoder_rows(model):
    """A list that records the rows of every decoder call (fewer than batch x beams: finished sentences left out),
    and the hook's handle."""
    rows = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows.append(ids.shape[0] if ids is not None else kwargs["inputs_embeds"].shape[0])

    return rows, model.model.decoder.register_forward_pre_hook(hook, with_kwargs=True)


def _check_near_ties(model, tokenizer, sentences, mismatches, settings, ours, theirs):
    """fp32 tokens may differ where two candidates scored within rounding of each other: allowed for at most
    `NEAR_TIES` sentences, each of which must decode identically on both sides in fp64 (ties are then ~1e9 times
    rarer)."""
    assert len(mismatches) <= NEAR_TIES, (
        f"{len(mismatches)} of {len(sentences)} sentences differ from Marian, e.g. sentence {mismatches[0]}: "
        f"{ours[mismatches[0]]} vs {theirs[mismatches[0]]}")
    precise = copy.deepcopy(model).double()
    chosen = [sentences[i] for i in mismatches]
    assert _decode(precise, tokenizer, chosen, **settings) == _decode(to_marian(precise).eval(), tokenizer, chosen,
                                                                      **settings)


@pytest.mark.parametrize("fast_paths", [True, False], ids=["fast-paths", "plain"])
@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_generate_gives_marians_tokens(model, tokenizer, test_pairs, marian_tokens, monkeypatch, search, fast_paths):
    """Greedy and beam-4 (length penalty 0.6) tokens on 256 test2016 sentences, with the CPU fast paths of
    `generate()` (oneDNN-packed linears, finished-sentence skipping in beam search) and without them."""
    monkeypatch.setattr(model, "use_cpu_packed_linears", fast_paths)
    monkeypatch.setattr(model, "skip_finished_sentences", fast_paths)
    settings = GREEDY if search == "greedy" else BEAM
    rows, handle = _decoder_rows(model)
    packed = []
    packing = model.model.encoder.register_forward_pre_hook(
        lambda module, args: packed.append(type(model.lm_head) is OneDNNLinear))
    try:
        ours = _decode(model, tokenizer, test_pairs[0], **settings)
    finally:
        handle.remove()
        packing.remove()
    theirs = marian_tokens[search]
    mismatches = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    ended = sum(row[-1] == 2 for row in ours)
    print(f"{search}, fast paths {fast_paths}: {len(ours)} sentences, {len(mismatches)} differ from Marian, "
          f"{ended} end in </s>, packed linears {all(packed)}, fewest decoder rows {min(rows)}")
    assert len(ours) == len(theirs) == SENTENCES
    if mismatches:
        _check_near_ties(model, tokenizer, test_pairs[0], mismatches, settings, ours, theirs)
    assert ended >= SENTENCES // 2  # most sentences end before the limit: </s> and the length penalty matter
    assert set(packed) == {fast_paths and torch.backends.mkldnn.is_available()}
    if search == "beam":
        # the finished-sentence skipping ran decoding steps on fewer rows than batch x beams
        assert (min(rows) < BATCH * BEAM["num_beams"] // 2) == fast_paths


def test_beam_search_differs_from_greedy(marian_tokens):
    """Otherwise the beam comparison would show nothing greedy's does not."""
    differ = sum(a != b for a, b in zip(marian_tokens["greedy"], marian_tokens["beam"]))
    print(f"beam-4 differs from greedy on {differ} of {SENTENCES} sentences")
    assert differ >= SENTENCES // 2


# Training ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["fast-paths", "unfused-loss", "plain"])
def test_training_step_gives_marians_loss_and_gradients(model, tokenizer, test_pairs, path):
    """A training-mode step on a padded batch gives Marian's loss and gradients: as the training commands take it
    (`training_fast_paths`: the layers on the unpadded tokens, the output projection fused with the loss), with the
    loss from the projection's logits (a hook on lm_head keeps its own forward), and on the plain model."""
    ours = copy.deepcopy(model).train()
    marian = to_marian(ours).train()
    batch = multi30k_batch(tokenizer, *(side[:32] for side in test_pairs))
    hook = ours.lm_head.register_forward_hook(lambda module, args, out: None) if path == "unfused-loss" else None
    with training_fast_paths(ours, 0.0) if path != "plain" else contextlib.nullcontext():
        output = ours(**batch)
        output.loss.backward()
    expected = marian(**batch)
    if hook is not None:
        hook.remove()
    assert (output.logits is None) == (path != "plain")  # the training forward returns the loss only
    expected.loss.backward()
    print(f"{path}: loss {output.loss.item():.6f}, Marian {expected.loss.item():.6f}")
    assert abs(output.loss.item() - expected.loss.item()) <= LOSS_TOLERANCE * expected.loss.item()
    gradients = copy.deepcopy(ours)
    with torch.no_grad():
        for name, parameter in gradients.named_parameters():
            parameter.copy_(dict(ours.named_parameters())[name].grad)
    mapped = to_marian(gradients).state_dict()
    expected_gradients = {name: p.grad for name, p in marian.named_parameters() if p.requires_grad}
    largest = max(gradient.abs().max().item() for gradient in expected_gradients.values())
    worst = 0.0
    for name, gradient in expected_gradients.items():
        # relative to the tensor's largest gradient, floored: the key biases' gradients are zero up to rounding
        # (softmax ignores a constant added to every score)
        scale = max(gradient.abs().max().item(), 1e-3 * largest)
        error = (mapped[name] - gradient).abs().max().item() / scale
        worst = max(worst, error)
        assert error <= GRADIENT_TOLERANCE, name
    print(f"{path}: worst relative gradient difference {worst:.1e} over {len(expected_gradients)} tensors")

    # the control: labels one position off (a classic shift bug) move loss and gradients far beyond the tolerances
    embedding = expected_gradients["model.shared.weight"].clone()
    marian.zero_grad()
    shifted = marian(**{**batch, "labels": batch["labels"].roll(1, dims=1)}).loss
    shifted.backward()
    loss_error = abs(shifted.item() - expected.loss.item()) / expected.loss.item()
    gradient_error = ((marian.model.shared.weight.grad - embedding).abs().max() / embedding.abs().max()).item()
    print(f"labels shifted by one: relative loss difference {loss_error:.1e}, embedding gradient {gradient_error:.1e}")
    assert loss_error > 100 * LOSS_TOLERANCE and gradient_error > 100 * GRADIENT_TOLERANCE


# The other way: Marian's weights in this model -------------------------------------------------------------------


def test_round_trip_is_exact(model):
    back = from_marian(to_marian(model))
    assert isinstance(back, VaswaniForConditionalGeneration) and back.config.to_diff_dict() == \
        model.config.to_diff_dict()
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert back.generation_config.to_dict() == model.generation_config.to_dict()


def _random_marian(seed: int = 0, **overrides) -> MarianMTModel:
    settings = dict(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                    decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64,
                    activation_function="relu", scale_embedding=True, pad_token_id=0, eos_token_id=2,
                    bos_token_id=None, decoder_start_token_id=1, forced_eos_token_id=None, dropout=0.0)
    torch.manual_seed(seed)
    return MarianMTModel(MarianConfig(**{**settings, **overrides})).eval()


@pytest.mark.parametrize("permutation", ["paper", "identity"])
def test_a_random_marian_imports_with_its_logits(monkeypatch, permutation):
    """A randomly initialized MarianMTModel (ReLU, scaled embeddings, post-LN) in this model gives Marian's logits;
    with the identity taken for the permutation (the control) it does not."""
    marian = _random_marian()
    with torch.no_grad():  # Marian's init (std 0.02) leaves the logits tiny; larger weights make the control telling
        for parameter in marian.parameters():
            if parameter.requires_grad and parameter.dim() == 2:
                parameter.mul_(25.0)
    if permutation == "identity":
        monkeypatch.setattr(conversion_marian, "marian_permutation", WRONG_PERMUTATIONS["identity"])
    ours = from_marian(marian)
    assert ours.config.bos_token_id == 1 and not ours.config.normalize_before
    ids, mask = padded_batch(seed=4, batch=3, length=9)
    labels = padded_batch(seed=5, batch=3, length=7)[0]
    difference, magnitude = _max_logit_difference(ours, marian, dict(input_ids=ids, attention_mask=mask,
                                                                      labels=labels))
    print(f"{permutation}: max |logits ours - Marian| = {difference:.2e} (max |logit| {magnitude:.1f})")
    if permutation == "paper":
        assert difference <= LOGIT_TOLERANCE
        back = to_marian(ours).state_dict()
        assert all(torch.equal(back[name], tensor) for name, tensor in marian.state_dict().items())
    else:
        assert difference > 1000 * LOGIT_TOLERANCE


# What cannot be mapped -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, field", [
    ({"normalize_before": True}, "normalize_before"),
    ({"position_embedding_type": "learned"}, "position_embedding_type"),
    ({"layer_norm_eps": 1e-6}, "layer_norm_eps"),
])
def test_to_marian_refuses_what_marian_cannot_hold(overrides, field):
    with pytest.raises(ValueError, match=field):
        to_marian(tiny_model(**overrides))


@pytest.mark.parametrize("change, message", [
    (dict(decoder_ffn_dim=41), "decoder_ffn_dim"),
    (dict(decoder_attention_heads=2), "decoder_attention_heads"),
    (dict(encoder_layerdrop=0.1), "encoder_layerdrop"),
    (dict(activation_function="gelu_fast"), "activation_function"),
    (dict(pad_token_id=None), "pad_token_id"),
    (dict(normalize_embedding=True), "normalize_embedding"),
    ("final_logits_bias", "final_logits_bias"),
    ("embed_positions", "embed_positions"),
])
def test_from_marian_refuses_what_this_model_cannot_hold(change, message):
    if isinstance(change, dict):
        marian = _random_marian(**change)
    else:
        marian = _random_marian()
        with torch.no_grad():
            (marian.final_logits_bias if change == "final_logits_bias" else
             marian.model.encoder.embed_positions.weight).add_(0.5)
    with pytest.raises(ValueError, match=message):
        from_marian(marian)


def test_other_objects_are_refused():
    with pytest.raises(TypeError, match="VaswaniForConditionalGeneration"):
        to_marian(_random_marian())
    with pytest.raises(TypeError, match="MarianMTModel"):
        from_marian(tiny_model())
