"""Where a CUDA training step spends its time: torch.profiler over a few steps of ours or MarianMTModel.

Prints, per step: the wall time, the GPU kernel time and the share of the wall time the GPU computes, the number of
kernel launches, the host synchronizations (cudaStreamSynchronize / cudaDeviceSynchronize / cudaMemcpy calls that
wait for the GPU), and the operators that took the most GPU time. The step is benchmarks/benchmark.py's
(forward, backward, fused Adam, zero_grad; its `float(loss)` is one deliberate sync a step), on its random batch.

    python benchmarks/profile_cuda_step.py --model ours --batch-tokens 25000 --dtype bf16
    python benchmarks/profile_cuda_step.py --model marian --batch-tokens 25000 --dtype bf16

Every benchmark.py size and input flag is accepted (--d-model, --layers, --vocab-size, --src-len, ...).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark  # noqa: E402

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync",
              "cudaEventSynchronize")


def launches_and_syncs(events) -> tuple[int, dict[str, int]]:
    """From `profile.key_averages()`: the kernel launches, and the calls of each of `SYNC_CALLS` that occurred."""
    launches = sum(event.count for event in events if event.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
    return launches, {event.key: event.count for event in events if event.key in SYNC_CALLS}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=benchmark.MODELS, default="ours")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps (after 3 warm-up steps)")
    parser.add_argument("--top", type=int, default=15, help="operators listed")
    own, rest = parser.parse_known_args(argv)
    args = benchmark.parse_args(["--device", "cuda", *rest])
    torch.manual_seed(args.seed)
    model = benchmark.build_model(own.model, args).train()
    optimizer = benchmark.make_optimizer(model)
    batch = benchmark.make_batch(args, args.batch_tokens)
    tokens = int(batch["labels"].ne(-100).sum())
    for _ in range(3):
        benchmark.training_step(own.model, model, optimizer, batch, args)
    torch.cuda.synchronize()
    walls = []
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(own.steps):
            start = time.perf_counter()
            benchmark.training_step(own.model, model, optimizer, batch, args)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
    events = profile.key_averages()
    kernel_us = sum(event.self_device_time_total for event in events if event.device_type.name == "CUDA")
    launches, syncs = launches_and_syncs(events)
    syncs = {key: count // own.steps for key, count in syncs.items()}
    wall = statistics.median(walls)
    per_step_kernel = kernel_us / 1e6 / own.steps
    print(f"{own.model}: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, batch "
          f"{list(batch['labels'].shape)} ({tokens} target tokens), d_model {args.d_model}, {args.layers}+"
          f"{args.layers} layers, vocab {args.vocab_size}")
    print(f"wall {wall * 1e3:.1f} ms/step (median of {own.steps}), GPU kernels {per_step_kernel * 1e3:.1f} ms/step "
          f"({100 * per_step_kernel / wall:.0f} % of the wall time), {launches / own.steps:.0f} kernel launches/step, "
          f"host syncs/step: {syncs or 'none'}")
    sort = "self_device_time_total"
    print(events.table(sort_by=sort, row_limit=own.top, max_name_column_width=60))
    return {"wall_s": wall, "kernel_s": per_step_kernel, "launches": launches / own.steps, "syncs": syncs}


if __name__ == "__main__":
    main()
