"""On a CUDA GPU: bf16 autocast training, generate() against the CPU, SDPA against eager on a padded batch, and the
shipped accelerate configs (single GPU, DDP, FSDP with the `big` preset) launched for a few training steps.

Every test here is skipped where torch sees no CUDA device. On a machine with one GPU the DDP and FSDP configs run
one process (`--num_processes 1`): the launcher, the config's mixed precision and FSDP's wrapping, state-dict
gathering and saving are exercised, but not gradients crossing GPUs (that path is covered on the CPU over gloo by
tests/test_distributed.py); with two or more GPUs they run two processes and assert a world of two.

    python -m pytest tests/test_cuda.py -v
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ENGLISH, GERMAN, ROOT, copy_sources, free_port, tiny_model, trained_copy_model, write_jsonl

from vaswani_hf import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani_hf.fast_paths_vaswani import training_fast_paths

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

CONFIGS = ROOT / "training" / "accelerate_configs"
PAD = 0


@pytest.fixture
def exact_fp32():
    """fp32 matmuls in IEEE fp32 on the GPU (no TF32), restored afterwards."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def padded_batch(vocab: int, rows: int = 6, length: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    """Source and labels of varied real lengths (row 0 full, the others 3..length), padding id 0 / label -100."""
    generator = torch.Generator().manual_seed(seed)
    src_len = torch.randint(3, length + 1, (rows,), generator=generator)
    tgt_len = torch.randint(3, length + 1, (rows,), generator=generator)
    src_len[0] = tgt_len[0] = length
    positions = torch.arange(length)[None, :]
    input_ids = torch.randint(4, vocab, (rows, length), generator=generator)
    attention_mask = (positions < src_len[:, None]).long()
    input_ids = input_ids.masked_fill(attention_mask.eq(0), PAD)
    labels = torch.randint(4, vocab, (rows, length), generator=generator).masked_fill(positions >= tgt_len[:, None],
                                                                                      -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def to(batch: dict, device) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


def loss_and_grads(model, batch, bf16: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with training_fast_paths(model, 0.1):  # the training commands' label-smoothed loss
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = model(**batch).loss
        loss.backward()
    return loss.detach().float(), {name: p.grad.detach().float().clone() for name, p in model.named_parameters()}


def test_bf16_autocast_training_step_is_finite_and_close_to_fp32(exact_fp32):
    """The same weights and batch (dropout 0 so that no random mask differs): the bf16 autocast loss within 1 % of
    fp32's, the whole gradient within 5 % (relative L2) and pointing the same way (cosine > 0.999); an Adam step on
    the bf16 gradients leaves every parameter finite. bf16 keeps 8 bits of mantissa: ~0.4 % per rounding."""
    torch.manual_seed(0)
    config = VaswaniConfig(vocab_size=1000, d_model=256, encoder_layers=2, decoder_layers=2, num_heads=4, d_ff=1024,
                           dropout=0.0)
    model = VaswaniForConditionalGeneration(config).cuda().train()
    batch = to(padded_batch(config.vocab_size, rows=16, length=20), "cuda")
    loss32, grads32 = loss_and_grads(model, batch, bf16=False)
    loss16, grads16 = loss_and_grads(model, batch, bf16=True)
    assert math.isfinite(loss16.item()) and math.isfinite(loss32.item())
    assert abs(loss16.item() - loss32.item()) <= 0.01 * loss32.item(), (loss16.item(), loss32.item())
    flat32 = torch.cat([g.flatten() for g in grads32.values()])
    flat16 = torch.cat([grads16[name].flatten() for name in grads32])
    assert torch.isfinite(flat16).all()
    relative = ((flat16 - flat32).norm() / flat32.norm()).item()
    cosine = torch.nn.functional.cosine_similarity(flat16, flat32, dim=0).item()
    assert relative < 0.05 and cosine > 0.999, (relative, cosine)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9, fused=True)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.grad = grads16[name].to(p.dtype)
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    moved = sum(int(not torch.equal(before[name], p)) for name, p in model.named_parameters())
    assert moved == len(before)


@pytest.mark.parametrize("num_beams", [1, 4])
def test_generate_on_cuda_gives_the_cpu_tokens_in_fp32(exact_fp32, num_beams):
    """Greedy and beam-4 search (length penalty 0.6) on a padded batch: the same tokens on the GPU as on the CPU, and
    beam scores within 1e-4."""
    model = tiny_model(seed=3, vocab_size=300, d_model=64, num_heads=4, d_ff=128)
    batch = padded_batch(300, rows=8, length=10, seed=1)
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    settings = dict(num_beams=num_beams, length_penalty=0.6, max_new_tokens=16, min_new_tokens=4,
                    output_scores=True, return_dict_in_generate=True, do_sample=False)
    with torch.inference_mode():
        on_cpu = model.generate(**inputs, **settings)
        model.cuda()
        on_gpu = model.generate(**to(inputs, "cuda"), **settings)
    assert on_gpu.sequences.device.type == "cuda"
    assert torch.equal(on_cpu.sequences, on_gpu.sequences.cpu())
    if num_beams > 1:
        torch.testing.assert_close(on_gpu.sequences_scores.cpu(), on_cpu.sequences_scores, rtol=0, atol=1e-4)


def logits_and_grads(attn: str, batch: dict, bf16: bool, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and the flattened gradient of the loss of the same tiny model (seed 5, dropout 0) with `attn`."""
    model = tiny_model(seed=5, vocab_size=200, d_model=64, num_heads=4, d_ff=128, dropout=0.0,
                       attn_implementation=attn).cuda().train()
    assert model.config._attn_implementation == attn
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        out = model(**batch)
    out.loss.backward()
    return out.logits.float().detach(), torch.cat([p.grad.float().flatten() for p in model.parameters()])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_sdpa_with_a_padded_source_equals_eager_on_cuda(exact_fp32):
    """The same weights with attn_implementation sdpa (torch's fused kernels on the GPU) and eager (softmax of masked
    scores) on a batch with padded sources. fp32: logits at the real target positions to 1e-4 and the gradients to
    1e-3 relative. bf16 autocast: sdpa is as close to the fp32 eager reference as eager under bf16 is (at most twice
    as far, and under 5 %). In both, other ids under the padding change nothing."""
    batch = to(padded_batch(200, rows=8, length=16, seed=2), "cuda")
    real = batch["labels"].ne(-100)
    reference_logits, reference_grads = logits_and_grads("eager", batch, bf16=False)
    sdpa_logits, sdpa_grads = logits_and_grads("sdpa", batch, bf16=False)
    torch.testing.assert_close(sdpa_logits[real], reference_logits[real], rtol=0, atol=1e-4)
    assert relative(sdpa_grads, reference_grads) < 1e-3
    eager16_logits, eager16_grads = logits_and_grads("eager", batch, bf16=True)
    sdpa16_logits, sdpa16_grads = logits_and_grads("sdpa", batch, bf16=True)
    for sdpa16, eager16, reference in ((sdpa16_logits[real], eager16_logits[real], reference_logits[real]),
                                       (sdpa16_grads, eager16_grads, reference_grads)):
        assert relative(sdpa16, reference) <= min(0.05, 2 * relative(eager16, reference) + 1e-3), (
            relative(sdpa16, reference), relative(eager16, reference))
    noisy = dict(batch, input_ids=batch["input_ids"].masked_fill(batch["attention_mask"].eq(0), 7))
    for bf16, expected in ((False, sdpa_logits), (True, sdpa16_logits)):
        logits, _ = logits_and_grads("sdpa", noisy, bf16=bf16)
        torch.testing.assert_close(logits[real], expected[real], rtol=0, atol=1e-5)


