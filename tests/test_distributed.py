"""Many processes: how accelerate shards the token-budget batches, two CPU processes (gloo) training with train.py and
train_no_trainer.py exactly as one process that accumulates the same batches, checkpoints and exact resume of the
no-Trainer loop, and the shipped accelerate configs.

Why 2 processes x 1 batch equals 1 process x 2 accumulated batches: accelerate gives rank r the global batches
r, r + 2, ..., so update u sees global batches 2u and 2u + 1 either way; both loops divide the summed token losses by
the target tokens of the whole update. Dropout is off (`dropout=0.0`) so that no random mask differs. What may remain
is float32 rounding where sums are taken in another order (an all-reduce over more ranks or another backend sums
per-rank partial sums where one process keeps a running sum): relative differences of about 1e-7, which Adam's first
steps can amplify where a gradient entry is near zero. The tests allow LOSS_RTOL = 1e-5 relative on the losses and
PARAM_ATOL on the parameters; a wrong normalization (e.g. the mean of per-batch means) is off by percents. With 2
processes over gloo the runs agree to the bit (observed): a sum of two terms does not depend on the order, and the
x2 / 2 of the rescaling and of DDP's averaging is exact in binary floating point. That needs one torch thread in
every process (the launched ones and this one, which tests/conftest.py holds at 1): the key projections' biases have
a zero gradient but for rounding (softmax ignores a shift shared by all keys), and Adam turns that rounding into
steps of +-lr, so 1 against 2 threads of one process moved them apart by 0.014 (observed; every other parameter
within 2e-6). The two ranks of one run hold
bitwise identical parameters (same all-reduced gradients, same optimizer), which is asserted exactly. Every process,
this one included, multiplies with BLAS (VASWANI_CPU_MATMUL=blas): the kernels would otherwise time oneDNN against
BLAS in each process, and two processes that pick differently round differently.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ENGLISH, GERMAN, ROOT, free_port, tiny_model, write_jsonl

CONFIGS = ROOT / "training" / "accelerate_configs"
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-4  # about 2% of the first update's learning rate (5.6e-3 for the tiny preset)
STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def blas_matmul():
    """This process and the ones it launches multiply with BLAS: the per-process timed choice could differ."""
    from vaswani_hf import kernels_vaswani

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VASWANI_CPU_MATMUL", "blas")
        kernels_vaswani.cpu_training_matmul.cache_clear()
        yield
    kernels_vaswani.cpu_training_matmul.cache_clear()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """60 training pairs of varied length (the 20 test sentences three ways), 4 validation and 2 test pairs."""
    root = tmp_path_factory.mktemp("data")
    pairs = list(zip(GERMAN, ENGLISH))
    train = (pairs + [(f"Heute: {de}", f"Today: {en}") for de, en in pairs]
             + [(f"{de} Es ist kalt.", f"{en} It is cold.") for de, en in pairs])
    return {"train": write_jsonl(root / "train.jsonl", train), "validation": write_jsonl(root / "val.jsonl", pairs[:4]),
            "test": write_jsonl(root / "test.jsonl", pairs[4:6]), "root": root}


def flags(data, output_dir, cache_dir, *extra, test=True) -> list[str]:
    """Flags both training scripts take: the tiny preset without dropout, batches of at most 48 tokens."""
    return ["--preset", "tiny", "--config_overrides", "dropout=0.0", "--cpu_bf16", "no",
            "--train_file", data["train"], "--validation_file", data["validation"],
            *(["--test_file", data["test"]] if test else []), "--max_test_samples", "2", "--num_samples", "0",
            "--max_tokens", "48", "--cache_dir", str(cache_dir), "--output_dir", str(output_dir), *extra]


TRAINER_FLAGS = ["--length_penalty", "0.6", "--max_steps", str(STEPS), "--logging_steps", "1", "--eval_strategy", "no",
                 "--save_steps", str(STEPS), "--report_to", "none", "--disable_tqdm", "true",
                 "--per_device_eval_batch_size", "8"]
NO_TRAINER_FLAGS = ["--max_steps", str(STEPS), "--logging_steps", "1", "--checkpointing_steps", "0",
                    "--per_device_eval_batch_size", "8"]


@pytest.fixture(scope="module")
def launched(data):
    """The 2-process run, started first so that it overlaps the single-process runs."""
    out = data["root"] / "two"
    out.mkdir()
    cache = data["root"] / "cache_two"
    trainer_flags = flags(data, out / "trainer", cache, *TRAINER_FLAGS, test=False)
    no_trainer_flags = flags(data, out / "no_trainer", cache, *NO_TRAINER_FLAGS, test=False)
    # VASWANI_CPU_MATMUL: the same matmul library (and rounding) as the single-process references, not a timed pick.
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "VASWANI_CPU_MATMUL": "blas"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / "cpu_2proc.yaml"),
               "--main_process_port", str(free_port()), str(ROOT / "tests" / "_distributed_worker.py"), str(out),
               json.dumps(trainer_flags), json.dumps(no_trainer_flags)]
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, stdin=subprocess.DEVNULL)
    yield process, out
    if process.poll() is None:
        process.kill()
        process.communicate()


@pytest.fixture(scope="module")
def single(data):
    """One process accumulating 2 batches per update, with each script (the references)."""
    from vaswani_training.train import main as train_main
    from vaswani_training.train_no_trainer import run

    out, cache = data["root"] / "one", data["root"] / "cache_one"
    train_main(flags(data, out / "trainer", cache, *TRAINER_FLAGS, "--gradient_accumulation_steps", "2"))
    metrics, model = run(flags(data, out / "no_trainer", cache, *NO_TRAINER_FLAGS, "--gradient_accumulation_steps",
                               "2"))
    return out, metrics, model


@pytest.fixture(scope="module")
def two(launched, single):
    process, out = launched
    output, _ = process.communicate(timeout=900)
    assert process.returncode == 0, output[-5000:]
    return out


def trainer_losses(run_dir: Path) -> list[float]:
    state = json.loads((run_dir / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [log["loss"] for log in state["log_history"] if "loss" in log]


def no_trainer_log(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "trainer_state.json").read_text())["log_history"]


def assert_params_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    worst, name = max(((a[k].float() - b[k].float()).abs().max().item(), k) for k in a)
    assert worst <= atol, f"largest parameter difference {worst:.3g} > {atol}, in {name}"


# -- sharding ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_processes", [2, 3])
@pytest.mark.parametrize("num_examples", [23, 24])
def test_accelerate_shards_token_batches_without_loss_or_extra_duplicates(num_processes, num_examples):
    """accelerate's own prepare_data_loader (what Trainer and the no-Trainer loop call) on our sampler."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    from vaswani_hf.data import TokenBudgetBatchSampler

    generator = torch.Generator().manual_seed(num_examples)
    lengths = torch.randint(2, 12, (2, num_examples), generator=generator).tolist()
    sampler = TokenBudgetBatchSampler(lengths[0], lengths[1], max_tokens=20, shuffle=True, seed=5)
    loaders = [prepare_data_loader(DataLoader(range(num_examples), batch_sampler=sampler), num_processes=num_processes,
                                   process_index=rank, put_on_device=False, even_batches=True)
               for rank in range(num_processes)]
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        expected = sampler.global_batches(epoch)
        per_rank = [[[int(i) for i in batch] for batch in loader] for loader in loaders]
        assert {len(b) for b in per_rank} == {-(-len(expected) // num_processes)} == {len(loaders[0])}
        dealt = [per_rank[step % num_processes][step // num_processes]
                 for step in range(num_processes * len(per_rank[0]))]
        padding = len(dealt) - len(expected)
        assert 0 <= padding < num_processes
        # rank r holds batches r, r + N, ...; the padding repeats the first batches of the epoch, nothing else
        assert dealt == expected + expected[:padding]
        seen = sorted(i for batch in dealt for i in batch)
        repeated = sorted(i for batch in expected[:padding] for i in batch)
        assert seen == sorted(list(range(num_examples)) + repeated)
    assert sampler.global_batches(0) != sampler.global_batches(1), "set_epoch reshuffles"


def test_trainer_loader_on_two_processes_is_sharded_and_reshuffled(two):
    ranks = [json.loads((two / f"sharding_{rank}.json").read_text()) for rank in (0, 1)]
    for info in ranks:
        assert info["world_size"] == 2
        assert info["shard_class"] == "BatchSamplerShard"
        assert info["even_batches"] is True and info["split_batches"] is False
    assert ranks[0]["global_batches"] == ranks[1]["global_batches"], "both ranks see one global order"
    for epoch in ("0", "1"):
        expected = ranks[0]["global_batches"][epoch]
        batches = [info["batches"][epoch] for info in ranks]
        assert len(batches[0]) == len(batches[1]) == ranks[0]["len_loader"] == -(-len(expected) // 2)
        dealt = [batch for pair in zip(*batches) for batch in pair]
        padding = len(dealt) - len(expected)
        assert dealt == expected + expected[:padding]
        assert sorted(i for batch in expected for i in batch) == list(range(60))
    assert ranks[0]["global_batches"]["0"] != ranks[0]["global_batches"]["1"]


# -- two processes against one ----------------------------------------------------------------------------------------

def test_trainer_on_two_processes_matches_one_process_accumulating(two, single):
    from vaswani_hf import VaswaniForConditionalGeneration

    one = single[0] / "trainer"
    losses_one, losses_two = trainer_losses(one), trainer_losses(two / "trainer")
    assert len(losses_one) == len(losses_two) == STEPS
    assert losses_two == pytest.approx(losses_one, rel=LOSS_RTOL)
    rank0, rank1 = (torch.load(two / f"trainer_params_{rank}.pt") for rank in (0, 1))
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0), "the ranks hold the same parameters"
    reference = VaswaniForConditionalGeneration.from_pretrained(one).state_dict()
    assert_params_close(rank0, reference, PARAM_ATOL)


def test_no_trainer_on_two_processes_matches_one_process_accumulating(two, single):
    out_one, metrics, model = single
    log_one, log_two = no_trainer_log(out_one / "no_trainer"), no_trainer_log(two / "no_trainer")
    assert [e["step"] for e in log_one] == [e["step"] for e in log_two] == list(range(1, STEPS + 1))
    # the same global batches: the same target tokens in every update
    assert [e["num_tokens"] for e in log_one] == [e["num_tokens"] for e in log_two]
    assert [e["loss"] for e in log_two] == pytest.approx([e["loss"] for e in log_one], rel=LOSS_RTOL)
    assert [e["learning_rate"] for e in log_two] == [e["learning_rate"] for e in log_one]
    rank0, rank1 = (torch.load(two / f"no_trainer_params_{rank}.pt") for rank in (0, 1))
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0), "the ranks hold the same parameters"
    assert_params_close(rank0, model.state_dict(), PARAM_ATOL)


def test_no_trainer_loop_agrees_with_trainer(single):
    """Two implementations of the same recipe (Trainer's num_items_in_batch, and ours) from the same init."""
    out, metrics, _ = single
    log = no_trainer_log(out / "no_trainer")
    assert [e["loss"] for e in log] == pytest.approx(trainer_losses(out / "trainer"), rel=LOSS_RTOL)
    assert metrics["train_loss"] == log[-1]["loss"] and metrics["train_steps"] == STEPS
    assert metrics["train_target_tokens"] == sum(e["num_tokens"] for e in log)
    saved = json.loads((out / "no_trainer" / "metrics.json").read_text())
    assert 0.0 <= saved["test_bleu"] <= 100.0 and saved["test_sentences"] == 2
    assert saved["dataset"] == "train.jsonl" and (saved["source_lang"], saved["target_lang"]) == ("de", "en")
    assert saved["gradient_accumulation_steps"] == 2 and saved["world_size"] == 1


# -- checkpoints and resume --------------------------------------------------------------------------------------------

def test_no_trainer_resume_continues_exactly(data, tmp_path):
    """With dropout on, across an epoch end: stopping at update 3 (mid-epoch) and resuming to update 8 gives the
    uninterrupted run, bit for bit (model, optimizer, schedule, RNG and the position in the batch order all restored);
    a newer but damaged checkpoint is skipped."""
    from vaswani_training.lib.checkpoints import checkpoint_problems, resolve_resume_checkpoint
    from vaswani_training.train_no_trainer import run

    cache = data["root"] / "cache_resume"
    common = ["--preset", "tiny", "--train_file", data["train"], "--validation_file", data["validation"],
              "--cpu_bf16", "no", "--max_tokens", "256", "--cache_dir", str(cache), "--logging_steps", "1",
              "--max_steps", "8", "--checkpointing_steps", "3", "--save_total_limit", "1"]
    _, straight = run(common + ["--output_dir", str(tmp_path / "straight")])
    epochs = [e["epoch"] for e in no_trainer_log(tmp_path / "straight")]
    assert epochs[2] % 1 != 0 and epochs[-1] > 1, f"resume mid-epoch, run across an epoch end: {epochs}"
    assert [p.name for p in sorted((tmp_path / "straight").iterdir()) if "checkpoint" in p.name] == ["checkpoint-8"]

    first = tmp_path / "first"
    run(common + ["--output_dir", str(first), "--max_steps", "3"])
    checkpoint = first / "checkpoint-3"
    names = {p.name for p in checkpoint.iterdir()}
    assert {"model.safetensors", "config.json", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
            "trainer_state.json", "tokenizer.json", "modeling_vaswani.py"} <= names
    assert not list(first.glob(".tmp-*")), "no half-written checkpoint left"
    (first / ".tmp-checkpoint-9").mkdir()  # as an interrupted save leaves it: never resumed from
    damaged = first / "checkpoint-5"  # a complete-looking folder whose optimizer state is cut short: skipped
    shutil.copytree(checkpoint, damaged)
    state = json.loads((damaged / "trainer_state.json").read_text())
    (damaged / "trainer_state.json").write_text(json.dumps({**state, "global_step": 5}))
    with open(damaged / "optimizer.bin", "r+b") as handle:
        handle.truncate(handle.seek(0, os.SEEK_END) // 2)
    assert checkpoint_problems(damaged, layout="accelerate") == [
        "optimizer.bin is truncated or not a torch.save archive"]
    assert checkpoint_problems(checkpoint, layout="accelerate") == []
    assert resolve_resume_checkpoint("latest", first, layout="accelerate") == str(checkpoint)
    _, resumed = run(common + ["--output_dir", str(first), "--resume_from_checkpoint", "latest"])
    assert all(torch.equal(straight.state_dict()[k], resumed.state_dict()[k]) for k in straight.state_dict())
    assert no_trainer_log(first) == no_trainer_log(tmp_path / "straight")


def test_checkpoint_and_flag_errors_are_clear(tmp_path, monkeypatch):
    from vaswani_hf.checks import CheckError
    from vaswani_training.lib.checkpoints import resolve_resume_checkpoint
    from vaswani_training.lib.run import check_distributed
    from vaswani_training.train_no_trainer import LoopArguments, check_loop_arguments

    def resolve_checkpoint(value, output_dir):
        return resolve_resume_checkpoint(value, output_dir, layout="accelerate")

    with pytest.raises(CheckError, match="no checkpoint-<step> folder"):
        resolve_checkpoint("latest", tmp_path)
    trainer_checkpoint = tmp_path / "checkpoint-4"
    trainer_checkpoint.mkdir()
    (trainer_checkpoint / "trainer_state.json").write_text("{}")
    (trainer_checkpoint / "optimizer.pt").write_text("")
    with pytest.raises(CheckError, match=r"checkpoint-4: it is a checkpoint of train.py \(it holds optimizer.pt\): "
                                         r"resume it with train.py"):
        resolve_checkpoint("latest", tmp_path)
    with pytest.raises(CheckError, match="no such folder"):
        resolve_checkpoint(str(tmp_path / "nothing"), tmp_path)
    with pytest.raises(CheckError, match="--gradient_accumulation_steps must be >= 1"):
        check_loop_arguments(LoopArguments(gradient_accumulation_steps=0))
    with pytest.raises(CheckError, match="--mixed_precision must be no, fp16 or bf16"):
        check_loop_arguments(LoopArguments(mixed_precision="fp8"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="ACCELERATE_USE_CPU=true"):
        check_distributed(1)
    check_distributed(2)


# -- the shipped accelerate configs ------------------------------------------------------------------------------------

def launch_env(config: str):
    """What `accelerate launch --config_file CONFIG` puts in the environment of the processes it starts."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / config), "train.py"])
    args = _validate_launch_command(args)[0]
    return args, (prepare_multi_gpu_env(args) if args.num_processes > 1 else {})


def test_accelerate_configs(monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == [
        "cpu_2proc.yaml", "fsdp_big.yaml", "multi_gpu_ddp_bf16.yaml", "single_gpu.yaml"]
    args, _ = launch_env("single_gpu.yaml")
    assert args.num_processes == 1 and not args.multi_gpu and not args.use_fsdp
    args, env = launch_env("multi_gpu_ddp_bf16.yaml")
    assert args.multi_gpu and args.num_processes == 8 and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    args, env = launch_env("cpu_2proc.yaml")
    assert args.multi_gpu and args.num_processes == 2 and env["ACCELERATE_MIXED_PRECISION"] == "no"

    args, env = launch_env("fsdp_big.yaml")
    assert args.use_fsdp and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    for key, value in env.items():
        if key.startswith("FSDP_"):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables as in a launched process
    assert plugin.fsdp_version == 2 and "FULL_STATE_DICT" in str(plugin.state_dict_type)
    model = tiny_model(encoder_layers=1, decoder_layers=1)
    plugin.set_auto_wrap_policy(model)  # raises if a class to wrap is not in the model
    wrapped = plugin.auto_wrap_policy.keywords["transformer_layer_cls"]
    assert {cls.__name__ for cls in wrapped} == {"VaswaniEncoderLayer", "VaswaniDecoderLayer"}
    assert {type(layer) for layer in model.model.encoder.layers} <= wrapped


def test_a_stop_in_one_process_stops_all_at_the_same_step():
    """A SIGTERM that reaches one process, or a --max_train_minutes deadline one process's clock passes first, stops
    every process at the same step (one that stopped alone would leave the others waiting in an all-reduce)."""
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    workers = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "_stop_worker.py"), str(rank), port], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = [worker.communicate(timeout=120) for worker in workers]
    assert [worker.returncode for worker in workers] == [0, 0], [err[-2000:] for _, err in outputs]
    assert [out.strip().splitlines()[-1] for out, _ in outputs] == ["stopped 2 4", "stopped 2 4"]
