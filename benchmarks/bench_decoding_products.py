"""The linear layers of one decoding step, by library: the products `generate()` runs on a CPU in fp32, with the
weights packed as `kernels_vaswani.pack_for_inference` packs them (MKL's packed sgemm, oneDNN's blocked layout) and
with torch's default BLAS call (`F.linear`), at the row counts of a beam search (batch x beams, shrinking as
sentences finish).

One step is every linear map of the decoder in order (per layer: self-attention q|k|v stacked, its output, the
encoder-decoder attention's query and output, fc1, fc2) and the output projection, each layer with its own weights,
so that a weight is read back from memory as in `generate()` rather than from the cache of a loop over one product.
Each library runs `--steps` steps per row count after `--warmup`, the libraries alternating per row count; printed:
milliseconds a step per library and each library's time over the oneDNN packed path's (the previous default).

    python benchmarks/bench_decoding_products.py --threads 1            # the cpu preset's dims
    python benchmarks/bench_decoding_products.py --preset base --threads 1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from vaswani_hf import kernels_vaswani  # noqa: E402

PRESETS = {"cpu": dict(d_model=256, d_ff=1024, layers=3), "base": dict(d_model=512, d_ff=2048, layers=6)}


def step_shapes(d_model: int, d_ff: int, layers: int, vocab_size: int) -> list[tuple[int, int]]:
    """(in, out) of each product of one decoder step, in order."""
    per_layer = [(d_model, 3 * d_model), (d_model, d_model), (d_model, d_model), (d_model, d_model),
                 (d_model, d_ff), (d_ff, d_model)]
    return per_layer * layers + [(d_model, vocab_size)]


def bench(shapes, rows_list, steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    weights = [torch.randn(n, k) / k**0.5 for k, n in shapes]
    biases = [torch.randn(n) for _, n in shapes]
    libraries = {"blas": None}
    for library, available in (("onednn", kernels_vaswani.has_onednn_linear),
                               ("mkl", kernels_vaswani.has_mkl_packed_linear)):
        if available():
            libraries[library] = [kernels_vaswani.pack_for_inference(w, library) for w in weights]
    results = {}
    with torch.inference_mode():
        for rows in rows_list:
            inputs = {width: torch.randn(rows, width) for width in {k for k, _ in shapes}}

            def one_step(library):
                packed = libraries[library]
                for i, (k, _) in enumerate(shapes):
                    if packed is None:
                        F.linear(inputs[k], weights[i], biases[i])
                    else:
                        kernels_vaswani.packed_linear(inputs[k], packed[i], biases[i])

            seconds = {name: [] for name in libraries}
            for name in libraries:
                for _ in range(warmup):
                    one_step(name)
            for _ in range(steps):
                for name in libraries:  # alternating, step by step
                    start = time.perf_counter()
                    one_step(name)
                    seconds[name].append(time.perf_counter() - start)
            ms = {name: 1e3 * sorted(times)[len(times) // 2] for name, times in seconds.items()}
            flops = 2 * rows * sum(k * n for k, n in shapes)
            results[rows] = {"ms_per_step": ms, "gflops": {name: flops / t / 1e6 for name, t in ms.items()},
                             "over_onednn": {name: t / ms["onednn"] for name, t in ms.items()} if "onednn" in ms
                             else None}
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--vocab_size", type=int, default=8000)
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 32, 64, 96, 128])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--output", help="Also write the results as JSON here.")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = step_shapes(**PRESETS[args.preset], vocab_size=args.vocab_size)
    results = bench(shapes, args.rows, args.steps, args.warmup)
    names = list(next(iter(results.values()))["ms_per_step"])
    print(f"{args.preset} preset, vocabulary {args.vocab_size}, {torch.get_num_threads()} thread(s); "
          "ms per decoder step's products (median), and / oneDNN packed")
    for rows, result in results.items():
        cells = "  ".join(f"{name} {result['ms_per_step'][name]:.2f}"
                          + (f" ({result['over_onednn'][name]:.2f})" if result["over_onednn"] else "")
                          for name in names)
        print(f"rows {rows:4d}: {cells}")
    report = {"preset": args.preset, "vocab_size": args.vocab_size, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "results": results}
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


if __name__ == "__main__":
    main()
