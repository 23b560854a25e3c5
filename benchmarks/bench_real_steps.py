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
there if it is older), alternating, on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
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
from cpu_levers import batches, timed_steps  # noqa: E402

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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80, help="real batches trained on, warm-up included")
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of the median")
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                        help="auto: what vaswani-train's planner takes on this CPU")
    parser.add_argument("--long-run-dropout", action="store_true",
                        help="attention and activation dropout 0.1, as a run that plans enough updates trains")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (default: torch's)")
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
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
