"""Time the main job's training step on real Multi30k batches, each of its own shape, as vaswani-train runs it.

The step of `benchmarks/benchmark.py --main-job` repeats one random batch, so every product meets shapes it has met
before. A run's token-budget batches bring new row counts every step, and on a CPU whose bf16 products run in oneDNN
each new shape costs a compiled kernel (docs/performance.md, "Row counts that recur"). This script trains the `cpu`
preset's model on the first `--steps` batches of its run (its joint BPE, token budget and shuffled batch order, seed
1), in the precision the planner would take on this CPU unless told (`--precision`), inside `training_fast_paths`,
with torch's fused Adam, the oneDNN caches bounded and glibc keeping freed memory as vaswani-train sets them
(`start_process`); `--long-run-dropout` adds the preset's dropout on the attention probabilities and after the FFN's
ReLU, which a run that plans enough updates trains with. It prints the median step after `--warmup` steps, the
training tokens per second (source + target tokens without padding, as vaswani-train's metrics count them) and the
process's peak RSS, and writes them as JSON with the machine and versions.

    python benchmarks/bench_real_steps.py --steps 80 --long-run-dropout --output real_steps.json

Comparing two commits: run this file from each tree in turn (`git worktree add ../before <commit>`, copy the file
there if it is older), alternating, on an otherwise idle machine. Where the commits differ in
vaswani_hf/kernels_vaswani.py alone, `--baseline-kernels` compares them in one process, which a machine whose speed
drifts from minute to minute resolves far better: every batch is trained on twice, once with this tree's kernels and
once with that file's (its functions and classes put in their place, the installed modules' classes included), the
order alternating from batch to batch; it prints both medians and the median of the per-batch ratios (baseline /
this tree: > 1 means this tree's step is faster).

    git show 5078ca1:vaswani_hf/kernels_vaswani.py > /tmp/kernels_before.py
    python benchmarks/bench_real_steps.py --steps 80 --long-run-dropout --baseline-kernels /tmp/kernels_before.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from vaswani_training.lib.run import start_process  # noqa: E402

start_process()  # before the first oneDNN product: the caches' bound is read then

import torch  # noqa: E402
import transformers  # noqa: E402
from cpu_levers import batches, timed_step, timed_steps  # noqa: E402
from transformers import AttentionInterface  # noqa: E402

from vaswani_hf import fast_paths_vaswani, kernels_vaswani  # noqa: E402
from vaswani_hf.fast_paths_vaswani import training_fast_paths  # noqa: E402
from vaswani_hf.schedule import paper_adam  # noqa: E402
from vaswani_training.lib.arguments import RecipeArguments  # noqa: E402
from vaswani_training.lib.dropout import set_dropout  # noqa: E402
from vaswani_training.lib.precision import cpu_precision  # noqa: E402
from vaswani_training.lib.prepare import build_model  # noqa: E402


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def code_commit() -> str:
    """The commit of the tree this file runs from, with "+changes" when it differs from it."""
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return commit + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


_IMPORTED = {name for name, value in vars(fast_paths_vaswani).items()
             if not name.startswith("__") and value is getattr(kernels_vaswani, name, None)}


def kernel_sets(path: str) -> tuple[dict, dict]:
    """The names of vaswani_hf/kernels_vaswani.py bound to this tree's objects and to those of the kernels file at
    `path` (loaded as a module of its own; names it lacks keep this tree's)."""
    spec = importlib.util.spec_from_file_location("baseline_kernels_vaswani", path)
    baseline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baseline)  # registers its own "vaswani_sdpa": `use` registers the set in use each step
    names = [name for name in vars(kernels_vaswani) if not name.startswith("__")]
    shipped = {name: getattr(kernels_vaswani, name) for name in names}
    return shipped, {name: getattr(baseline, name, shipped[name]) for name in names}


def use(kernels: dict, model: torch.nn.Module) -> None:
    """Put a set of `kernel_sets` in place: the module's names (and those fast_paths_vaswani.py imported from it, its
    test of the output projection's class included), "vaswani_sdpa", and the classes of installed modules."""
    for name, value in kernels.items():
        setattr(kernels_vaswani, name, value)
        if name in _IMPORTED:
            setattr(fast_paths_vaswani, name, value)
    AttentionInterface.register("vaswani_sdpa", kernels["vaswani_sdpa"])
    for module in model.modules():
        cls = kernels.get(type(module).__name__)
        if isinstance(cls, type) and type(module).__module__.endswith("kernels_vaswani"):
            module.__class__ = cls


