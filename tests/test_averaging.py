"""Checkpoint averaging (§6.1): exact parameter-wise means, last N by step number, tied weights, clear refusals."""

import json
import os
import re
import signal
import stat
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import ROOT, copy_run, exits_with, listing, tiny_model
from safetensors.torch import load_file

from vaswani_hf import VaswaniForConditionalGeneration
from vaswani_hf.averaging import average_checkpoints, average_last_checkpoints, find_checkpoints
from vaswani_training.average_checkpoints import main as average_main

STEPS = (200, 900, 1000, 10000)  # a plain string sort would put 10000 before 200 and 900


def _save(model, folder):
    model.save_pretrained(folder)
    return folder


@pytest.fixture
def run_dir(tmp_path, tiny_tokenizer):
    """A Trainer-like output_dir: four checkpoints of differently seeded tiny models sized to the tokenizer, the newest
    with the tokenizer, optimizer state and trainer_state.json beside the model."""
    run = tmp_path / "run"
    for seed, step in enumerate(STEPS):
        folder = _save(tiny_model(seed=seed, vocab_size=len(tiny_tokenizer)), run / f"checkpoint-{step}")
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        (folder / "optimizer.pt").write_bytes(b"not a tensor file")
    tiny_tokenizer.save_pretrained(run / "checkpoint-10000")
    (run / "runs").mkdir()  # tensorboard logs and other folders are not checkpoints
    return run


def _weights(folder):
    return load_file(str(folder / "model.safetensors"))


def test_checkpoints_are_ordered_by_step(run_dir):
    assert [p.name for p in find_checkpoints(run_dir)] == [f"checkpoint-{s}" for s in STEPS]


def test_average_is_the_exact_parameter_wise_mean(run_dir):
    folders = [run_dir / f"checkpoint-{s}" for s in STEPS[1:]]
    states = [_weights(f) for f in folders]
    averaged = average_checkpoints(folders)
    assert set(averaged) == set(states[0])
    for name, tensor in averaged.items():
        expected = (states[0][name].double() + states[1][name].double() + states[2][name].double()) / 3
        assert tensor.dtype == states[0][name].dtype
        assert torch.allclose(tensor.double(), expected, rtol=0, atol=1e-7), name
    # The models differ (different seeds), so the mean differs from each of them.
    assert not torch.equal(averaged["model.shared.weight"], states[2]["model.shared.weight"])


def test_hand_computed_values(tmp_path):
    folders = []
    for i, value in enumerate((1.0, 2.0, 6.0)):
        model = tiny_model(seed=0)
        with torch.no_grad():
            model.model.encoder.layers[0].fc1.bias.fill_(value)
            model.model.shared.weight[5, 0] = -value
        folders.append(_save(model, tmp_path / f"checkpoint-{i}"))
    averaged = average_checkpoints(folders)
    assert torch.equal(averaged["model.encoder.layers.0.fc1.bias"], torch.full((37,), 3.0))
    assert averaged["model.shared.weight"][5, 0].item() == -3.0


def test_last_n_written_as_a_model_folder_with_tied_weights(run_dir, tmp_path):
    out = tmp_path / "averaged"
    used = average_last_checkpoints(run_dir, 3, out)
    assert [p.name for p in used] == ["checkpoint-900", "checkpoint-1000", "checkpoint-10000"]
    files = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "averaged_from.json"} <= files
    assert not files & {"optimizer.pt", "trainer_state.json"}
    assert not [name for name in files if name.endswith(".tmp")]
    assert json.loads((out / "averaged_from.json").read_text())["averaged_checkpoints"] == [str(p) for p in used]

    loaded = VaswaniForConditionalGeneration.from_pretrained(out)
    expected = average_checkpoints(used)["model.shared.weight"]
    assert torch.equal(loaded.model.shared.weight, expected)
    # §3.4: one matrix for both embeddings and the pre-softmax projection, still shared after loading.
    shared = loaded.model.shared.weight
    for tied in (loaded.lm_head.weight, loaded.model.encoder.embed_tokens.weight,
                 loaded.model.decoder.embed_tokens.weight):
        assert tied.data_ptr() == shared.data_ptr()


