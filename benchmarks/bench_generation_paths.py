"""Beam search with and without leaving finished sentences out of the decoder's batch, against MarianMTModel.

`VaswaniForConditionalGeneration.skip_finished_sentences` (True; the default None: on a CPU only) lets decoding drop the
sentences it has finished (`generation_vaswani.FinishedSentenceSkipping`); its bookkeeping reads, once a step, which
sentences are open, which makes the host wait for the device on a GPU. This script times `generate()` (beam 4,
length penalty 0.6) of one model with the switch on and off, and MarianMTModel of the same size, alternating the
three every repetition, at each `--batches` size, on benchmark.py's random inputs and random weights: with
`min_new_tokens = max_new_tokens` no sentence finishes early, so the switch can only cost (its bookkeeping); the
gain it buys on real data, where sentences end at different lengths, is measured by benchmark.py's CPU figures.

    python benchmarks/bench_generation_paths.py --device cuda --batches 4 64
    python benchmarks/bench_generation_paths.py --batches 4 16            # CPU

Every benchmark.py size flag is accepted (--d-model, --layers, --vocab-size, --gen-new-tokens, --gen-reps, ...).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark  # noqa: E402
from profile_cuda_step import launches_and_syncs  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 64], help="sentences per generate() call")
    parser.add_argument("--profile", action="store_true",
                        help="also count, per generated token, the kernel launches and host synchronizations of one "
                             "generate() of each variant at the first batch size (CUDA)")
    own, rest = parser.parse_known_args(argv)
    args = benchmark.parse_args(rest)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    ours = benchmark.build_model("ours", args).eval()
    marian = benchmark.build_model("marian", args).eval()
    device = benchmark.device_name(args)
    print(f"{device}, torch {torch.__version__}, {args.dtype}, d_model {args.d_model}, {args.layers}+{args.layers} "
          f"layers, vocab {args.vocab_size}, beam 4, {args.gen_new_tokens} new tokens, {args.gen_reps} repetitions")
    results = {}
    for batch in own.batches:
        inputs = benchmark.generation_inputs(args, batch)
        config = benchmark.generation_config(args, args.gen_new_tokens, 4)
        run_ours = benchmark.generate_fn(ours, inputs, config, args)

        def skipping(on: bool):
            def run():
                ours.skip_finished_sentences = on
                run_ours()
            return run

        times = benchmark.interleaved({"ours, skipping": skipping(True), "ours, no skipping": skipping(False),
                                       "marian": benchmark.generate_fn(marian, inputs, config, args)},
                                      args.gen_reps, 1, args)
        ours.skip_finished_sentences = None  # the default
        medians = {name: statistics.median(measured["wall"]) for name, measured in times.items()}
        results[batch] = medians
        print(f"batch {batch:4d}: " + ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in medians.items())
              + f"; Marian / ours: skipping {medians['marian'] / medians['ours, skipping']:.2f}, no skipping "
                f"{medians['marian'] / medians['ours, no skipping']:.2f}", flush=True)
    if own.profile and args.device == "cuda":
        inputs = benchmark.generation_inputs(args, own.batches[0])
        config = benchmark.generation_config(args, args.gen_new_tokens, 4)
        for name, model, skip in (("ours, skipping", ours, True), ("ours, no skipping", ours, False),
                                  ("marian", marian, None)):
            if skip is not None:
                model.skip_finished_sentences = skip
            run = benchmark.generate_fn(model, inputs, config, args)
            run()
            torch.cuda.synchronize()
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as profile:
                run()
                torch.cuda.synchronize()
            launches, syncs = launches_and_syncs(profile.key_averages())
            counts = {"launches": launches, **syncs}
            print(f"{name}: per generated token " + ", ".join(
                f"{key} {value / args.gen_new_tokens:.1f}" for key, value in counts.items()), flush=True)
        ours.skip_finished_sentences = None  # the default
    return results


if __name__ == "__main__":
    main()
