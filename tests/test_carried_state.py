"""State carried from one call to the next, tested by kind: for each kind, a change made by every route it knows, and
the next call must see it.

- the weights a `generate()` call multiplies with (packed for oneDNN on a CPU): every way torch lets weights change
  between two calls;
- the fast paths' installation: interrupted at any point it leaves the model as it was, and several threads, one
  training and others decoding, each find the model as their own call needs it;
- conversions: what the target engine cannot express is refused or replaced by a setting named in the output.
"""

from __future__ import annotations

import copy
import json
import threading

import pytest
import torch
from helpers import padded_batch, tiny_model
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from vaswani_hf import fast_paths_vaswani, kernels_vaswani
from vaswani_hf.fast_paths_vaswani import inference_fast_paths, training_fast_paths

needs_onednn = pytest.mark.skipif(
    not kernels_vaswani.has_onednn_linear(),
    reason="this torch build has no oneDNN linear, so generate() packs no weights and installs no packed fast path: "
           "there is no cached state to test")
PLAIN = {nn.Linear, nn.Dropout}

# The weights generate() decodes with ----------------------------------------------------------------------------------

ROUTES = ("data_in_place", "data_assigned", "no_grad_copy", "load_state_dict", "fused_adam", "unsampled_elements")
PARAMETERS = ("model.decoder.layers.0.fc2.weight", "model.encoder.layers.1.self_attn.v_proj.weight",
              "model.decoder.layers.1.encoder_attn.v_proj.weight", "lm_head.weight")


def change(model, route: str, name: str, scale: float) -> None:
    """Change parameter `name` of `model` by `route`, each a way torch allows weights to change between calls."""
    parameter = model.get_parameter(name)
    if route == "data_in_place":  # through .data: the parameter's version counter does not move
        parameter.data.mul_(scale)
    elif route == "data_assigned":  # a new tensor behind the same Parameter
        parameter.data = parameter.data * scale
    elif route == "no_grad_copy":
        with torch.no_grad():
            parameter.copy_(parameter * scale)
    elif route == "load_state_dict":
        state = model.state_dict()
        state[name] = state[name] * scale
        model.load_state_dict(state)
    elif route == "fused_adam":  # writes parameters without advancing their version counters
        optimizer = torch.optim.Adam([parameter], lr=0.1 * scale, fused=True)
        parameter.grad = torch.randn(parameter.shape, generator=torch.Generator().manual_seed(5))
        optimizer.step()
        parameter.grad = None
    else:  # elements a strided sample of every 97th value never reads, through .data
        flat = parameter.data.view(-1)
        flat[1::97] += scale
        flat[2::97] -= scale


def decode(model, ids, mask):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=2, output_scores=True,
                          return_dict_in_generate=True)


@needs_onednn
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(route="data_in_place", name="model.decoder.layers.0.fc2.weight", scale=3.0)
@example(route="unsampled_elements", name="lm_head.weight", scale=0.5)
@example(route="fused_adam", name="model.encoder.layers.1.self_attn.v_proj.weight", scale=2.0)
@given(route=st.sampled_from(ROUTES), name=st.sampled_from(PARAMETERS), scale=st.sampled_from([0.5, 2.0, 3.0]))
def test_generate_decodes_with_the_weights_as_they_are_after_any_change(route, name, scale):
    model = tiny_model()
    ids, mask = padded_batch(length=9)
    decode(model, ids, mask)  # a first call: whatever it packs
    change(model, route, name, scale)
    reference = copy.deepcopy(model)
    reference.use_cpu_packed_linears = False  # plain nn.Linear products of the current weights
    got, expected = decode(model, ids, mask), decode(reference, ids, mask)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.scores), torch.stack(expected.scores), rtol=1e-4, atol=1e-5)
    unchanged = tiny_model()
    unchanged.use_cpu_packed_linears = False
    moved = (torch.stack(decode(unchanged, ids, mask).scores) - torch.stack(expected.scores)).abs()
    assert float(moved[torch.isfinite(moved)].max()) > 1e-3  # control: the change moves what is decoded


# The installation of the fast paths -----------------------------------------------------------------------------------


def module_types(model) -> set[type]:
    return {type(module) for module in model.modules() if isinstance(module, (nn.Linear, nn.Dropout))}


class Interrupt(BaseException):
    pass