def test_refuses_checkpoints_of_different_models(tmp_path):
    a = _save(tiny_model(seed=0), tmp_path / "checkpoint-1")
    b = _save(tiny_model(seed=0, d_ff=41), tmp_path / "checkpoint-2")
    with pytest.raises(ValueError) as error:
        average_checkpoints([a, b])
    message = str(error.value)
    assert str(a) in message and str(b) in message and "d_ff" in message and "37 vs 41" in message


def test_too_few_checkpoints(run_dir, tmp_path):
    with pytest.raises(ValueError, match=r"last 5 checkpoints.*only 4.*save_total_limit >= 5"):
        average_last_checkpoints(run_dir, 5, tmp_path / "out")
    with pytest.raises(ValueError, match="positive integer"):
        average_last_checkpoints(run_dir, 0, tmp_path / "out")


def test_reads_safetensors_only(tmp_path):
    folder = tmp_path / "checkpoint-1"
    _save(tiny_model(), folder)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 a pickle would run code")
    with pytest.raises(FileNotFoundError, match="safetensors only.*pytorch_model.bin"):
        average_checkpoints([folder, folder])


def test_refuses_to_overwrite_a_source(run_dir):
    with pytest.raises(ValueError, match="one of the checkpoints"):
        average_last_checkpoints(run_dir, 2, run_dir / "checkpoint-10000")


