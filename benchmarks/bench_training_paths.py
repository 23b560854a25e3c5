"""Time a CPU fp32 training step with and without the attention and loss paths the training commands take there,
alternating in one process.

The training step of the commands (`training_fast_paths` in vaswani_hf/fast_paths_vaswani.py) runs attention in
torch's SDPA (its CPU flash kernel reads the heads as strided views; "vaswani_sdpa" in vaswani_hf/kernels_vaswani.py)
and the output projection with the label-smoothed loss as one function (`cpu_projected_cross_entropy`). The baseline
is the other path of each: attention as plain matmuls and a softmax (`cpu_attention_forward`, what the step runs in
bf16 or with attention dropout) and `F.cross_entropy` on the logits (what the step runs where the fused loss declines).
Four variants (baseline, each change alone, both: the shipped default) run the same model, batch and optimizer; the
order rotates every repetition, and the script prints each variant's median step and its ratio to the baseline (> 1:
faster than the baseline), with the median of the per-repetition ratios beside it.

    python benchmarks/bench_training_paths.py                # paper base dims, the benchmark's 64x32 random batch
    python benchmarks/bench_training_paths.py --d-model 256 --layers 3 --heads 4 --d-ff 1024   # the cpu preset's dims
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import benchmark  # noqa: E402

from vaswani_hf import fast_paths_vaswani, kernels_vaswani  # noqa: E402

SHIPPED = {"attention": kernels_vaswani.sdpa_attention_forward, "loss": fast_paths_vaswani.cpu_projected_cross_entropy}
BASELINE = {"attention": kernels_vaswani.cpu_attention_forward, "loss": lambda *args: None}  # None: not fused

# variant: (attention kernel, loss); the baseline first, the shipped default last
VARIANTS = {
    "baseline (plain attention, F.cross_entropy)": ("plain", "unfused"),
    "SDPA only": ("sdpa", "unfused"),
    "fused loss only": ("plain", "fused"),
    "SDPA + fused loss (default)": ("sdpa", "fused"),
}


def use(attention: str, loss: str) -> None:
    """The variant's kernels in the places the training step looks them up."""
    kernels_vaswani.sdpa_attention_forward = SHIPPED["attention"] if attention == "sdpa" else BASELINE["attention"]
    fast_paths_vaswani.cpu_projected_cross_entropy = SHIPPED["loss"] if loss == "fused" else BASELINE["loss"]


def main(argv=None) -> dict:
    args = benchmark.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kept = False
    if args.malloc == "keep":  # as vaswani-train and benchmark.py run
        from vaswani_training.lib.cpu_tuning import keep_freed_memory

        kept = keep_freed_memory()
    if args.label_smoothing == 0.0:
        args.label_smoothing = 0.1  # the paper's (§5.4), as the training recipe passes it
    torch.manual_seed(args.seed)
    model = benchmark.build_model("ours", args).train()
    optimizer = benchmark.make_optimizer(model)
    batch = benchmark.make_batch(args, args.batch_tokens)
    names = list(VARIANTS)
    times = {name: [] for name in names}

    def run(name):
        use(*VARIANTS[name])
        start = time.perf_counter()
        benchmark.training_step("ours", model, optimizer, batch, args)
        return time.perf_counter() - start

    try:
        for name in names:  # one untimed step each
            run(name)
        for rep in range(2 * args.train_reps):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(run(name))
    finally:
        use("sdpa", "fused")
    baseline = names[0]
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
          f"d_model {args.d_model}, {args.layers}+{args.layers} layers, batch {tuple(batch['labels'].shape)}, "
          f"label smoothing {args.label_smoothing}; glibc malloc keeps freed memory: {'yes' if kept else 'no'}")
    result = {"seconds": times, "ratio": {}, "ratio_paired": {}}
    for name in names:
        median = statistics.median(times[name])
        ratio = statistics.median(times[baseline]) / median
        paired = statistics.median(b / t for b, t in zip(times[baseline], times[name], strict=True))
        result["ratio"][name], result["ratio_paired"][name] = ratio, paired
        print(f"  {name:45s} {median:.3f} s   baseline/this {ratio:.3f} (paired {paired:.3f})")
    return result


if __name__ == "__main__":
    main()