@needs_onednn
@settings(max_examples=20, deadline=None)
@given(kind=st.sampled_from(["inference", "training"]), at=st.integers(min_value=0, max_value=40))
def test_an_interrupt_anywhere_in_an_installation_leaves_the_model_as_it_was(kind, at):
    """An interrupt (Ctrl-C) at the `at`-th module swap or weight packing of an installation: the model's modules and
    its attention setting are as before, nothing stays registered, and the next call installs and decodes."""
    model = tiny_model(dropout=0.1)
    calls = {"n": 0}
    swap, pack = fast_paths_vaswani._swap, fast_paths_vaswani._packed

    def counted(function):  # an interrupt arrives once, at the `at`-th call
        def wrapper(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == at + 1:
                raise Interrupt
            return function(*args, **kwargs)
        return wrapper

    fast_paths_vaswani._swap, fast_paths_vaswani._packed = counted(swap), counted(pack)
    interrupted = False
    try:
        with (inference_fast_paths(model) if kind == "inference" else training_fast_paths(model)):
            pass
    except Interrupt:
        interrupted = True
    finally:
        fast_paths_vaswani._swap, fast_paths_vaswani._packed = swap, pack
    assert module_types(model) == PLAIN and model.config._attn_implementation == "sdpa"
    assert "forward" not in model.__dict__ and not fast_paths_vaswani._INSTALLED
    assert interrupted or calls["n"] <= at  # the interrupt came, unless the installation made fewer calls
    ids, mask = padded_batch(length=9)
    reference = copy.deepcopy(model)
    reference.use_cpu_packed_linears = False
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5),
                       reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5))


