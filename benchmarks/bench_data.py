"""The data path at WMT14 En-De's size, beside the `run_translation.py`-style preprocessing, measured in one run.

For each corpus size (default 1M, 4.5M and 9M pairs) the script writes a synthetic corpus in the Hub's `wmt14` layout
from real sentences (`vaswani_training.synthetic`: 1-3 joined Multi30k pairs, ~23 words a sentence, as WMT14's), then
runs each variant in a fresh process and reports wall times and peak memory:

* `ours` — what `vaswani-train --dataset_name FOLDER --source_lang en --target_lang de --vocab_size 37000
  --preprocessing_num_workers 2` prepares before its first step (`vaswani_training.lib.prepare.prepare_data`: read and
  clean the splits, train the 37k joint BPE, tokenize, then the token-budget batches of 25,000 tokens), first with
  empty caches (`cold`), then again with the caches of the first (`cached`: process start to the first batch);
* `baseline` — transformers' `examples/pytorch/translation/run_translation.py` preprocessing on the same corpus and
  tokenizer: `load_dataset(FOLDER)`, `dataset.map(preprocess_function, batched=True, num_proc=2)` with
  `tokenizer(inputs, text_target=targets, max_length=256, truncation=True)`, then padded batches of a fixed number of
  sentences (`DataCollatorForSeq2Seq`, shuffled), as many sentences as hold 25,000 real tokens on average; cold and
  cached;
* `streaming` — `StreamingTokenBudgetBatches` over the whole training file, one pass (`--streaming`), with the BPE of
  `ours`: its peak memory should not grow with the corpus.

Loader throughput is tokens a second (source + target, padded slots as the model sees them, and real tokens) of
the first `--loader-batches` 25,000-token batches through a `DataLoader`, one process: ours with `PaddedBatches` (what
both training loops use) and, beside it, with `DataCollatorForSeq2Seq` on the same batches; the baseline with
`DataCollatorForSeq2Seq` on its fixed-size batches. Peak RSS is `getrusage`'s: the process itself, and the largest of
its finished worker processes.

    python benchmarks/bench_data.py --output benchmarks/results/bench_data.json                # all three sizes
    python benchmarks/bench_data.py --pairs 1000000 --variants ours baseline                   # one size, two variants

The corpora and caches go under `--workdir` (default /tmp/vaswani_bench_data; about 1.6 GB a 4.5M-pair corpus, and as
much again for each cache).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 25_000
VOCAB_SIZE = 37_000
WORKERS = 2
SOURCE, TARGET = "en", "de"


def peak_rss_mib() -> dict[str, float]:
    """Peak resident memory of this process and of its largest finished child (Linux: ru_maxrss is in KiB)."""
    return {"self": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "children": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)}


def loader_throughput(dataset, batch_sampler_or_size, collator, batches: int) -> dict[str, float]:
    """Tokens a second of the first `batches` batches a DataLoader yields (padded slots and real tokens, both sides)."""
    from torch.utils.data import DataLoader

    if isinstance(batch_sampler_or_size, int):
        loader = DataLoader(dataset, batch_size=batch_sampler_or_size, shuffle=True, collate_fn=collator)
    else:
        loader = DataLoader(dataset, batch_sampler=batch_sampler_or_size, collate_fn=collator)
    padded = real = seen = 0
    start = time.perf_counter()
    for batch in loader:
        padded += batch["input_ids"].numel() + batch["labels"].numel()
        real += int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum())
        seen += 1
        if seen == batches:
            break
    seconds = time.perf_counter() - start
    return {"batches": seen, "seconds": round(seconds, 3), "padded_tokens_per_s": round(padded / seconds),
            "real_tokens_per_s": round(real / seconds), "padding": round(1 - real / padded, 4)}


def run_ours(corpus: Path, cache: Path, loader_batches: int, started: float) -> dict:
    """vaswani-train's preparation, timed step by step."""
    from transformers import DataCollatorForSeq2Seq

    from vaswani_hf.data import PaddedBatches, tokenize_dataset
    from vaswani_training.lib.arguments import DataArguments, ModelArguments
    from vaswani_training.lib.prepare import get_tokenizer, load_raw_datasets, token_budget_sampler

    data_args = DataArguments(dataset_name=str(corpus), source_lang=SOURCE, target_lang=TARGET,
                              preprocessing_num_workers=WORKERS)
    model_args = ModelArguments(vocab_size=VOCAB_SIZE, cache_dir=str(cache / "vaswani"))
    times = {}
    clock = time.perf_counter()
    raw = load_raw_datasets(data_args)
    times["read"] = time.perf_counter() - clock
    clock = time.perf_counter()
    tokenizer = get_tokenizer(model_args, raw["train"], data_args, VOCAB_SIZE)
    times["bpe"] = time.perf_counter() - clock
    clock = time.perf_counter()
    tokenized = tokenize_dataset(raw, tokenizer, SOURCE, TARGET, max_length=data_args.max_source_length,
                                 max_target_length=data_args.max_target_length, num_proc=WORKERS)
    times["tokenize"] = time.perf_counter() - clock
    clock = time.perf_counter()
    sampler = token_budget_sampler(tokenized["train"], MAX_TOKENS, shuffle=True, seed=0)
    first = next(iter(sampler))
    times["batch"] = time.perf_counter() - clock
    to_first_batch = time.perf_counter() - started
    memory = peak_rss_mib()  # before the throughput loop, whose batches are not preparation
    batches = PaddedBatches(tokenized["train"], tokenizer.pad_token_id)
    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)
    return {"seconds": {k: round(v, 2) for k, v in times.items()}, "prepare_seconds": round(sum(times.values()), 2),
            "process_start_to_first_batch_seconds": round(to_first_batch, 2), "peak_rss_mib": memory,
            "pairs": len(tokenized["train"]), "batches": len(sampler), "first_batch_pairs": len(first),
            "loader": loader_throughput(batches, sampler, batches.collate, loader_batches),
            "loader with DataCollatorForSeq2Seq": loader_throughput(tokenized["train"], sampler, collator,
                                                                    loader_batches)}


