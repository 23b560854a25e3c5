"""Time the `cpu` preset's training step at several joint BPE sizes, batch sizes (`--max_tokens`) and model sizes
(`--config_overrides`) on real Multi30k batches, as `vaswani-train` runs it (its malloc and oneDNN cache settings,
eager, fused Adam, the CPU fast paths; bf16 autocast with --bf16), and print what an epoch costs at each: a smaller
vocabulary makes the output projection and softmax cheaper and the sentences longer; a smaller batch makes a step
shorter and an epoch longer in steps; a wider model makes a step longer.
Ratios are against the first row, measured in the same run. The time-based rows of docs/results.md give each setting
the steps its step time fits in the main job's budget.

    python benchmarks/bpe_size.py --bf16 --sizes 8000 5000 4000
    python benchmarks/bpe_size.py --bf16 --sizes 8000 --max_tokens 2048 1024
    python benchmarks/bpe_size.py --bf16 --sizes 8000 --config_overrides "" d_ff=2048 d_model=384,d_ff=1536
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/bpe_size.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from vaswani_training.lib.cpu_tuning import bound_onednn_caches, keep_freed_memory  # noqa: E402

keep_freed_memory()  # the process settings vaswani-train makes before its first tensor (training/lib/run.py)
bound_onednn_caches()

from cpu_levers import batches, timed_steps  # noqa: E402

from vaswani_hf.schedule import paper_adam  # noqa: E402
from vaswani_training.lib.arguments import DataArguments, ModelArguments  # noqa: E402
from vaswani_training.lib.prepare import build_model, prepare_data, token_budget_sampler  # noqa: E402
from vaswani_training.lib.presets import PRESETS  # noqa: E402


def steps_per_epoch(vocab_size: int, max_tokens: int) -> tuple[int, int]:
    """(batches in one epoch of the training split, its source + target tokens) at this BPE size."""
    _, _, tokenized = prepare_data(ModelArguments(preset="cpu", vocab_size=vocab_size), DataArguments(),
                                   PRESETS["cpu"])
    train = tokenized["train"]
    tokens = sum(map(len, train["input_ids"])) + sum(map(len, train["labels"]))
    return len(list(token_budget_sampler(train, max_tokens, shuffle=True, seed=1))), tokens


def time_size(vocab_size: int, steps: int, warmup: int, bf16: bool, max_tokens: int, overrides: str = "") -> dict:
    model_args, preset, tokenizer, data = batches(warmup + steps, vocab_size, max_tokens)
    model_args.config_overrides = overrides or None
    torch.manual_seed(0)
    model = build_model(model_args, preset, tokenizer).train()
    optimizer = paper_adam(model.parameters(), lr=1e-4, fused=True)
    times = timed_steps(model, optimizer, data, bf16)[warmup:]
    per_epoch, tokens = steps_per_epoch(vocab_size, max_tokens)
    step = statistics.median(times)
    return {"vocab_size": vocab_size, "max_tokens": max_tokens, "overrides": overrides, "step_s": step,
            "steps_per_epoch": per_epoch, "tokens": tokens, "epoch_min": step * per_epoch / 60,
            "parameters": sum(p.numel() for p in model.parameters())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8000, 5000], help="BPE sizes; the first is the base")
    parser.add_argument("--max_tokens", type=int, nargs="+", default=None,
                        help="batch sizes in padded tokens (default: the preset's); every BPE size at each")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per size (median reported)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast, as the run on a CPU with native bf16")
    parser.add_argument("--config_overrides", nargs="+", default=[""],
                        help="model sizes as vaswani-train's --config_overrides (e.g. d_ff=2048); '' is the preset's")
    args = parser.parse_args(argv)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"{'bf16 autocast' if args.bf16 else 'fp32'}", flush=True)
    rows = []
    for max_tokens in args.max_tokens or [PRESETS["cpu"]["max_tokens"]]:
        for size in args.sizes:
            for overrides in args.config_overrides:
                rows.append(time_size(size, args.steps, args.warmup, args.bf16, max_tokens, overrides))
                r, base = rows[-1], rows[0]
                print(f"BPE {size:6d}, {max_tokens} tokens, model {overrides or 'the preset'}: "
                      f"{r['parameters'] / 1e6:.2f}M parameters, "
                      f"step {r['step_s']:.3f} s, {r['steps_per_epoch']} steps an epoch ({r['tokens']} tokens), "
                      f"epoch {r['epoch_min']:.2f} min; steps in the same time {base['step_s'] / r['step_s']:.2f}x, "
                      f"epochs {base['epoch_min'] / r['epoch_min']:.2f}x", flush=True)
    return rows


if __name__ == "__main__":
    main()
