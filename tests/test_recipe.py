"""The WMT14 recipe of docs/reproduce.md, run as written at tiny size: the blocks marked `<!-- ci: NAME -->` are read
from the page, the values its "At tiny size" table names are changed (and nothing else), and the commands run: the
synthetic corpus in the wmt14 format, the base En-De training under `accelerate launch` on 2 CPU processes, killed
once a checkpoint is complete and resumed with `--resume_from_checkpoint last`, the averaging and the evaluation with
the paper's BLEU. Also: every training command on the page parses, and `--save_every_minutes` (§6.1's checkpoints
every 10 minutes) in both training loops.
"""

import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from helpers import ROOT, TINY_RUN, free_port
from safetensors.torch import load_file

from vaswani_hf.checks import CheckError
from vaswani_training.lib.checkpoints import checkpoint_problems, checkpoint_step, resolve_resume_checkpoint

DOC = ROOT / "docs" / "reproduce.md"
TIMEOUT = 600  # seconds; a guard for a busy shared machine, not a timing assertion
KILL_AFTER = 3  # the training is killed once a checkpoint of this step or later is complete


def doc_commands(text: str) -> list[list[str]]:
    """The commands of a fenced bash block: backslash-continued lines joined, comment lines dropped, split as the
    shell splits them."""
    lines = [line for line in text.replace("\\\n", " ").splitlines() if line.strip() and not
             line.lstrip().startswith("#")]
    return [shlex.split(line) for line in lines]


def ci_blocks() -> dict[str, list[str]]:
    """The one command of each block marked `<!-- ci: NAME -->` in docs/reproduce.md, by NAME."""
    found = re.findall(r"<!-- ci: ([\w-]+) -->\n```bash\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    blocks = {}
    for name, body in found:
        commands = doc_commands(body)
        assert len(commands) == 1, f"the ci block {name} holds {len(commands)} commands"
        blocks[name] = commands[0]
    return blocks


def changed(argv: list[str], changes: dict[str, tuple[str, str | None]], drop: tuple[str, ...] = ()) -> list[str]:
    """`argv` with each `flag: (value in the doc, value at tiny size)` replaced; the flags of `drop` removed with
    their value. A flag missing or with another value than the doc's fails the test: the page and the test agree."""
    out = list(argv)
    for flag, (documented, tiny) in changes.items():
        assert flag in out, f"{flag} is not in the documented command {shlex.join(argv)}"
        at = out.index(flag) + 1
        assert out[at] == documented, f"{flag} {out[at]} in the page, the test expects {documented}"
        out[at] = tiny
    for flag in drop:
        at = out.index(flag)
        del out[at:at + 2]
    return out


def console_command(argv: list[str]) -> int:
    """Run `argv` (a console command of the project, e.g. vaswani-average ...) in this process, through its entry
    point."""
    (entry,) = entry_points(group="console_scripts", name=argv[0])
    return entry.load()(argv[1:])


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once, as a lost machine stops a job: torchrun starts each worker
    in a session of its own, so killing the launcher's process group would leave the workers training."""
    import psutil

    root = psutil.Process(pid)
    processes = [root, *root.children(recursive=True)]
    for process in processes:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=60)