def run_baseline(corpus: Path, cache: Path, tokenizer_dir: str, loader_batches: int, started: float) -> dict:
    """run_translation.py's preprocess_function over datasets.map, then fixed-size padded batches."""
    import datasets
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    times = {}
    clock = time.perf_counter()
    raw = datasets.load_dataset(str(corpus))
    times["read"] = time.perf_counter() - clock

    def preprocess_function(examples):  # as run_translation.py writes it (no prefix: not a T5 model)
        inputs = [ex[SOURCE] for ex in examples["translation"]]
        targets = [ex[TARGET] for ex in examples["translation"]]
        return tokenizer(inputs, text_target=targets, max_length=256, truncation=True)

    clock = time.perf_counter()
    train = raw["train"].map(preprocess_function, batched=True, num_proc=WORKERS, remove_columns=["translation"],
                             desc="Running tokenizer on train dataset")
    times["tokenize"] = time.perf_counter() - clock
    clock = time.perf_counter()
    mean_tokens = sum(len(x) for x in train.select(range(min(10_000, len(train))))["input_ids"]) / min(10_000,
                                                                                                       len(train))
    batch_size = max(1, round(MAX_TOKENS / mean_tokens))
    times["batch"] = time.perf_counter() - clock
    to_first_batch = time.perf_counter() - started
    memory = peak_rss_mib()
    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)
    return {"seconds": {k: round(v, 2) for k, v in times.items()}, "prepare_seconds": round(sum(times.values()), 2),
            "process_start_to_first_batch_seconds": round(to_first_batch, 2), "peak_rss_mib": memory,
            "pairs": len(train), "batch_size": batch_size,
            "loader": loader_throughput(train, batch_size, collator, loader_batches)}


def run_streaming(corpus: Path, tokenizer_dir: str) -> dict:
    """One pass of the streaming batches over the whole training file."""
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    from vaswani_hf.data import StreamingTokenBudgetBatches, stream_parallel_pairs

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    stream = StreamingTokenBudgetBatches(stream_parallel_pairs(corpus / "train.jsonl", SOURCE, TARGET), tokenizer,
                                         max_tokens=MAX_TOKENS, max_source_length=256, max_target_length=256)
    batches = tokens = 0
    clock = time.perf_counter()
    # two workers, as a run with --dataloader_num_workers 2: each prepares every other pool
    for batch in DataLoader(stream, batch_size=None, num_workers=WORKERS, collate_fn=lambda features: features):
        batches += 1
        tokens += sum(len(f["input_ids"]) + len(f["labels"]) for f in batch)
    seconds = time.perf_counter() - clock
    return {"seconds": round(seconds, 2), "batches": batches, "real_tokens_per_s": round(tokens / seconds),
            "peak_rss_mib": peak_rss_mib()}


def child(args) -> None:
    started = time.perf_counter() - (time.time() - args.launched)  # from the moment the parent started this process
    corpus, cache = Path(args.corpus), Path(args.cache)
    if args.child == "ours":
        result = run_ours(corpus, cache, args.loader_batches, started)
    elif args.child == "baseline":
        result = run_baseline(corpus, cache, args.tokenizer, args.loader_batches, started)
    else:
        result = run_streaming(corpus, args.tokenizer)
    print(json.dumps(result))