def paired_steps(model, optimizer, data, bf16: bool, kernels: dict[str, dict]) -> dict[str, list[float]]:
    """Each batch of `data` trained on once with each set of `kernels` (order alternating), as `timed_steps` steps:
    the seconds of each step, by set."""
    times = {name: [] for name in kernels}
    with training_fast_paths(model, 0.1):
        for i, batch in enumerate(data):
            for name in (list(kernels) if i % 2 == 0 else list(kernels)[::-1]):
                use(kernels[name], model)
                times[name].append(timed_step(model, optimizer, batch, bf16))
        use(kernels["this tree"], model)
    return times


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80, help="real batches trained on, warm-up included")
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of the median")
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                        help="auto: what vaswani-train's planner takes on this CPU")
    parser.add_argument("--long-run-dropout", action="store_true",
                        help="attention and activation dropout 0.1, as a run that plans enough updates trains")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (default: torch's)")
    parser.add_argument("--baseline-kernels", default=None, metavar="FILE",
                        help="another kernels_vaswani.py: alternate batch by batch with it in one process")
    parser.add_argument("--output", default=None, help="JSON file for the result")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must be more than --warmup ({args.warmup})")
    if args.threads:
        torch.set_num_threads(args.threads)
    model_args, preset, tokenizer, data = batches(args.steps)
    bf16 = args.precision == "bf16"
    if args.precision == "auto":
        bf16 = cpu_precision(RecipeArguments(), model_args, preset)[0]
    torch.manual_seed(0)
    model = build_model(model_args, preset, tokenizer).train()
    if args.long_run_dropout:
        set_dropout(model, attention_dropout=0.1, activation_dropout=0.1)
    optimizer = paper_adam(model.parameters(), lr=1e-4, fused=True)
    paired = None
    if args.baseline_kernels:
        shipped, baseline = kernel_sets(args.baseline_kernels)
        times = paired_steps(model, optimizer, data, bf16, {"this tree": shipped, "baseline": baseline})
        timed, base = times["this tree"][args.warmup:], times["baseline"][args.warmup:]
        paired = {"baseline_kernels": args.baseline_kernels,
                  "baseline_median_step_s": round(statistics.median(base), 4),
                  "ratio_of_medians": round(statistics.median(base) / statistics.median(timed), 4),
                  "median_paired_ratio": round(statistics.median(b / t for b, t in zip(base, timed)), 4)}
    else:
        timed = timed_steps(model, optimizer, data, bf16)[args.warmup:]
    tokens = [int(b["attention_mask"].sum() + b["labels"].ne(-100).sum()) for b in data[args.warmup:]]
    result = {
        "command": "python benchmarks/bench_real_steps.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "code": code_commit(),
        "cpu": cpu_model_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
        "precision": "bf16 autocast" if bf16 else "fp32", "long_run_dropout": args.long_run_dropout,
        "steps_timed": len(timed), "median_step_s": round(statistics.median(timed), 4),
        "mean_step_s": round(statistics.mean(timed), 4),
        "tokens_per_second": round(sum(tokens) / sum(timed), 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }
    print(f"{result['code']}, {result['cpu']} ({result['cpu_capability']}, {result['threads']} threads), "
          f"{result['precision']}"
          f"{', long-run dropout' if args.long_run_dropout else ''}: median step {result['median_step_s'] * 1e3:.1f} ms"
          f" over {len(timed)} real batches, {result['tokens_per_second']:.0f} tokens/s, peak RSS "
          f"{result['peak_rss_mib']} MiB", flush=True)
    if paired:
        result["paired"] = paired
        print(f"baseline kernels ({args.baseline_kernels}), the same batches alternating: median step "
              f"{paired['baseline_median_step_s'] * 1e3:.1f} ms; baseline / this tree: {paired['ratio_of_medians']:.3f}"
              f" (medians), {paired['median_paired_ratio']:.3f} (median of the per-batch ratios)", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