def launch_env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ, ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1",
               VASWANI_CPU_MATMUL="blas", VASWANI_CACHE=str(tmp / "cache"),
               HF_DATASETS_CACHE=str(tmp / "datasets_cache"))
    env.pop("WORLD_SIZE", None)
    return env


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    """The page's synthetic corpus, training (killed, resumed), averaging and evaluation, at tiny size."""
    tmp = tmp_path_factory.mktemp("recipe")
    blocks = ci_blocks()
    assert set(blocks) == {"synthetic", "train", "average", "evaluate"}
    data, output = tmp / "synthetic-wmt14", tmp / "wmt14-en-de-base"

    synthetic = changed(blocks["synthetic"], {"--pairs": ("4500000", "300")})
    assert synthetic[:4] == ["python", "-m", "vaswani_training.synthetic", "data/synthetic-wmt14"]
    assert _synthetic(synthetic, data) == 0

    train = changed(blocks["train"], {
        "--config_file": ("training/accelerate_configs/multi_gpu_ddp_bf16.yaml",
                          "training/accelerate_configs/cpu_2proc.yaml"),
        "--preset": ("base", "tiny"),
        "--dataset_name": ("wmt14", str(data)),
        "--vocab_size": ("37000", "1000"),
        "--max_steps": ("100000", "12"),
        "--save_every_minutes": ("10", "0.000001"),
        "--output_dir": ("outputs/wmt14-en-de-base", str(output)),
    }, drop=("--dataset_config_name",)) + ["--use_cpu"]  # Trainer refuses --bf16 without a GPU unless told
    assert train[:2] == ["accelerate", "launch"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()), *train[2:]]
    env = launch_env(tmp)

    # Killed (SIGKILL to the launcher and every process under it) once a checkpoint of step KILL_AFTER or later is
    # complete.
    with open(tmp / "killed.log", "w") as log:
        victim = subprocess.Popen(launch, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + TIMEOUT
        while not any(checkpoint_step(p) >= KILL_AFTER and not checkpoint_problems(p)
                      for p in output.glob("checkpoint-*")):
            assert victim.poll() is None, f"the run ended before it was killed:\n{_tail(tmp / 'killed.log')}"
            assert time.monotonic() < deadline, _tail(tmp / "killed.log")
            time.sleep(0.05)
        kill_tree(victim.pid)
        victim.wait(timeout=60)
    assert not (output / "metrics.json").exists(), "killed before the end"
    resume_from = resolve_resume_checkpoint("last", output)

    resumed = subprocess.run(launch[:3] + ["--main_process_port", str(free_port())] + launch[5:]
                             + ["--resume_from_checkpoint", "last"], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
    assert resumed.returncode == 0, resumed.stdout[-5000:]

    average = changed(blocks["average"], {
        "--checkpoint_dir": ("outputs/wmt14-en-de-base", str(output)),
        "--output_dir": ("outputs/wmt14-en-de-base/averaged", str(output / "averaged")),
    })
    assert console_command(average) == 0

    evaluate = changed(blocks["evaluate"], {
        "--model": ("outputs/wmt14-en-de-base/averaged", str(output / "averaged")),
        "--test_file": ("data/newstest2014.de-en.jsonl", str(data / "test.jsonl")),
        "--output": ("outputs/wmt14-en-de-base/newstest2014.json", str(output / "newstest2014.json")),
    })
    assert console_command(evaluate) == 0
    return {"output": output, "data": data, "resume_from": resume_from, "resumed_log": resumed.stdout,
            "killed_log": (tmp / "killed.log").read_text(), "train": train}


def _synthetic(argv: list[str], folder: Path) -> int:
    from vaswani_training.synthetic import main

    return main([str(folder), *argv[4:], "--validation_pairs", "20", "--test_pairs", "20"])


def _tail(log: Path) -> str:
    return log.read_text()[-5000:]


def test_the_documented_training_ran_on_two_processes_from_the_synthetic_wmt14_folder(recipe):
    metrics = json.loads((recipe["output"] / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["train_steps"] == 12
    assert metrics["preset"] == "tiny" and metrics["max_tokens"] == 3125 and metrics["averaged_checkpoints"] == 5
    assert metrics["data"] == {"kind": "local", "path": str(recipe["data"]), "config": None}
    assert (metrics["source_lang"], metrics["target_lang"]) == ("en", "de")
    assert metrics["test_sentences"] == 20 and math.isfinite(metrics["test_paper_bleu"])
    assert metrics["length_penalty_style"] == "gnmt"  # the run's own test BLEU is decoded as §6.1
    assert "--bf16" in recipe["train"] and metrics["mixed_precision"] == "bf16"


def test_the_killed_run_resumed_from_its_newest_complete_checkpoint(recipe):
    step = checkpoint_step(recipe["resume_from"])
    assert KILL_AFTER <= step < 12, recipe["killed_log"][-3000:]
    assert f"Resuming from {recipe['resume_from']}" in recipe["resumed_log"]
    # A checkpoint after every step (--save_every_minutes 0.000001); 5 kept, the number --average_last needs.
    kept = sorted(checkpoint_step(p) for p in recipe["output"].glob("checkpoint-*"))
    assert kept == [8, 9, 10, 11, 12]
    state = json.loads((recipe["output"] / "checkpoint-12" / "trainer_state.json").read_text())
    assert state["global_step"] == 12


def test_the_run_and_vaswani_average_hold_the_same_average_of_the_last_five(recipe):
    output = recipe["output"]
    run_average, command_average = (load_file(folder / "model.safetensors") for folder in (output,
                                                                                            output / "averaged"))
    assert run_average.keys() == command_average.keys()
    assert all(torch.equal(run_average[k], command_average[k]) for k in run_average)
    last = load_file(output / "checkpoint-12" / "model.safetensors")
    assert any(not torch.equal(last[k], run_average[k]) for k in last), "an average, not the last checkpoint"
    used = json.loads((output / "averaged" / "averaged_from.json").read_text())
    assert [Path(p).name for p in used["averaged_checkpoints"]] == [f"checkpoint-{s}" for s in range(8, 13)]


def test_the_evaluation_wrote_the_papers_bleu(recipe):
    scores = json.loads((recipe["output"] / "newstest2014.json").read_text())
    assert math.isfinite(scores["test_paper_bleu"]) and 0.0 <= scores["test_paper_bleu"] <= 100.0
    assert scores["test_sentences"] == 20 and scores["num_beams"] == 4 and scores["length_penalty"] == 0.6
    assert scores["length_penalty_style"] == "gnmt"
    assert scores["test_paper_bleu_signature"].startswith("moses-tok(de)+compound-split(##AT##)|multi-bleu|")


def test_every_training_command_on_the_page_parses():
    from vaswani_training.lib.presets import resolve_preset
    from vaswani_training.train import build_parser

    text = DOC.read_text(encoding="utf-8")
    commands = [command for body in re.findall(r"```bash\n(.*?)```", text, re.S) for command in doc_commands(body)
                if "vaswani_training.train" in command]
    assert len(commands) == 4  # base and big, En-De and En-Fr
    for command in commands:
        args = command[command.index("vaswani_training.train") + 1:]
        model_args, data_args, recipe, training_args = build_parser().parse_args_into_dataclasses(
            args=[*args, "--use_cpu"])  # --bf16 is refused on a machine without a GPU otherwise
        assert resolve_preset(model_args)["model"] is not None
        assert data_args.max_tokens * 8 == 25_000 and data_args.source_lang == "en"
        assert recipe.save_every_minutes == 10 and recipe.average_last in (5, 20)
        assert training_args.max_steps == {"base": 100_000, "big": 300_000}[model_args.preset]
        assert recipe.average_last == {"base": 5, "big": 20}[model_args.preset]


# -- --save_every_minutes ---------------------------------------------------------------------------------------------

class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_save_every_asks_for_a_checkpoint_once_the_interval_has_passed_since_the_last_save():
    from transformers import TrainerControl, TrainerState

    from vaswani_training.train import SaveEvery

    clock = FakeClock()
    callback = SaveEvery(10, clock=clock)
    state, args = TrainerState(), type("Args", (), {"device": torch.device("cpu")})()
    callback.on_train_begin(args, state, TrainerControl())
    saves = []
    for step in range(1, 30):
        clock.now += 60.0  # a minute a step
        control = callback.on_step_end(args, state, TrainerControl())
        if control.should_save:
            saves.append(step)
            callback.on_save(args, state, control)
        if step == 13:  # a --save_steps checkpoint restarts the interval
            callback.on_save(args, state, control)
    assert saves == [10, 23]


def test_both_training_loops_save_by_the_clock_and_average_those_checkpoints(tmp_path):
    from vaswani_training.train import main as train_main
    from vaswani_training.train_no_trainer import run

    every_step = ["--save_every_minutes", "0.000001", "--max_steps", "4", "--average_last", "3",
                  "--cache_dir", str(tmp_path / "cache")]
    metrics = train_main([*TINY_RUN, "--save_strategy", "no", *every_step, "--output_dir", str(tmp_path / "t")])
    run([*TINY_RUN[:6], "--num_samples", "0", "--cpu_bf16", "no", "--checkpointing_steps", "0", *every_step,
         "--output_dir", str(tmp_path / "n")])
    for folder in ("t", "n"):
        assert sorted(checkpoint_step(p) for p in (tmp_path / folder).glob("checkpoint-*")) == [1, 2, 3, 4]
        used = json.loads((tmp_path / folder / "averaged_from.json").read_text())
        assert [Path(p).name for p in used["averaged_checkpoints"]] == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]
    assert metrics["averaged_checkpoints"] == 3


def test_save_every_minutes_must_be_positive_and_counts_as_saving_for_average_last(tmp_path):
    from vaswani_training.lib.arguments import RecipeArguments
    from vaswani_training.train import main as train_main

    with pytest.raises(CheckError, match="--save_every_minutes must be a positive number"):
        RecipeArguments(save_every_minutes=0)
    with pytest.raises(CheckError, match="--save_strategy is 'no'"):
        train_main([*TINY_RUN, "--save_strategy", "no", "--average_last", "2", "--output_dir", str(tmp_path / "a")])
