"""Parallel data for the training commands, one subject a module:

- `checking`: the one check of parallel data (splits, records, non-empty data) that every reader and command calls.
- `reading`: parallel text from files (plain or `.gz` lines, `PREFIX.{src,tgt}` pairs, JSON lines), into memory or
  streamed.
- `datasets`: memory-mapped `datasets.Dataset`s of those files, of a Hub dataset or of a folder in the Hub's layout;
  pair streams for corpora larger than memory.
- `corpus`: the shipped Multi30k task 1 (`vaswani_hf/corpora/multi30k`), the default corpus.
- `tokenizing`: token ids of `{"translation": ...}` records with any Hugging Face tokenizer.
- `batching`: §5.1 token-budget batches, padded from Arrow or cut from a stream.

Everything works offline: nothing is downloaded unless the caller asks for a Hub dataset (`hub_dataset=...`). Bad input
raises `vaswani_hf.checks.CheckError` (a `ValueError`) whose message names the file, line or field and says how to
fix it. Every public name is importable from here: `from vaswani_hf.data import load_multi30k`.
"""

from .batching import (
    PaddedBatches,
    StreamingTokenBudgetBatches,
    TokenBudgetBatchSampler,
    example_lengths,
    padding_fraction,
)
from .checking import check_parallel_data, check_splits, translation_pair
from .corpus import MULTI30K_ENV, MULTI30K_SPLITS, load_multi30k, multi30k_dir, multi30k_file
from .datasets import content_key, load_parallel_dataset, stream_parallel_pairs
from .reading import (
    ParallelText,
    iter_lines,
    iter_parallel_jsonl,
    iter_parallel_text,
    parallel_files,
    read_lines,
    read_parallel_jsonl,
    read_parallel_text,
    split_lines,
)
from .tokenizing import Encoder, iter_sentences, tokenize_dataset

__all__ = [
    "ParallelText",
    "read_lines",
    "split_lines",
    "read_parallel_text",
    "read_parallel_jsonl",
    "parallel_files",
    "load_parallel_dataset",
    "multi30k_dir",
    "multi30k_file",
    "load_multi30k",
    "MULTI30K_ENV",
    "MULTI30K_SPLITS",
    "tokenize_dataset",
    "Encoder",
    "example_lengths",
    "iter_sentences",
    "iter_lines",
    "iter_parallel_text",
    "iter_parallel_jsonl",
    "content_key",
    "TokenBudgetBatchSampler",
    "PaddedBatches",
    "StreamingTokenBudgetBatches",
    "stream_parallel_pairs",
    "check_parallel_data",
    "check_splits",
    "translation_pair",
    "padding_fraction",
]