@pytest.mark.parametrize("first", ["search", "training"])
def test_training_and_decoding_interleaved_in_two_threads_on_one_model(first):
    """One thread is inside the training fast paths around a forward pass while another is in the middle of a beam
    search with the same model (its encoder-decoder attention needs "vaswani_sdpa" the whole call). The search pauses
    at its third step until the training thread has left its fast paths; the training thread enters them before the
    search starts (`first="training"`) or at that pause (`"search"`). No call fails, every decode equals the plain
    model's at those weights, and the model ends as it began."""
    from transformers import LogitsProcessor, LogitsProcessorList

    model = tiny_model(dropout=0.0)
    for parameter in model.parameters():
        parameter.requires_grad_(False)  # the steps compute gradients of nothing: the weights stay, decodes compare
    ids, mask = padded_batch(length=9)
    reference = copy.deepcopy(model)
    reference.use_cpu_packed_linears = False
    expected = reference.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=8)
    labels, _ = padded_batch(seed=3, length=7)
    errors, results, steps, rounds = [], [], [], 6
    entered, paused, left = threading.Semaphore(0), threading.Semaphore(0), threading.Semaphore(0)

    class PauseForTraining(LogitsProcessor):
        def __init__(self):
            self.calls = 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            if self.calls == 3:
                paused.release()
                assert left.acquire(timeout=60), "the training thread did not leave its fast paths"
            return scores

    def train():
        try:
            for _ in range(rounds):
                if first == "search":
                    assert paused.acquire(timeout=60), "the search did not pause"
                try:
                    with training_fast_paths(model, 0.1):
                        if first == "training":
                            entered.release()
                            assert paused.acquire(timeout=60), "the search did not pause"
                        model(input_ids=ids, attention_mask=mask, labels=labels)
                    steps.append(1)
                finally:
                    left.release()
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    def generate():
        try:
            for _ in range(rounds):
                if first == "training":
                    assert entered.acquire(timeout=60), "the training thread did not enter its fast paths"
                results.append(model.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=8,
                                              logits_processor=LogitsProcessorList([PauseForTraining()])))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
            for _ in range(rounds):
                paused.release()  # the training thread goes on to its end

    threads = [threading.Thread(target=train), threading.Thread(target=generate)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(steps) == rounds, "a training step inside each search"
    assert len(results) == rounds and all(torch.equal(result, expected) for result in results)
    assert module_types(model) == PLAIN and model.config._attn_implementation == "sdpa"
    assert not fast_paths_vaswani._INSTALLED and "forward" not in model.__dict__


# Conversions ----------------------------------------------------------------------------------------------------------


def test_to_marian_refuses_a_gnmt_length_penalty_unless_an_alpha_is_given():
    from vaswani_hf.conversion_marian import to_marian

    model = tiny_model()
    model.generation_config.length_penalty, model.generation_config.length_penalty_style = 1.6, "gnmt"
    with pytest.raises(ValueError, match="GNMT length penalty.*length_penalty=ALPHA"):
        to_marian(model)
    marian = to_marian(model, length_penalty=1.2)
    assert marian.generation_config.length_penalty == 1.2
    assert getattr(marian.generation_config, "length_penalty_style", None) is None
    model.generation_config.length_penalty_style = "hf"  # transformers' form converts as it is, without the field
    marian = to_marian(model)
    assert marian.generation_config.length_penalty == 1.6
    assert getattr(marian.generation_config, "length_penalty_style", None) is None


def _tried(alpha: float, style: str, bleu: float, ratio: float, average_last: int = 2) -> dict:
    return {"num_beams": 4, "length_penalty_style": style, "length_penalty": alpha, "bleu": bleu,
            "length_ratio": ratio, "sentences": 10, "average_last": average_last}


@pytest.mark.parametrize("case", ["hf", "gnmt_given", "gnmt_from_validation", "gnmt_without_scores"])
def test_the_decoding_of_a_ct2_conversion_says_what_it_carries(case, tmp_path):
    from transformers import GenerationConfig

    from vaswani_hf.decoding.ct2 import ct2_decoding

    generation = GenerationConfig(num_beams=4, length_penalty=1.6)
    if case != "hf":
        generation.length_penalty_style = "gnmt"
    if case == "gnmt_from_validation":
        tried = [_tried(0.6, "hf", 40.0, 0.98), _tried(1.4, "hf", 40.5, 1.004), _tried(1.0, "hf", 40.9, 0.99),
                 _tried(1.6, "gnmt", 41.0, 1.001), _tried(2.0, "hf", 41.5, 1.01, average_last=3)]
        (tmp_path / "metrics.json").write_text(json.dumps({"chosen_on_validation": {
            "chosen": {**_tried(1.6, "gnmt", 41.0, 1.001)}, "tried": tried}}))
    if case == "gnmt_without_scores":
        with pytest.raises(ValueError, match="GNMT length penalty.*--length_penalty ALPHA"):
            ct2_decoding(tmp_path, generation)
        return
    decoding = ct2_decoding(tmp_path, generation, 1.1 if case == "gnmt_given" else None)
    expected = {"hf": (1.6, "generation_config.json"), "gnmt_given": (1.1, "given"),
                # the best hf row of the same average at a length ratio >= 1 (1.0 scored more but is shorter)
                "gnmt_from_validation": (1.4, "validation")}[case]
    assert (decoding["length_penalty"], decoding["source"]) == expected
    assert decoding["length_penalty_style"] == "hf" and decoding["num_beams"] == 4
    if case != "hf":
        assert "GNMT" in decoding["note"] and "1.6" in decoding["note"]


def test_batches_translated_side_by_side_are_the_batches_translated_one_by_one(tiny_tokenizer):
    """Each batch's output goes back to its own sentences, in input order, and torch's thread count is restored; the
    decoding function here echoes its source (and the first batches wait, so that later ones finish first)."""
    import time

    from helpers import GERMAN

    from vaswani_hf.decoding.translate import translate_sentences

    model = tiny_model(vocab_size=len(tiny_tokenizer))
    threads = torch.get_num_threads()

    def echo(model, input_ids, attention_mask=None, **kwargs):
        time.sleep(0.05 if int(input_ids.shape[1]) < 12 else 0.0)
        return input_ids

    expected = [tiny_tokenizer.decode(ids, skip_special_tokens=True).strip()
                for ids in tiny_tokenizer(GERMAN)["input_ids"]]
    for workers in (1, 2, None):
        done = []
        got = translate_sentences(model, tiny_tokenizer, GERMAN, batch_size=3, workers=workers, generate_fn=echo,
                                  progress=done.append)
        assert got == expected and sum(done) == len(GERMAN) and torch.get_num_threads() == threads, workers
    assert len(set(expected)) == len(GERMAN)
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        translate_sentences(model, tiny_tokenizer, GERMAN, workers=0)


def test_searches_side_by_side_leave_the_models_generation_config_as_it_was(tiny_tokenizer):
    """The choice on validation beam-searches batches in two threads; each search decodes with its own settings
    (num_return_sequences, output_scores, return_dict_in_generate, its batch's max_new_tokens), never the model's. The
    first two searches are held inside generate() together (a barrier) and the second ends last: afterwards the
    model's generation config is what it was (what the choice writes and the test set decodes with), and the scores
    are those of one search at a time."""
    import time

    from helpers import ENGLISH, GERMAN

    from vaswani_hf.decoding.search import length_penalty_search

    model = tiny_model(vocab_size=len(tiny_tokenizer))
    model.generation_config.update(num_beams=4, length_penalty=0.6)
    before = model.generation_config.to_dict()
    threads = torch.get_num_threads()
    barrier, lock, calls = threading.Barrier(2, timeout=30), threading.Lock(), []
    generate = model.generate

    def held(*args, **kwargs):
        with lock:
            calls.append(threading.get_ident())
            number = len(calls)
        if number <= 2:
            barrier.wait()  # both searches are inside their call at once
        out = generate(*args, **kwargs)
        if number == 2:
            time.sleep(0.3)  # and the one that came second ends last
        return out

    try:
        torch.set_num_threads(1)  # one search at a time (map_batches takes torch's thread count)
        alone = length_penalty_search(model, tiny_tokenizer, GERMAN, ENGLISH, alphas=(0.6, 1.0), batch_size=3)
        torch.set_num_threads(2)
        model.generate = held
        side_by_side = length_penalty_search(model, tiny_tokenizer, GERMAN, ENGLISH, alphas=(0.6, 1.0), batch_size=3)
    finally:
        model.__dict__.pop("generate", None)
        torch.set_num_threads(threads)
    assert len(set(calls[:2])) == 2 and not barrier.broken  # two threads were inside generate() together
    assert model.generation_config.to_dict() == before
    assert side_by_side == alone


# A resumed run ------------------------------------------------------------------------------------------------------


def _checkpoints(folder):
    return sorted(int(p.name.split("-")[1]) for p in folder.glob("checkpoint-*"))


def test_a_finished_run_resumed_has_nothing_to_do_and_one_stopped_after_training_only_finishes(tmp_path, train_cache,
                                                                                               capsys):
    from helpers import train_cli

    out = tmp_path / "run"
    first = train_cli(out, train_cache, "--max_steps", "3", "--save_steps", "1")
    steps, metrics_file = _checkpoints(out), out / "metrics.json"
    written = metrics_file.read_bytes()
    capsys.readouterr()
    again = train_cli(out, train_cache, "--max_steps", "3", "--save_steps", "1", "--resume_from_checkpoint", "last")
    assert "Nothing to do" in capsys.readouterr().out
    assert _checkpoints(out) == steps == [1, 2, 3] and metrics_file.read_bytes() == written  # no step, no rewrite
    assert again["train_steps"] == first["train_steps"] == 3
    metrics_file.unlink()  # as a run stopped during the choice or the test translation leaves it
    resumed = train_cli(out, train_cache, "--max_steps", "3", "--save_steps", "1", "--resume_from_checkpoint", "last")
    assert _checkpoints(out) == [1, 2, 3]  # still no step past the end
    assert resumed["train_steps"] == 3 and resumed["resumed_after_training"]["step"] == 3
    assert resumed["test_bleu"] == first["test_bleu"]  # the same weights, chosen and scored again
    assert json.loads(metrics_file.read_text())["weights_sha256"] == first["weights_sha256"]


def test_where_training_ended_is_read_from_the_checkpoint(tmp_path):
    from vaswani_training.lib.checkpoints import PLAN_FILE, training_ended_at

    folder = tmp_path / "checkpoint-40"
    folder.mkdir()
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 40, "max_steps": 8000}))
    assert training_ended_at(folder, 8000) is None  # stopped before its end: resuming continues it
    assert training_ended_at(folder, 40) == {"step": 40, "cooldown_from": None, "cooldown_checkpoint_every": None}
    (folder / PLAN_FILE).write_text(json.dumps({"step": 40, "ended": True, "planned_steps": 40, "cooldown_from": 32,
                                                "cooldown_checkpoint_every": 2}))
    assert training_ended_at(folder, 8000) == {"step": 40, "cooldown_from": 32, "cooldown_checkpoint_every": 2}
    (folder / PLAN_FILE).write_text(json.dumps({"step": 40, "ended": False, "planned_steps": 50}))
    assert training_ended_at(folder, 8000) is None  # a signal stopped it at 40 of a plan of 50