def test_command(run_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    assert average_main(["--checkpoint_dir", str(run_dir), "--last", "2", "--output_dir", str(out)]) == 0
    assert "checkpoint-1000" in capsys.readouterr().out
    expected = average_checkpoints([run_dir / "checkpoint-1000", run_dir / "checkpoint-10000"])
    written = _weights(out)
    assert all(torch.equal(written[k], expected[k]) for k in expected)
    with pytest.raises(SystemExit, match="only 4"):
        average_main(["--checkpoint_dir", str(run_dir), "--num_checkpoints", "9", "--output_dir", str(out)])


# Faults: nothing lost, nothing silent -------------------------------------------------------------------------------


def _plant(folder, name="model.decoder.layers.0.fc2.bias", value=float("nan")):
    """Overwrite one tensor of a saved checkpoint with `value` (a run that diverged saves NaN)."""
    from safetensors.torch import save_file

    weights = _weights(folder)
    weights[name] = torch.full_like(weights[name], value)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_checkpoint_holding_nan_or_inf_is_refused_naming_it(run_dir, tmp_path, value):
    _plant(run_dir / "checkpoint-1000", value=value)
    with pytest.raises(ValueError, match=re.escape(str(run_dir / "checkpoint-1000" / "model.safetensors"))
                       + r": 1 tensor\(s\) hold NaN or infinite values \(model.decoder.layers.0.fc2.bias\)"):
        average_last_checkpoints(run_dir, 2, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit, match="checkpoint-1000: weight model.decoder.layers.0.fc2.bias in "
                                         "model.safetensors holds NaN or infinite"):
        average_main(["--checkpoint_dir", str(run_dir), "--last", "3", "--output_dir", str(tmp_path / "cli")])
    assert average_main(["--checkpoint_dir", str(run_dir), "--last", "1", "--output_dir", str(tmp_path / "ok")]) == 0


def test_a_truncated_checkpoint_is_refused_naming_it(run_dir, tmp_path):
    weights = run_dir / "checkpoint-1000" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(SystemExit) as error:
        average_main(["--checkpoint_dir", str(run_dir), "--last", "2", "--output_dir", str(tmp_path / "out")])
    assert f"{run_dir / 'checkpoint-1000'}: the weights cannot be used (model.safetensors is truncated" in str(
        error.value)  # check_model_folder's words, before any weights are read
    assert not (tmp_path / "out").exists()


def test_the_output_never_replaces_a_checkpoint_or_another_folder(run_dir, tmp_path):
    before = {p.name: p.read_bytes() for p in (run_dir / "checkpoint-200").iterdir()}
    for output in (run_dir / "checkpoint-200", run_dir / "checkpoint-20000"):  # an older checkpoint; a new name
        with pytest.raises(SystemExit, match=r"a checkpoint-<step> name is read as a checkpoint"):
            average_main(["--checkpoint_dir", str(run_dir), "--last", "1", "--output_dir", str(output)])
    assert {p.name: p.read_bytes() for p in (run_dir / "checkpoint-200").iterdir()} == before
    assert not (run_dir / "checkpoint-20000").exists()
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    with pytest.raises(SystemExit, match=r"is not an earlier averaged model .*todo.txt"):
        average_main(["--checkpoint_dir", str(run_dir), "--last", "1", "--output_dir", str(notes)])
    assert (notes / "todo.txt").read_text() == "mine"
    # An earlier average is replaced, unless it holds something the new one would not write again.
    averaged = tmp_path / "averaged"
    assert average_main(["--checkpoint_dir", str(run_dir), "--last", "1", "--output_dir", str(averaged)]) == 0
    assert average_main(["--checkpoint_dir", str(run_dir), "--last", "2", "--output_dir", str(averaged)]) == 0
    assert len(json.loads((averaged / "averaged_from.json").read_text())["averaged_checkpoints"]) == 2
    (averaged / "test_metrics.json").write_text('{"test_bleu": 30.0}')
    with pytest.raises(SystemExit, match=r"earlier average but also holds test_metrics.json"):
        average_main(["--checkpoint_dir", str(run_dir), "--last", "3", "--output_dir", str(averaged)])
    assert len(json.loads((averaged / "averaged_from.json").read_text())["averaged_checkpoints"]) == 2


KILLED_AVERAGE = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, sys.argv[1])
    import vaswani_hf.averaging as averaging
    from vaswani_training.average_checkpoints import main

    write = averaging.replace_file_atomically

    def write_then_die(destination, function):
        if destination.name == "averaged_from.json":  # the new weights are written: killed before the record
            os.kill(os.getpid(), signal.SIGKILL)
        write(destination, function)

    averaging.replace_file_atomically = write_then_die
    main(["--checkpoint_dir", sys.argv[2], "--last", "3", "--output_dir", sys.argv[3]])
    """
)


def test_a_kill_while_averaging_into_an_earlier_average_leaves_it_whole(run_dir, tmp_path):
    """SIGKILL after the new weights are written but before averaged_from.json: the earlier average stays as it was
    (its weights beside its own record), because the new one is written under a temporary name."""
    out = tmp_path / "averaged"
    assert average_main(["--checkpoint_dir", str(run_dir), "--last", "1", "--output_dir", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    script = tmp_path / "kill.py"
    script.write_text(KILLED_AVERAGE)
    result = subprocess.run([sys.executable, str(script), str(ROOT), str(run_dir), str(out)],
                            env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    recorded = json.loads((out / "averaged_from.json").read_text())["averaged_checkpoints"]
    assert recorded == [str(run_dir / "checkpoint-10000")]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_averaged_folder_follows_the_umask(run_dir, tmp_path, umask):
    out = tmp_path / "averaged"
    previous = os.umask(umask)
    try:
        average_last_checkpoints(run_dir, 2, out)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes["model.safetensors"] == modes["averaged_from.json"] == modes["config.json"] == 0o666 & ~umask


def test_averaging_never_replaces_the_runs_own_model(tiny_run, tmp_path):
    source = copy_run(tiny_run, tmp_path)
    before = listing(source)
    for output in (source, tmp_path):
        exits_with(lambda: average_main(["--checkpoint_dir", str(source), "--last", "2", "--output_dir", str(output)]),
                   r"(is the same folder as|contains) --checkpoint_dir")
    assert listing(source) == before
    assert average_main(["--checkpoint_dir", str(source), "--last", "2", "--output_dir", str(source / "averaged")]) == 0