def in_child(variant: str, corpus: Path, cache: Path, args, tokenizer: str | None = None) -> dict:
    """Run one variant in a fresh Python (its own peak memory), with its own datasets cache."""
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache / "datasets"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    command = [sys.executable, __file__, "--child", variant, "--corpus", str(corpus), "--cache", str(cache),
               "--loader-batches", str(args.loader_batches), "--launched", repr(time.time())]
    command += ["--tokenizer", tokenizer] if tokenizer else []
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{variant} on {corpus} failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_seconds"] = round(time.perf_counter() - start, 2)
    print(f"  {variant:<9} {json.dumps(result)}", flush=True)
    return result


def corpus_of(size: int, workdir: Path) -> Path:
    from vaswani_training.synthetic import write_synthetic_corpus

    folder = workdir / f"corpus-{size}"
    done = folder / ".complete"
    if not done.is_file():
        start = time.perf_counter()
        written = write_synthetic_corpus(folder, size, source_lang=SOURCE, target_lang=TARGET)
        done.write_text(json.dumps(written.mean_words))
        print(f"corpus of {size:,} pairs written in {time.perf_counter() - start:.0f} s: {folder}", flush=True)
    return folder


def ratio(baseline: float, ours: float) -> float:
    return round(baseline / ours, 2) if ours else float("nan")


def versions() -> dict[str, str]:
    import datasets
    import tokenizers
    import torch
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "datasets": datasets.__version__, "tokenizers": tokenizers.__version__, "cpu": cpu,
            "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, nargs="+", default=[1_000_000, 4_500_000, 9_000_000])
    parser.add_argument("--variants", nargs="+", default=["ours", "baseline", "streaming"],
                        choices=["ours", "baseline", "streaming"])
    parser.add_argument("--workdir", default="/tmp/vaswani_bench_data")
    parser.add_argument("--loader-batches", type=int, default=200)
    parser.add_argument("--keep-caches", action="store_true", help="keep each size's caches (default: removed)")
    parser.add_argument("--output", help="JSON file for all figures")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help="a saved BPE for the streaming variant alone (e.g. "
                                            "WORKDIR/tokenizer-4500000 of an earlier run) instead of training one")
    parser.add_argument("--launched", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results = {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "versions": versions(),
               "max_tokens": MAX_TOKENS, "vocab_size": VOCAB_SIZE, "workers": WORKERS, "sizes": {}}
    print(json.dumps(results["versions"]), flush=True)
    for size in args.pairs:
        corpus = corpus_of(size, workdir)
        figures, tokenizer = {}, args.tokenizer
        for variant in ("ours", "baseline"):  # ours first: the others use its BPE
            if variant not in args.variants and (variant == "baseline" or args.tokenizer):
                continue
            cache = workdir / f"cache-{variant}-{size}"
            shutil.rmtree(cache, ignore_errors=True)
            cold = in_child(variant, corpus, cache, args, tokenizer)
            cached = in_child(variant, corpus, cache, args, tokenizer)
            figures[variant] = {"cold": cold, "cached": cached}
            if variant == "ours":
                (trained,) = (cache / "vaswani" / "tokenizers").iterdir()
                kept = workdir / f"tokenizer-{size}"
                shutil.rmtree(kept, ignore_errors=True)
                tokenizer = str(shutil.copytree(trained, kept))
        if "streaming" in args.variants:
            figures["streaming"] = in_child("streaming", corpus, workdir / "cache-streaming", args, tokenizer)
        if "ours" in figures and "baseline" in figures:
            ours, base = figures["ours"], figures["baseline"]
            figures["ratios (baseline / ours; > 1: ours is faster or smaller)"] = {
                "tokenize_seconds": ratio(base["cold"]["seconds"]["tokenize"], ours["cold"]["seconds"]["tokenize"]),
                "cached_start_to_first_batch": ratio(base["cached"]["process_start_to_first_batch_seconds"],
                                                     ours["cached"]["process_start_to_first_batch_seconds"]),
                "peak_rss_self": ratio(base["cold"]["peak_rss_mib"]["self"], ours["cold"]["peak_rss_mib"]["self"]),
                "loader_real_tokens_per_s (ours / baseline)": ratio(ours["cold"]["loader"]["real_tokens_per_s"],
                                                                    base["cold"]["loader"]["real_tokens_per_s"]),
            }
        results["sizes"][str(size)] = figures
        if not args.keep_caches:
            for variant in ("ours", "baseline", "streaming"):
                shutil.rmtree(workdir / f"cache-{variant}-{size}", ignore_errors=True)
        if args.output:
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
