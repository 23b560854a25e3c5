"""Faults during training, run for real: training/train.py in subprocesses on the tiny preset and 160 Multi30k pairs.

- SIGKILL once checkpoint-4 is complete (a callback the run's own process calls after Trainer has written the
  checkpoint's last file, so the kill lands at the same point on every machine, however busy), then
  `--resume_from_checkpoint last`: the resumed run continues exactly as a run that was never interrupted (same
  per-step losses, gradient norms, learning rates and epochs, same final weights, optimizer, scheduler and RNG state),
  with dropout on.
- Newer incomplete checkpoints (a kill while saving) are skipped with a warning, never resumed from.
- SIGINT stops training cleanly: exit code 0, a complete checkpoint of the last step, the model and metrics.json.

Each run uses one thread (OMP_NUM_THREADS=1), multiplies with BLAS (VASWANI_CPU_MATMUL=blas, so that the processes
compared round alike) and has eval off; on an idle 2-core machine the module takes well under a minute.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from helpers import ROOT
from safetensors.torch import load_file

from vaswani_hf.checks import CheckError
from vaswani_training.lib.checkpoints import checkpoint_problems, resolve_resume_checkpoint

TRAIN = ROOT / "training" / "train.py"
MAX_STEPS = 24
# 160 pairs make about 13 token-budget batches of 512 tokens, so the 24 steps cross an epoch boundary (new shuffle).
ARGS = ["--length_penalty", "0.6", "--preset", "tiny",
        "--max_train_samples", "160", "--max_test_samples", "1", "--max_steps", str(MAX_STEPS),
        "--save_steps", "2", "--save_total_limit", "20", "--logging_steps", "1", "--eval_strategy", "no",
        "--num_samples", "0", "--disable_tqdm", "true", "--cpu_bf16", "no", "--seed", "3"]
TIMEOUT = 900  # seconds; a guard for a busy shared machine, not a timing assertion
KILL_STEP = 4
# train.py with a callback that SIGKILLs its own process once checkpoint-<step> is complete: Trainer calls on_save
# after _save_checkpoint has written the weights, optimizer, scheduler, RNG state and, last, trainer_state.json.
KILLED_AT_CHECKPOINT = """
import os, signal, sys
from transformers import TrainerCallback
import vaswani_training.train as train

step = int(sys.argv.pop(1))

class KillAfterCheckpoint(TrainerCallback):
    def on_save(self, args, state, control, **kwargs):
        if state.global_step == step:
            os.kill(os.getpid(), signal.SIGKILL)

init = train.PaperTrainer.__init__

