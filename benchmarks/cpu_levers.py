"""Measure the CPU training levers of the `cpu` preset on real Multi30k batches: eager vs `torch.compile`, foreach vs
fused Adam. One process, one precision (fp32 unless --bf16); ratios against eager + foreach Adam measured in the
same run. Process CPU time per step is reported beside wall time (steadier on a shared machine with --threads 1).

    python benchmarks/cpu_levers.py --threads 1 --steps 12
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/cpu_levers.py

The batches come from the shipped Multi30k through the training pipeline: the preset's joint BPE and token budget
unless --vocab_size / --max_tokens say otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transformers import DataCollatorForSeq2Seq  # noqa: E402

from vaswani_hf.fast_paths_vaswani import training_fast_paths  # noqa: E402
from vaswani_hf.schedule import paper_adam  # noqa: E402
from vaswani_training.lib.arguments import DataArguments, ModelArguments  # noqa: E402
from vaswani_training.lib.prepare import build_model, prepare_data, token_budget_sampler  # noqa: E402
from vaswani_training.lib.presets import PRESETS  # noqa: E402


def batches(n: int, vocab_size: int | None = None, max_tokens: int | None = None):
    """The first `n` training batches of the `cpu` preset's run (its BPE size and token budget unless given), with
    the model arguments, the preset and the tokenizer that made them."""
    preset = PRESETS["cpu"]
    model_args, data_args = ModelArguments(preset="cpu", vocab_size=vocab_size), DataArguments()
    raw, tokenizer, tokenized = prepare_data(model_args, data_args, preset)
    sampler = token_budget_sampler(tokenized["train"], max_tokens or preset["max_tokens"], shuffle=True, seed=1)
    collate = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)
    out = []
    for indices in sampler:
        rows = [tokenized["train"][i] for i in indices]
        out.append(collate([{k: r[k] for k in ("input_ids", "attention_mask", "labels")} for r in rows]))
        if len(out) == n:
            break
    return model_args, preset, tokenizer, out


def timed_step(model, optimizer, batch, bf16: bool) -> float:
    """One training step on `batch` as vaswani-train's step runs it (bf16 autocast if `bf16`, `optimizer` stepped and
    zeroed; call it inside `training_fast_paths`): its seconds."""
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def timed_steps(model, optimizer, data, bf16: bool) -> list[float]:
    """Train `model` one step on each batch of `data` inside `training_fast_paths` (`timed_step`): the seconds of each
    step."""
    with training_fast_paths(model, 0.1):
        return [timed_step(model, optimizer, batch, bf16) for batch in data]


def run(label, model, optimizer, data, warmup, bf16, smoothing):
    def step(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    start = time.perf_counter()
    for batch in data[:warmup]:
        step(batch)
    warm = time.perf_counter() - start
    wall, cpu = [], []
    for batch in data[warmup:]:
        t, c = time.perf_counter(), time.process_time()
        step(batch)
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return {"label": label, "warmup_s": warm, "wall": statistics.median(wall), "cpu": statistics.median(cpu)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation happens there)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--variants", nargs="*", default=["eager", "fused_adam", "compile"])
    parser.add_argument("--vocab_size", type=int, default=None, help="joint BPE size (default: the preset's)")
    parser.add_argument("--max_tokens", type=int, default=None, help="token budget a batch (default: the preset's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_args, preset, tokenizer, data = batches(args.warmup + args.steps, args.vocab_size, args.max_tokens)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"{'bf16 autocast' if args.bf16 else 'fp32'}; {len(data)} real batches", flush=True)
    results = []
    for variant in args.variants:
        torch.manual_seed(0)
        model = build_model(model_args, preset, tokenizer).train()
        optimizer = paper_adam(model.parameters(), lr=1e-4, fused=(variant == "fused_adam"),
                               foreach=None if variant == "fused_adam" else True)
        with training_fast_paths(model, 0.1):  # the training step as vaswani-train runs it
            if variant == "compile":
                model = torch.compile(model, dynamic=True)
            results.append(run(variant, model, optimizer, data, args.warmup, args.bf16, 0.1))
        r = results[-1]
        print(f"{variant:12s} warm-up {r['warmup_s']:7.1f} s   step wall {r['wall']:6.3f} s   cpu {r['cpu']:6.3f} s   "
              f"eager/this wall {results[0]['wall'] / r['wall']:5.2f}x cpu {results[0]['cpu'] / r['cpu']:5.2f}x",
              flush=True)
    return results


if __name__ == "__main__":
    main()
