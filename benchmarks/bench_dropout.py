"""Time a CPU training step with the training step's CPU dropout against torch's `F.dropout`, alternating in one
process.

The training commands' CPU dropout (`CPUDropout` in vaswani_hf/kernels_vaswani.py, swapped in for `nn.Dropout` by
`training_fast_paths`) draws one 64-bit random number per four elements and applies the mask as a float product; the
baseline is what runs on a GPU or under `torch.compile`: `F.dropout` (torch's `bernoulli_`). Both run the same model,
batch and optimizer with every other fast path of the step; the order alternates every repetition and the script prints
the median step of each and their ratio (> 1: the CPU path is faster), the median of the per-repetition ratios beside
it.

    python benchmarks/bench_dropout.py                      # paper base dims, the benchmark's 64x32 random batch
    python benchmarks/bench_dropout.py --d-model 256 --layers 3 --heads 4 --d-ff 1024   # the cpu preset's dims
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import benchmark  # noqa: E402

from vaswani_hf import kernels_vaswani  # noqa: E402

SHIPPED = {"cpu_dropout": kernels_vaswani.cpu_dropout}
BASELINE = {"cpu_dropout": lambda x, p, training=True: F.dropout(x, p=p, training=training)}


def use(functions: dict) -> None:
    for name, function in functions.items():
        setattr(kernels_vaswani, name, function)


def main(argv=None) -> dict:
    args = benchmark.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = benchmark.build_model("ours", args).train()
    optimizer = benchmark.make_optimizer(model)
    batch = benchmark.make_batch(args, args.batch_tokens)
    variants = {"torch": BASELINE, "cpu": SHIPPED}
    times = {name: [] for name in variants}
    try:
        for name, functions in variants.items():  # one untimed step each
            use(functions)
            benchmark.training_step("ours", model, optimizer, batch, args)
        for rep in range(2 * args.train_reps):
            for name in (list(variants) if rep % 2 == 0 else list(variants)[::-1]):
                use(variants[name])
                start = time.perf_counter()
                benchmark.training_step("ours", model, optimizer, batch, args)
                times[name].append(time.perf_counter() - start)
    finally:
        use(SHIPPED)
    medians = {name: statistics.median(values) for name, values in times.items()}
    paired = statistics.median(t / c for t, c in zip(times["torch"], times["cpu"], strict=True))
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
          f"d_model {args.d_model}, {args.layers}+{args.layers} layers, "
          f"batch {tuple(batch['labels'].shape)}")
    print(f"step, F.dropout (torch): {medians['torch']:.3f} s   CPUDropout: {medians['cpu']:.3f} s   "
          f"torch/cpu {medians['torch'] / medians['cpu']:.3f} (paired {paired:.3f})")
    return {"seconds": times, "ratio": medians["torch"] / medians["cpu"], "ratio_paired": paired}


if __name__ == "__main__":
    main()