# -- accelerate launch with the shipped configs -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda_data")
    pairs = list(zip(GERMAN, ENGLISH))
    train = pairs + [(f"Heute: {de}", f"Today: {en}") for de, en in pairs]
    return {"train": write_jsonl(root / "train.jsonl", train), "validation": write_jsonl(root / "val.jsonl", pairs[:4]),
            "test": write_jsonl(root / "test.jsonl", pairs[4:8]), "root": root}


def launch(config: str, script: str, num_processes: int, flags: list[str], timeout: int = 600) -> str:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
               "--num_processes", str(num_processes), "--main_process_port", str(free_port()),
               str(ROOT / "training" / script), *flags]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    env.pop("ACCELERATE_USE_CPU", None)
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return result.stdout + result.stderr


def run_flags(data, out: Path, *extra: str, trainer: bool = True) -> list[str]:
    """Flags both training scripts take (and, for train.py, Trainer's logging switches), then `extra`."""
    common = ["--train_file", data["train"], "--validation_file", data["validation"], "--test_file", data["test"],
              "--max_test_samples", "4", "--num_samples", "0", "--cache_dir", str(data["root"] / "cache"),
              "--output_dir", str(out)]
    return common + (["--report_to", "none", "--disable_tqdm", "true"] if trainer else []) + list(extra)


def two_if_possible() -> int:
    return 2 if torch.cuda.device_count() >= 2 else 1


def check_metrics(out: Path, steps: int) -> dict:
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train_steps"] == steps
    assert metrics["device"].startswith("cuda")
    assert math.isfinite(metrics["train_loss"])
    assert "test_bleu" in metrics
    return metrics


