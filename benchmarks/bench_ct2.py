"""Translation speed of the model converted to CTranslate2 (float32 and int8) and of our model quantized to int8 in
PyTorch against our `generate()`, on the same inputs.

Two modes:

* `--model_dir DIR`: a trained model folder with its tokenizer; the inputs are the first `--sentences` German
  sentences of the shipped Multi30k test set, decoded as the model decides (beam `--num_beams`, length penalty 0.6,
  early stopping, at most the longest source of the batch + 50 tokens). Outputs of the float32 conversion are
  token-identical to ours (the script reports the fraction that agree), so both engines do the same work.
* otherwise a freshly initialized model of the given size (`--preset base` is the paper's base model with a
  vocabulary of `--vocab_size`; `--quick` a tiny one) fed random source ids; an untrained model never chooses
  `</s>`, so every output is forced to exactly `--new_tokens` tokens in both engines (`min_new_tokens` /
  `min_decoding_length`), which keeps the work equal.

Measurements alternate the engines (ours, torch int8, CT2 fp32, CT2 int8, then rotated) and report medians of
sentences per second, the ratios to ours and torch int8's ratio to CT2 int8; absolute numbers on a shared machine mean
little. All run on the CPU with the same number of threads (`--threads`, default torch's). CTranslate2 converts and
translates in a process of its own, timed around each request from this one: its bundled OpenMP runtime slows torch's
threads in a process where it has run. Torch int8 is our
`generate()` on `torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)` (int8 weights with a
scale per tensor, activations quantized per call); CT2 int8 is CTranslate2's `compute_type="int8"` on the float32
conversion (weights quantized when loading, the same as converting with `--quantization int8`).

    python benchmarks/bench_ct2.py --preset base --vocab_size 8000 --sentences 64 --new_tokens 30
    python benchmarks/bench_ct2.py --model_dir outputs/multi30k-de-en --sentences 200
    python benchmarks/bench_ct2.py --quick

From another script: `from benchmarks.bench_ct2 import bench_ct2; results = bench_ct2(model, tokenizer, ...)`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transformers.utils import logging as hf_logging  # noqa: E402

from vaswani_hf import VaswaniConfig, VaswaniForConditionalGeneration  # noqa: E402
from vaswani_hf.decoding.translate import map_batches  # noqa: E402

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
# "ours_side_by_side": our generate() on `threads` batches at a time, one torch thread each (`map_batches`, what
# translate_sentences does on a CPU); "ct2_float32_side_by_side": CTranslate2's own equivalent (inter_threads)
ENGINES = ("ours", "ours_side_by_side", "torch_int8", "ct2_float32", "ct2_float32_side_by_side", "ct2_int8")
PRESETS = {
    "base": dict(d_model=512, encoder_layers=6, decoder_layers=6, num_heads=8, d_ff=2048),
    "big": dict(d_model=1024, encoder_layers=6, decoder_layers=6, num_heads=16, d_ff=4096),
    "tiny": dict(d_model=64, encoder_layers=2, decoder_layers=2, num_heads=4, d_ff=128),
}


def _random_inputs(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(4, vocab_size, (count, length), generator=generator)
    rows[:, -1] = 2  # </s>
    return rows.tolist()


def bench_ct2(
    model: VaswaniForConditionalGeneration,
    tokenizer=None,
    inputs: list[list[int]] | None = None,
    *,
    sentences: list[str] | None = None,
    batch_size: int = 32,
    num_beams: int = 4,
    length_penalty: float = 0.6,
    new_tokens: int | None = None,
    threads: int | None = None,
    repetitions: int = 3,
    engines: tuple[str, ...] = ENGINES,
) -> dict:
    """Time our `generate()`, the same on the int8-quantized model and the CTranslate2 conversion on the same sources.

    Args:
        model: the model (converted in a temporary folder here; quantized to a copy for "torch_int8").
        tokenizer: its tokenizer, with `sentences`; or `None` with `inputs` (lists of ids ending in `</s>`).
        new_tokens: force exactly this many output tokens in every engine (for untrained models); `None` lets the
            model stop at `</s>` (at most the longest source of the batch + 50 tokens).
        threads: CPU threads for both engines (default `torch.get_num_threads()`).
    Returns:
        `{"sentences_per_second": {engine: median}, "ratio_to_ours": {...}, "agreement_with_ours": {...},
        "torch_int8_to_ct2_int8": ratio or None, "runs": {engine: [seconds, ...]}, ...}`; torch's thread count is
        restored.
    """
    previous = torch.get_num_threads()
    threads = threads or previous
    torch.set_num_threads(threads)
    try:
        return _bench_ct2(model, tokenizer, inputs, sentences, batch_size, num_beams, length_penalty, new_tokens,
                          threads, repetitions, engines)
    finally:
        torch.set_num_threads(previous)


def _bench_ct2(model, tokenizer, inputs, sentences, batch_size, num_beams, length_penalty, new_tokens, threads,
               repetitions, engines) -> dict:
    model = model.eval()
    if tokenizer is not None:
        inputs = tokenizer(list(sentences))["input_ids"]
        vocabulary = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        vocabulary += [f"<unused{i}>" for i in range(model.config.vocab_size - len(vocabulary))]
    else:
        vocabulary = ["<pad>", "<s>", "</s>", "<unk>"] + [f"t{i}" for i in range(4, model.config.vocab_size)]
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    token_batches = [[[vocabulary[t] for t in inputs[i]] for i in batch] for batch in batches]

    def padded(batch):
        width = max(len(inputs[i]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : len(inputs[i])] = torch.tensor(inputs[i])
        return ids, ids.ne(0).long()

    tensor_batches = [padded(batch) for batch in batches]

    ct2_engines = [name for name in engines if name.startswith("ct2_")]
    worker = None
    with tempfile.TemporaryDirectory() as tmp:
        if ct2_engines:
            model.save_pretrained(Path(tmp) / "model")
            worker = _CT2Worker(Path(tmp), vocabulary, ct2_engines, threads, token_batches,
                                dict(batch_size=batch_size, num_beams=num_beams, length_penalty=length_penalty,
                                     new_tokens=new_tokens))  # returns once the translators are loaded

    models = {"ours": model, "ours_side_by_side": model}
    if "torch_int8" in engines:
        with warnings.catch_warnings():  # torch.ao.quantization is deprecated in favour of torchao; it still works
            warnings.simplefilter("ignore")
            models["torch_int8"] = torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)

    outputs: dict[str, list] = {}

    def run_torch(name):
        def one_batch(batch):
            ids, mask = batch
            with torch.inference_mode():
                limit = new_tokens if new_tokens is not None else ids.shape[1] + 50
                extra = {"min_new_tokens": new_tokens} if new_tokens is not None else {}
                out = models[name].generate(input_ids=ids, attention_mask=mask, num_beams=num_beams,
                                            length_penalty=length_penalty, early_stopping=True,
                                            max_new_tokens=limit, **extra)
            return [[vocabulary[t] for t in row[1:] if t not in (0, 2)] for row in out.tolist()]

        def run():
            workers = threads if name.endswith("side_by_side") else 1
            outputs[name] = [words for batch in map_batches(one_batch, tensor_batches, torch.device("cpu"), workers)
                             for words in batch]
        return run

    def run_ct2(name):
        def run():
            outputs[name] = worker.run(name)
        return run

    functions = {name: (run_torch(name) if name in models else run_ct2(name)) for name in engines}
    runs: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for function in functions.values():  # warm-up (first calls allocate caches)
            function()
        names = list(engines)
        for repetition in range(repetitions):
            rotated = names[repetition % len(names):] + names[: repetition % len(names)]
            for name in rotated:
                start = time.perf_counter()
                functions[name]()
                runs[name].append(time.perf_counter() - start)
    finally:
        if worker is not None:
            worker.close()

    count = len(inputs)
    rates = {name: count / statistics.median(seconds) for name, seconds in runs.items()}
    reference = outputs.get("ours")
    agreement = {name: (sum(a == b for a, b in zip(outputs[name], reference)) / count if reference else None)
                 for name in engines if name != "ours"}
    generated = sum(len(words) + 1 for words in reference or outputs[engines[0]])
    return {
        "sentences": count,
        "batch_size": batch_size,
        "num_beams": num_beams,
        "threads": threads,
        "output_tokens": generated,
        "sentences_per_second": rates,
        "ratio_to_ours": {name: rates[name] / rates["ours"] for name in engines if "ours" in rates},
        "torch_int8_to_ct2_int8": (rates["torch_int8"] / rates["ct2_int8"]
                                   if {"torch_int8", "ct2_int8"} <= set(rates) else None),
        "agreement_with_ours": agreement,
        "runs": runs,
        "ctranslate2_version": importlib.metadata.version("ctranslate2"),
        "ctranslate2_in": "its own process" if ct2_engines else None,
    }


class _CT2Worker:
    """CTranslate2's translators in a process of their own (this file run with `--ct2-worker`), driven by JSON lines
    on its stdin and stdout: CTranslate2 bundles its own OpenMP runtime, and once it has translated in a process,
    torch's threads there run slower (beam 4 at 2 threads: 79.5 against 108.0 sentences/s, docs/performance.md), so
    in one process the benchmark would time ours handicapped. The caller times each `run` around the round trip."""

    def __init__(self, folder: Path, vocabulary: list[str], engines: list[str], threads: int, token_batches,
                 settings: dict):
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--ct2-worker"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._send({"folder": str(folder), "vocabulary": vocabulary, "engines": engines, "threads": threads,
                    "token_batches": token_batches, **settings})
        self._receive()  # converted (`folder`/model to `folder`/ct2) and loaded

    def _send(self, message: dict) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def _receive(self):
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"The CTranslate2 worker process exited (code {self.process.wait()}); its error is "
                               "printed above.")
        return json.loads(line)["result"]

    def run(self, name: str) -> list[list[str]]:
        self._send({"run": name})
        return self._receive()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)


def _ct2_worker() -> None:
    """The `_CT2Worker` process: convert the model, load the translators, then translate every batch with the engine
    each line names."""
    answers, sys.stdout = sys.stdout, sys.stderr  # anything else printed here must not reach the answers' pipe
    import ctranslate2

    from vaswani_hf.decoding.ct2 import convert_to_ct2

    job = json.loads(sys.stdin.readline())
    folder = Path(job["folder"])
    convert_to_ct2(folder / "model", folder / "ct2", vocabulary=job["vocabulary"])
    threads, token_batches, num_beams = job["threads"], job["token_batches"], job["num_beams"]
    new_tokens, length_penalty = job["new_tokens"], job["length_penalty"]
    translators = {name: ctranslate2.Translator(
        str(folder / "ct2"), device="cpu", compute_type=name.split("_")[1],
        **(dict(intra_threads=1, inter_threads=threads) if name.endswith("side_by_side") else
           dict(intra_threads=threads, inter_threads=1)))
        for name in job["engines"]}

    def answer(result) -> None:
        answers.write(json.dumps({"result": result}) + "\n")
        answers.flush()

    answer(True)
    for line in sys.stdin:
        name = json.loads(line)["run"]
        translator = translators[name]
        if name.endswith("side_by_side"):  # every batch at once; CTranslate2 runs inter_threads of them at a time
            limit = new_tokens if new_tokens is not None else max(len(t) for b in token_batches for t in b) + 50
            out = translator.translate_batch(
                [t for b in token_batches for t in b], max_batch_size=job["batch_size"], beam_size=num_beams,
                length_penalty=length_penalty, return_end_token=True, max_decoding_length=limit,
                min_decoding_length=new_tokens or 1)
            answer([[t for t in r.hypotheses[0] if t != "</s>"] for r in out])
            continue
        results = []
        for tokens in token_batches:
            limit = new_tokens if new_tokens is not None else max(map(len, tokens)) + 50
            out = translator.translate_batch(
                tokens, beam_size=num_beams, length_penalty=length_penalty, return_end_token=True,
                max_decoding_length=limit, min_decoding_length=new_tokens or 1)
            results += [[t for t in r.hypotheses[0] if t != "</s>"] for r in out]
        answer(results)


def print_report(results: dict) -> None:
    print(f"{results['sentences']} sentences, batch {results['batch_size']}, beam {results['num_beams']}, "
          f"{results['threads']} threads, {results['output_tokens']} output tokens "
          f"(CTranslate2 {results['ctranslate2_version']})")
    print(f"{'engine':<26}{'sent/s':>10}{'vs ours':>10}{'same output':>13}")
    for name, rate in results["sentences_per_second"].items():
        ratio = results["ratio_to_ours"].get(name)
        agree = results["agreement_with_ours"].get(name)
        print(f"{name:<26}{rate:>10.2f}{(f'{ratio:.2f}x' if ratio else ''):>10}"
              f"{(f'{agree:.0%}' if agree is not None else ''):>13}")
    if results.get("torch_int8_to_ct2_int8") is not None:
        print(f"torch int8 / CT2 int8: {results['torch_int8_to_ct2_int8']:.2f}x")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", help="A trained model folder with its tokenizer (default: a random model).")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="base",
                        help="Size of the random model (default base, the paper's).")
    parser.add_argument("--vocab_size", type=int, default=8000, help="Vocabulary of the random model.")
    parser.add_argument("--sentences", type=int, default=64, help="Sentences to translate (default 64).")
    parser.add_argument("--src_len", type=int, default=24, help="Source length of random inputs, </s> included.")
    parser.add_argument("--new_tokens", type=int, default=30,
                        help="Random model: output length forced in every engine (default 30).")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--num_beams", type=int, default=4, help="Beam size (default 4; 1 for greedy).")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's).")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="Tiny random model, few sentences: runs in seconds.")
    parser.add_argument("--malloc", choices=("keep", "default"), default="keep",
                        help="keep (default): glibc's malloc keeps freed memory for reuse in this process "
                             "(vaswani_training.lib.cpu_tuning.keep_freed_memory, as vaswani-train does), so that "
                             "generate()'s per-step logits are not page-faulted in again; CTranslate2 has its own "
                             "caching allocator. default: glibc's defaults.")
    parser.add_argument("--output", help="Also write the results as JSON here.")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    kept = False
    if args.malloc == "keep":
        from vaswani_training.lib.cpu_tuning import keep_freed_memory

        kept = keep_freed_memory()
    if args.quick:
        args.preset, args.vocab_size, args.sentences, args.src_len, args.new_tokens = "tiny", 200, 8, 8, 10
        args.repetitions = min(args.repetitions, 2)
    common = dict(batch_size=args.batch_size, num_beams=args.num_beams, threads=args.threads,
                  repetitions=args.repetitions)
    if args.model_dir:
        from transformers import AutoTokenizer

        from vaswani_hf.data import multi30k_file, read_lines

        model = VaswaniForConditionalGeneration.from_pretrained(args.model_dir)
        tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
        sentences = read_lines(multi30k_file("test", "de"))[: args.sentences]
        results = bench_ct2(model, tokenizer, sentences=sentences, **common)
    else:
        torch.manual_seed(0)
        model = VaswaniForConditionalGeneration(VaswaniConfig(vocab_size=args.vocab_size, dropout=0.0,
                                                              **PRESETS[args.preset]))
        inputs = _random_inputs(args.sentences, args.src_len, args.vocab_size)
        results = bench_ct2(model, inputs=inputs, new_tokens=args.new_tokens, **common)
    results["malloc_keeps_freed_memory"] = kept
    print_report(results)
    print(f"glibc malloc keeps freed memory: {'yes' if kept else 'no'} (--malloc {args.malloc})")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


if __name__ == "__main__":
    if sys.argv[1:] == ["--ct2-worker"]:
        _ct2_worker()
    else:
        main()
