"""Time `translate_sentences` (what the training commands' evaluation, `vaswani-translate` and the choice on validation
call) on the shipped Multi30k: test2016 sentences one at a time and the validation split in batches, beam 4.

    python benchmarks/bench_translate.py --model_dir outputs/multi30k-de-en --threads 1

Prints sentences per second for each and an MD5 of all outputs (the same translations give the same digest), as
JSON. Comparing two commits: run this file from each tree in turn (`git worktree add ../before <commit>`, copy the
file there if it is older), alternating, on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from vaswani_hf import VaswaniForConditionalGeneration  # noqa: E402
from vaswani_hf.data.corpus import multi30k_file  # noqa: E402
from vaswani_hf.decoding.translate import translate_sentences  # noqa: E402


def german(split: str) -> list[str]:
    with gzip.open(multi30k_file(split, "de"), "rt", encoding="utf-8") as file:
        return [line.strip() for line in file]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", required=True, help="a saved model folder with its tokenizer")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--one_at_a_time", type=int, default=60, help="test2016 sentences translated one at a time")
    parser.add_argument("--batched", type=int, default=1014, help="validation sentences translated in batches")
    parser.add_argument("--batch_size", type=int, default=64)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = VaswaniForConditionalGeneration.from_pretrained(args.model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    test, validation = (german(split)[:count] for split, count in (("test", args.one_at_a_time),
                                                                     ("validation", args.batched)))
    translate_sentences(model, tokenizer, test[:5], batch_size=1)  # warm-up
    start = time.perf_counter()
    one = translate_sentences(model, tokenizer, test, batch_size=1)
    middle = time.perf_counter()
    batched = translate_sentences(model, tokenizer, validation, batch_size=args.batch_size)
    end = time.perf_counter()
    result = {"threads": torch.get_num_threads(), "torch": torch.__version__,
              "one_at_a_time": {"sentences": len(test), "sentences_per_second": round(len(test) / (middle - start), 2)},
              "batched": {"sentences": len(validation), "batch_size": args.batch_size,
                          "sentences_per_second": round(len(validation) / (end - middle), 2)},
              "outputs_md5": hashlib.md5("\n".join(one + batched).encode()).hexdigest()}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