def __init__(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self.add_callback(KillAfterCheckpoint())

train.PaperTrainer.__init__ = __init__
sys.exit(train.cli())
"""


def _env():
    # VASWANI_CPU_MATMUL: each process would otherwise time oneDNN against BLAS and may pick another library (and
    # rounding) than the run it is compared with.
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1", VASWANI_CPU_MATMUL="blas")
    env.pop("WORLD_SIZE", None)
    return env


def _start(output_dir: Path, cache: Path, *extra: str, log: Path, kill_at: int | None = None) -> subprocess.Popen:
    """train.py in a subprocess; with `kill_at`, SIGKILLed by its own callback once checkpoint-<kill_at> is complete."""
    handle = open(log, "w")
    command = [str(TRAIN)] if kill_at is None else ["-c", KILLED_AT_CHECKPOINT, str(kill_at)]
    return subprocess.Popen([sys.executable, *command, *ARGS, "--output_dir", str(output_dir),
                             "--cache_dir", str(cache), *extra],
                            stdout=handle, stderr=subprocess.STDOUT, env=_env(), cwd=str(ROOT))


def _finish(process: subprocess.Popen, log: Path) -> str:
    process.wait(timeout=TIMEOUT)
    text = log.read_text()
    assert process.returncode == 0, f"train.py exited with {process.returncode}:\n{text[-4000:]}"
    return text


def _step(folder: Path) -> int:
    return int(folder.name.split("-")[1])


def _steps_logged(trainer_state: Path) -> dict[int, dict]:
    history = json.loads(trainer_state.read_text())["log_history"]
    return {log["step"]: log for log in history if "loss" in log}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory, cache):
    """A reference run, and a run SIGKILLed once its checkpoint-4 is complete, then resumed with
    `--resume_from_checkpoint last` past two planted incomplete checkpoints."""
    base = tmp_path_factory.mktemp("resume")
    reference_dir, victim_dir = base / "reference", base / "victim"
    reference = _start(reference_dir, cache, log=base / "reference.log")
    victim = _start(victim_dir, cache, log=base / "victim.log", kill_at=KILL_STEP)
    victim.wait(timeout=TIMEOUT)
    assert victim.returncode == -signal.SIGKILL, \
        f"train.py exited with {victim.returncode}:\n{(base / 'victim.log').read_text()[-4000:]}"
    # The kill came at its event: checkpoint-4 complete, nothing after it.
    assert sorted(_step(p) for p in victim_dir.glob("checkpoint-*")) == list(range(2, KILL_STEP + 1, 2))
    assert checkpoint_problems(victim_dir / f"checkpoint-{KILL_STEP}") == []
    assert not (victim_dir / "metrics.json").exists() and not (victim_dir / "model.safetensors").exists()

    complete = [p for p in victim_dir.glob("checkpoint-*") if not checkpoint_problems(p)]
    last_complete = max(complete, key=_step)
    newest = max(_step(p) for p in victim_dir.glob("checkpoint-*"))
    # Two newer, incomplete checkpoints, as a kill during a save leaves them: (a) every file present and
    # trainer_state.json naming the step, but optimizer.pt cut short; (b) only a truncated model.safetensors.
    planted_a = victim_dir / f"checkpoint-{newest + 2}"
    shutil.copytree(last_complete, planted_a)
    state = json.loads((planted_a / "trainer_state.json").read_text())
    state["global_step"] = newest + 2
    (planted_a / "trainer_state.json").write_text(json.dumps(state))
    with open(planted_a / "optimizer.pt", "r+b") as handle:
        handle.truncate(handle.seek(0, os.SEEK_END) // 2)
    planted_b = victim_dir / f"checkpoint-{newest + 4}"
    planted_b.mkdir()
    weights = (last_complete / "model.safetensors").read_bytes()
    (planted_b / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    planted = {"optimizer_cut": planted_a.name, "weights_only": planted_b.name,
               "problems_a": checkpoint_problems(planted_a), "problems_b": checkpoint_problems(planted_b)}
    # What the resolver picks, before the resumed run overwrites the planted folders with real checkpoints.
    resolved = resolve_resume_checkpoint("last", victim_dir)
    unusable = {}
    for name in (planted_a, planted_b):
        with pytest.raises(CheckError) as error:
            resolve_resume_checkpoint(str(name), victim_dir)
        unusable[name.name] = str(error.value)

    resumed = _start(victim_dir, cache, "--resume_from_checkpoint", "last", log=base / "resumed.log")
    reference_log = _finish(reference, base / "reference.log")
    resumed_log = _finish(resumed, base / "resumed.log")
    return dict(reference_dir=reference_dir, victim_dir=victim_dir, resume_step=_step(last_complete),
                last_complete=last_complete, resolved=resolved, planted=planted, unusable=unusable,
                reference_log=reference_log, resumed_log=resumed_log)


def test_incomplete_checkpoints_are_detected_and_skipped(killed_and_resumed):
    run = killed_and_resumed
    planted = run["planted"]
    assert any("optimizer.pt is truncated" in p for p in planted["problems_a"]), planted["problems_a"]
    assert not any("trainer_state" in p for p in planted["problems_a"])  # a naive "trainer_state.json exists" passes
    assert any("model.safetensors is truncated" in p for p in planted["problems_b"]), planted["problems_b"]
    assert any("trainer_state.json is missing" in p for p in planted["problems_b"])
    assert run["resolved"] == str(run["last_complete"])
    for name in (planted["optimizer_cut"], planted["weights_only"]):
        assert f"Not resuming from {name}, which is incomplete" in run["resumed_log"]
        message = run["unusable"][name]
        assert name in message and "incomplete or damaged" in message
        assert f"The newest complete checkpoint beside it is {run['last_complete']}" in message
    assert f"Resuming from {run['last_complete']}" in run["resumed_log"]


def test_resumed_run_continues_exactly_as_the_uninterrupted_one(killed_and_resumed):
    run = killed_and_resumed
    resume_step = run["resume_step"]
    assert resume_step == KILL_STEP
    reference = _steps_logged(run["reference_dir"] / f"checkpoint-{MAX_STEPS}" / "trainer_state.json")
    resumed = _steps_logged(run["victim_dir"] / f"checkpoint-{MAX_STEPS}" / "trainer_state.json")
    assert sorted(reference) == sorted(resumed) == list(range(1, MAX_STEPS + 1))
    after = [step for step in resumed if step > resume_step]
    assert after, "no step ran after the resume point"
    # The resumed run crosses an epoch boundary, so the next epoch's shuffle (set_epoch) is checked too.
    boundary = min(step for step in reference if reference[step]["epoch"] >= 1)
    assert resume_step < boundary < MAX_STEPS
    for step in after:
        for key in ("loss", "grad_norm"):
            assert resumed[step][key] == pytest.approx(reference[step][key], rel=1e-5, abs=0), (step, key)
        assert resumed[step]["learning_rate"] == pytest.approx(reference[step]["learning_rate"], rel=1e-9)
        assert resumed[step]["epoch"] == pytest.approx(reference[step]["epoch"], rel=1e-12)  # same batches per epoch
    # Dropout is on (p = 0.1), so matching losses need the restored RNG; the losses move, so they are not constant.
    config = json.loads((run["victim_dir"] / "config.json").read_text())
    assert config["dropout"] == pytest.approx(0.1)
    assert len({round(resumed[s]["loss"], 4) for s in after}) > 1


def test_resumed_run_ends_with_the_same_weights_optimizer_scheduler_and_rng(killed_and_resumed):
    run = killed_and_resumed
    final_ref = run["reference_dir"] / f"checkpoint-{MAX_STEPS}"
    final_res = run["victim_dir"] / f"checkpoint-{MAX_STEPS}"
    assert checkpoint_problems(final_ref) == [] and checkpoint_problems(final_res) == []
    ref_weights, res_weights = load_file(final_ref / "model.safetensors"), load_file(final_res / "model.safetensors")
    assert ref_weights.keys() == res_weights.keys()
    for name in ref_weights:
        torch.testing.assert_close(res_weights[name], ref_weights[name], rtol=1e-5, atol=1e-7, msg=name)
    # Trainer's own files of our own runs (torch.save pickles; see the README on what is loaded how).
    ref_opt = torch.load(final_ref / "optimizer.pt", weights_only=True)
    res_opt = torch.load(final_res / "optimizer.pt", weights_only=True)
    assert ref_opt["state"].keys() == res_opt["state"].keys() and ref_opt["state"]
    for index, state in ref_opt["state"].items():
        assert int(res_opt["state"][index]["step"]) == int(state["step"]) == MAX_STEPS
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(res_opt["state"][index][key], state[key], rtol=1e-5, atol=1e-10)
    ref_sched = torch.load(final_ref / "scheduler.pt", weights_only=True)
    res_sched = torch.load(final_res / "scheduler.pt", weights_only=True)
    assert res_sched["last_epoch"] == ref_sched["last_epoch"] == MAX_STEPS
    assert res_sched["_last_lr"] == pytest.approx(ref_sched["_last_lr"], rel=1e-12)
    ref_rng = torch.load(final_ref / "rng_state.pth", weights_only=False)
    res_rng = torch.load(final_res / "rng_state.pth", weights_only=False)
    assert torch.equal(res_rng["cpu"], ref_rng["cpu"])  # the same dropout draws happened in the same order
    assert res_rng["python"] == ref_rng["python"]
    ref_state = json.loads((final_ref / "trainer_state.json").read_text())
    res_state = json.loads((final_res / "trainer_state.json").read_text())
    assert res_state["global_step"] == ref_state["global_step"] == MAX_STEPS
    assert res_state["epoch"] == pytest.approx(ref_state["epoch"], rel=1e-12)
    metrics = json.loads((run["victim_dir"] / "metrics.json").read_text())
    assert metrics["train_steps"] == MAX_STEPS


def test_resolver_errors_name_the_folder_and_the_way_out(tmp_path):
    with pytest.raises(CheckError, match=r"no checkpoint-<step> folder in .*nothing to resume"):
        resolve_resume_checkpoint("last", tmp_path)
    with pytest.raises(CheckError, match="no such folder"):
        resolve_resume_checkpoint(str(tmp_path / "checkpoint-9"), tmp_path)
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(CheckError, match=r"none of the 1 checkpoint folders .* is complete[\s\S]*checkpoint-2: "
                                              r"model.safetensors is truncated"):
        resolve_resume_checkpoint(True, tmp_path)
    assert resolve_resume_checkpoint(None, tmp_path) is None and resolve_resume_checkpoint("", tmp_path) is None


def test_sigint_saves_a_checkpoint_writes_metrics_and_exits_0(tmp_path, cache):
    output_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, str(TRAIN), *ARGS, "--max_steps", "100000", "--save_steps", "100000",
         "--output_dir", str(output_dir), "--cache_dir", str(cache)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=str(ROOT))
    lines, started = [], threading.Event()

    def read():
        for line in process.stdout:
            lines.append(line)
            if "'loss'" in line and sum("'loss'" in seen for seen in lines) >= 3:
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(TIMEOUT), "".join(lines)[-4000:]
    process.send_signal(signal.SIGINT)
    process.wait(timeout=TIMEOUT)
    reader.join(timeout=60)
    log = "".join(lines)
    assert process.returncode == 0, log[-4000:]
    assert "Signal 2 received: saving a checkpoint and stopping after this step" in log
    checkpoints = list(output_dir.glob("checkpoint-*"))
    assert len(checkpoints) == 1, checkpoints
    step = _step(checkpoints[0])
    assert 3 <= step < 100000
    assert checkpoint_problems(checkpoints[0]) == []
    assert json.loads((checkpoints[0] / "trainer_state.json").read_text())["global_step"] == step
    metrics = json.loads((output_dir / "metrics.json").read_text())
    assert metrics["train_steps"] == step and metrics["test_sentences"] == 1
    assert (output_dir / "model.safetensors").is_file() and (output_dir / "tokenizer.json").is_file()
    # The checkpoint resumes: it is what `--resume_from_checkpoint last` picks.
    assert resolve_resume_checkpoint("last", output_dir) == str(checkpoints[0])


def test_a_second_signal_stops_at_once_and_handlers_are_restored_after_training():
    from transformers import TrainerControl, TrainerState

    from vaswani_training.train import TimeLimit

    before = signal.getsignal(signal.SIGINT)
    callback = TimeLimit(None)
    state, control = TrainerState(max_steps=100, global_step=7), TrainerControl()
    callback.on_train_begin(None, state, control)
    try:
        os.kill(os.getpid(), signal.SIGINT)  # the first: finish the step, save, stop
        assert callback.interrupted
        callback.on_step_end(None, state, control)
        assert control.should_save and control.should_training_stop
        with pytest.raises(KeyboardInterrupt, match="received twice"):
            os.kill(os.getpid(), signal.SIGINT)  # the second: stop now
    finally:
        callback.on_train_end(None, state, control)
    assert signal.getsignal(signal.SIGINT) is before  # Ctrl-C during the final evaluation works as usual
