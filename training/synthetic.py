"""A synthetic parallel corpus in the format of the Hub's `wmt14` dataset, built from real sentences, for trying the
WMT14 recipe (docs/reproduce.md) without the 4.5M-pair download: in tests, in CI and in benchmarks of the data path.

    python -m vaswani_training.synthetic data/synthetic-wmt14 --pairs 4500000
    vaswani-train --dataset_name data/synthetic-wmt14 --source_lang en --target_lang de ...

Each synthetic pair joins 1 to 3 aligned Multi30k pairs (the shipped copy, `vaswani_hf/corpora/multi30k/`), drawn at
random: the text is real German and English, and a sentence averages about 23 words (Multi30k's average 11.5 times
the mean of 1-3), as WMT14 En-De's do. The splits draw from different Multi30k splits (train from train, validation
from val, test from test2016), so no test sentence is in the training data.

The folder holds `train.jsonl`, `validation.jsonl` and `test.jsonl`, one `{"translation": {"de": ..., "en": ...}}`
object a line, which `datasets.load_dataset(folder)` maps to the three splits (so `--dataset_name FOLDER` reads it as
it reads `wmt14`); with `format="text"`, `train.de` / `train.en` etc. (`--train_file FOLDER/train`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from vaswani_hf.checks import CheckError, replace_file_atomically

# newstest2013 (the wmt14 dataset's validation split) has 3,000 pairs, newstest2014 (its test split) 3,003.
VALIDATION_PAIRS = 3000
TEST_PAIRS = 3003
# The Multi30k split each synthetic split draws its sentences from.
SOURCE_SPLITS = {"train": "train", "validation": "validation", "test": "test"}
MAX_JOINED = 3  # pairs joined into one synthetic pair: 1..3, uniform (mean 2: ~23 words from Multi30k's ~11.5)


@dataclass
class SyntheticCorpus:
    """What `write_synthetic_corpus` wrote.

    Attributes:
        folder: the corpus folder.
        files: split -> the files written (one `.jsonl`, or the two language files of `format="text"`).
        pairs: split -> number of pairs.
        mean_words: split -> language -> mean words (whitespace-separated) a sentence.
    """

    folder: Path
    files: dict[str, list[Path]] = field(default_factory=dict)
    pairs: dict[str, int] = field(default_factory=dict)
    mean_words: dict[str, dict[str, float]] = field(default_factory=dict)


def _multi30k_pairs(split: str) -> tuple[list[str], list[str], list[int], list[int]]:
    """German and English sentences of one shipped Multi30k split, aligned, with their word counts."""
    from vaswani_hf.data import multi30k_file, read_lines

    german, english = read_lines(multi30k_file(split, "de")), read_lines(multi30k_file(split, "en"))
    return german, english, [len(s.split()) for s in german], [len(s.split()) for s in english]


def _texts_for(source_lang: str, target_lang: str) -> tuple[int, int]:
    """Which Multi30k side (0: German, 1: English) each language code is written with: "en" gets the English text,
    the other code the German (the corpus stands in for any pair; only lengths and vocabulary matter)."""
    if target_lang == "en":
        return 0, 1
    if source_lang == "en":
        return 1, 0
    return 0, 1


def _draws(split: str, num_pairs: int, seed: int, size: int) -> Iterator[list[int]]:
    """For each of `num_pairs` synthetic pairs, the indices of the 1-3 Multi30k pairs it joins (uniform, with
    replacement, out of `size`). Deterministic in (`split`, `seed`)."""
    draw = random.Random(f"vaswani-synthetic|{split}|{seed}").random  # a str seed is hashed: stable across runs
    for _ in range(num_pairs):
        yield [int(draw() * size) for _ in range(1 + int(draw() * MAX_JOINED))]


def write_synthetic_corpus(folder: str | Path, num_pairs: int, *, source_lang: str = "de", target_lang: str = "en",
                           seed: int = 0, validation_pairs: int = VALIDATION_PAIRS, test_pairs: int = TEST_PAIRS,
                           format: str = "jsonl") -> SyntheticCorpus:
    """Write a synthetic parallel corpus in the `wmt14` dataset's format into `folder` (created if missing).

    Each pair joins 1-3 aligned Multi30k pairs drawn at random (uniformly, with replacement) from the shipped copy:
    real text whose sentences average about 23 words (22.5 German, 23.8 English), as WMT14 En-De's. Train draws from
    Multi30k's train split, validation from val, test from test2016. The code "en" is written with the English text,
    the other code with the German (for a `fr-en` layout the "fr" side holds German text).

    The pairs are streamed to disk (memory does not grow with `num_pairs`), the same for the same arguments
    (`seed`; each split has its own random stream, so `num_pairs` does not change validation or test), and each file
    is written under a hidden temporary name in `folder` and renamed when complete: a reader never sees half a file,
    and an interrupted call leaves the previous file.

    Args:
        folder: the corpus folder; `train`, `validation`, `test` files in it are replaced.
        num_pairs: training pairs (>= 1).
        source_lang, target_lang: the two language codes of each `translation` record (default "de", "en").
        seed: the random seed.
        validation_pairs, test_pairs: pairs in those splits (>= 1; default 3,000 and 3,003: newstest2013 and
            newstest2014).
        format: "jsonl": `train.jsonl`, `validation.jsonl`, `test.jsonl`, one `{"translation": {source_lang: ...,
            target_lang: ...}}` object a line (`datasets.load_dataset(folder)` reads them as the three splits);
            "text": `<split>.<lang>`, one sentence a line (`--train_file folder/train`).

    Returns:
        the `SyntheticCorpus`: files, pairs and mean words a sentence of each split.

    Raises:
        CheckError: a count < 1, equal or empty language codes, or an unknown `format`.
    """
    for name, value in (("num_pairs", num_pairs), ("validation_pairs", validation_pairs),
                        ("test_pairs", test_pairs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckError(f"{name} must be a whole number >= 1, got {value!r}.")
    if not source_lang or not target_lang or source_lang == target_lang:
        raise CheckError(f"source_lang and target_lang must be two different language codes, got {source_lang!r} "
                         f"and {target_lang!r}.")
    if format not in ("jsonl", "text"):
        raise CheckError(f"format must be 'jsonl' or 'text', got {format!r}.")
    folder = Path(folder)
    sides = _texts_for(source_lang, target_lang)
    corpus = SyntheticCorpus(folder)
    for split, n in (("train", num_pairs), ("validation", validation_pairs), ("test", test_pairs)):
        texts = _multi30k_pairs(SOURCE_SPLITS[split])
        source, target = texts[sides[0]], texts[sides[1]]
        lengths = (texts[2 + sides[0]], texts[2 + sides[1]])
        words = [0, 0]  # running sums, not lists: memory stays constant for millions of pairs

        def counted(draws: Iterator[list[int]]) -> Iterator[list[int]]:
            for picks in draws:
                words[0] += sum(lengths[0][i] for i in picks)
                words[1] += sum(lengths[1][i] for i in picks)
                yield picks

        draws = counted(_draws(split, n, seed, len(source)))
        if format == "jsonl":
            path = folder / f"{split}.jsonl"
            replace_file_atomically(path, lambda tmp: _write_jsonl(tmp, draws, (source_lang, target_lang),
                                                                   source, target))
            corpus.files[split] = [path]
        else:
            paths = [folder / f"{split}.{source_lang}", folder / f"{split}.{target_lang}"]
            # Both files in one pass: the target's temporary file is written and renamed inside the source's.
            replace_file_atomically(paths[0], lambda tmp: replace_file_atomically(
                paths[1], lambda tmp_target: _write_text((tmp, tmp_target), draws, source, target)))
            corpus.files[split] = paths
        corpus.pairs[split] = n
        corpus.mean_words[split] = {source_lang: round(words[0] / n, 2), target_lang: round(words[1] / n, 2)}
    return corpus


def _write_jsonl(path: str, draws: Iterator[list[int]], languages: tuple[str, str], source: list[str],
                 target: list[str]) -> None:
    """One `{"translation": {...}}` line per draw: the picked sentences' JSON escapes joined by a space (escaping is
    per character, so this is `json.dumps` of the joined text, at a fraction of its cost for millions of lines)."""
    def escaped(text: str) -> str:
        return json.dumps(text, ensure_ascii=False)[1:-1]

    source, target = [escaped(s) for s in source], [escaped(s) for s in target]
    head, middle, tail = (f'{{"translation": {{"{escaped(languages[0])}": "', f'", "{escaped(languages[1])}": "',
                          '"}}\n')
    with open(path, "w", encoding="utf-8", buffering=1 << 20) as handle:
        for picks in draws:
            handle.write(head + " ".join([source[i] for i in picks]) + middle + " ".join([target[i] for i in picks])
                         + tail)


def _write_text(paths: tuple[str, str], draws: Iterator[list[int]], source: list[str], target: list[str]) -> None:
    with open(paths[0], "w", encoding="utf-8", buffering=1 << 20) as source_file, \
            open(paths[1], "w", encoding="utf-8", buffering=1 << 20) as target_file:
        for picks in draws:
            source_file.write(" ".join([source[i] for i in picks]) + "\n")
            target_file.write(" ".join([target[i] for i in picks]) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="The corpus folder (created if missing; its split files are replaced).")
    parser.add_argument("--pairs", type=int, required=True, help="Training pairs (WMT14 En-De: about 4,500,000).")
    parser.add_argument("--validation_pairs", type=int, default=VALIDATION_PAIRS)
    parser.add_argument("--test_pairs", type=int, default=TEST_PAIRS)
    parser.add_argument("--source_lang", default="de", help="First language code of each record (default de).")
    parser.add_argument("--target_lang", default="en", help="Second language code (default en).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", choices=["jsonl", "text"], default="jsonl")
    args = parser.parse_args(argv)
    try:
        corpus = write_synthetic_corpus(args.folder, args.pairs, source_lang=args.source_lang,
                                        target_lang=args.target_lang, seed=args.seed,
                                        validation_pairs=args.validation_pairs, test_pairs=args.test_pairs,
                                        format=args.format)
    except CheckError as error:
        raise SystemExit(f"error: {error}") from None
    for split, files in corpus.files.items():
        words = ", ".join(f"{lang} {mean}" for lang, mean in corpus.mean_words[split].items())
        print(f"{split}: {corpus.pairs[split]:,} pairs, mean words a sentence {words}: "
              f"{', '.join(str(p) for p in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