def test_accelerate_single_gpu_config_trains_in_bf16(data, tmp_path):
    """single_gpu.yaml with train.py --bf16, then with train_no_trainer.py --mixed_precision bf16: a few steps on the
    GPU, saved, reloaded and scored."""
    out = tmp_path / "trainer"
    launch("single_gpu.yaml", "train.py", 1, run_flags(data, out, "--preset", "tiny", "--bf16", "--max_steps", "6",
                                                       "--eval_strategy", "no", "--save_steps", "3"))
    metrics = check_metrics(out, 6)
    assert metrics["mixed_precision"] == "bf16" and metrics["distributed_type"] == "NO"
    assert VaswaniForConditionalGeneration.from_pretrained(out).config.d_model == 32
    out = tmp_path / "no_trainer"
    launch("single_gpu.yaml", "train_no_trainer.py", 1,
           run_flags(data, out, "--preset", "tiny", "--mixed_precision", "bf16", "--max_steps", "6",
                     "--checkpointing_steps", "0", trainer=False))
    metrics = check_metrics(out, 6)
    assert metrics["mixed_precision"] == "bf16"


def test_accelerate_ddp_config_trains(data, tmp_path):
    """multi_gpu_ddp_bf16.yaml (torchrun, NCCL, bf16 from the config) with train.py."""
    processes = two_if_possible()
    out = tmp_path / "ddp"
    launch("multi_gpu_ddp_bf16.yaml", "train.py", processes,
           run_flags(data, out, "--preset", "tiny", "--bf16", "--max_steps", "4", "--eval_strategy", "no",
                     "--save_steps", "4"))
    metrics = check_metrics(out, 4)
    assert metrics["world_size"] == processes and metrics["mixed_precision"] == "bf16"
    assert metrics["distributed_type"] == "MULTI_GPU"


def test_accelerate_fsdp_config_trains_the_big_preset(data, tmp_path):
    """fsdp_big.yaml with the big preset (d_model 1024, 16 heads, d_ff 4096, 6+6 layers): a few bf16 steps, a
    gathered FULL_STATE_DICT checkpoint that from_pretrained loads with the embedding still tied to the output
    projection, and the weights moved by training."""
    processes = two_if_possible()
    out = tmp_path / "fsdp"
    launch("fsdp_big.yaml", "train.py", processes,
           run_flags(data, out, "--preset", "big", "--bf16", "--max_steps", "3", "--max_tokens", "512",
                     "--eval_strategy", "no", "--save_steps", "3", "--vocab_size", "600",
                     "--warmup_steps", "4"))
    metrics = check_metrics(out, 3)
    assert metrics["distributed_type"] == "FSDP" and metrics["world_size"] == processes
    model = VaswaniForConditionalGeneration.from_pretrained(out)
    assert (model.config.d_model, model.config.num_heads, model.config.d_ff) == (1024, 16, 4096)
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert (out / "checkpoint-3" / "model.safetensors").is_file()
    # Every gathered weight is whole and finite (a shard missed by the gathering would be empty or zeros), and
    # training moved the layer norms away from their initial ones and zeros.
    for name, parameter in model.named_parameters():
        assert parameter.numel() > 0 and torch.isfinite(parameter).all(), name
        if "norm" not in name:
            assert parameter.abs().max() > 0, name
    norm = model.model.encoder.layers[0].self_attn_layer_norm
    assert (norm.weight - 1).abs().max() > 0 and norm.bias.abs().max() > 0


def test_beam_search_on_cuda_keeps_finished_sentences_in_the_batch_by_default(exact_fp32):
    """On a GPU the default (`skip_finished_sentences = None`) runs every step on the whole batch (leaving finished
    sentences out saves no launches and costs a host sync a step); `True` turns the skipping on, with the same
    sequences."""
    model = trained_copy_model(steps=40).cuda()
    ids, mask = (t.cuda() for t in copy_sources(seed=3, batch=12, min_len=1, max_len=9))
    runs = {}
    for setting in (None, True):
        model.skip_finished_sentences = setting
        rows = []
        hook = model.model.decoder.register_forward_pre_hook(
            lambda module, args, kw: rows.append((kw.get("input_ids") if kw.get("input_ids") is not None
                                                  else args[0]).shape[0]), with_kwargs=True)
        runs[setting] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, num_beams=4)
        hook.remove()
        runs[setting, "rows"] = rows
    model.skip_finished_sentences = None
    assert torch.equal(runs[None], runs[True])
    assert set(runs[None, "rows"]) == {ids.shape[0] * 4}
    assert min(runs[True, "rows"][1:]) < ids.shape[0] * 4
