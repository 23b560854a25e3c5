"""Token-budget batching, §5.1 of "Attention Is All You Need" ("Sentence pairs were batched together by approximate
sequence length. Each training batch contained a set of sentence pairs containing approximately 25000 source tokens and
25000 target tokens"), in the form fairseq implements it (`--max-tokens`): see `TokenBudgetBatchSampler`.

At scale (docs/data.md): lengths come from the Arrow offsets (`example_lengths`), batches are packed with numpy and
padded from Arrow (`PaddedBatches`), and `StreamingTokenBudgetBatches` batches a stream larger than memory a pool at a
time.

Bad input raises `CheckError` (`vaswani_hf.checks`, a `ValueError`) that says what is wrong and how to fix it.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, Sampler

from ..checks import CheckError
from .tokenizing import Encoder

logger = logging.getLogger(__name__)

__all__ = ["PaddedBatches", "StreamingTokenBudgetBatches", "TokenBudgetBatchSampler", "example_lengths",
           "padding_fraction"]


def _list_lengths(dataset, column: str) -> np.ndarray:
    """Lengths of a list column, read from the Arrow offsets (no Python list per example)."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(dataset.data.column(column)).to_numpy(zero_copy_only=False).astype(np.int64)
    indices = getattr(dataset, "_indices", None)  # after select()/shuffle(): rows of the underlying table
    if indices is not None:
        lengths = lengths[indices.column(0).to_numpy()]
    return lengths


def example_lengths(dataset, source_column: str = "input_ids", target_column: str = "labels"):
    """Per-example token counts `(src_lengths, tgt_lengths)` (int64 numpy arrays of shape `(len(dataset),)`) of a
    tokenized dataset, for `TokenBudgetBatchSampler`, read from the Arrow offsets without materializing the ids.

    Raises:
        CheckError: a column is missing (tokenize first with `tokenize_dataset`).
    """
    for c in (source_column, target_column):
        if c not in dataset.column_names:
            raise CheckError(
                f"column {c!r} not in dataset (columns: {', '.join(dataset.column_names)}); tokenize first "
                f"with tokenize_dataset()."
            )
    return _list_lengths(dataset, source_column), _list_lengths(dataset, target_column)


def _as_lengths(x, name: str) -> np.ndarray:
    try:
        a = np.asarray(x)
    except Exception as e:  # pragma: no cover - exotic inputs
        raise CheckError(f"{name} must be a sequence of non-negative ints ({e}).") from None
    if a.ndim != 1:
        raise CheckError(f"{name} must be 1-D (one length per example), got shape {a.shape}.")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        if np.issubdtype(a.dtype, np.floating) and np.all(np.isfinite(a)) and np.all(a == np.round(a)):
            a = a.astype(np.int64)
        else:
            raise CheckError(f"{name} must hold integer token counts, got dtype {a.dtype}.")
    a = a.astype(np.int64)
    if a.size and a.min() < 0:
        i = int(np.argmin(a))
        raise CheckError(f"{name}[{i}] = {a[i]} is negative; lengths are token counts.")
    return a


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Batches of example indices holding at most `max_tokens` padded tokens, like fairseq `--max-tokens`.

    Paper §5.1: "Sentence pairs were batched together by approximate sequence length. Each training batch
    contained a set of sentence pairs containing approximately 25000 source tokens and 25000 target tokens."

    Algorithm (per epoch, deterministic given `seed` and `epoch`):

    1. Order examples by source length, then target length (as fairseq's `LanguagePairDataset`), ties broken
       by a random permutation drawn from `seed + epoch` (only same-length examples are reordered, so the
       batch *sizes* are the same every epoch while their contents vary).
    2. Greedily pack consecutive examples while `max(max(src_i, tgt_i) over the batch) * batch_size <=
       max_tokens` (fairseq's `num_tokens` = max of source and target length, counted padded) and, if given,
       `batch_size <= max_sentences`.
    3. Shuffle the batch order with `seed + epoch` (if `shuffle`; otherwise keep length order and no
       tie-break noise, e.g. for evaluation).
    4. Distributed: if `num_replicas > 1` the batch list is padded to a multiple of `num_replicas` by
       repeating batches from its start (the only duplicates; at most `num_replicas - 1` batches), then rank
       `r` takes batches `r, r + num_replicas, ...`. Every example is seen at least once per epoch on some
       rank, none is dropped, and every rank gets `len(self)` batches, so collective ops stay in step.
       If you pass the DataLoader through `accelerate.Accelerator.prepare`, keep `num_replicas=1`:
       accelerate shards batch samplers across processes itself (`even_batches=True` pads the same way).

    An example whose `max(src, tgt)` exceeds `max_tokens` makes the constructor raise (fairseq asserts the
    same), telling you to raise `max_tokens` or drop long examples (e.g. truncate with
    `tokenize_dataset(max_length=...)`); `skip_oversize=True` instead leaves them out and counts them in
    `num_skipped` (logged; like fairseq's `--skip-invalid-size-inputs-valid-test`).

    Call `set_epoch` before each epoch (as with `DistributedSampler`); otherwise every epoch repeats
    the order of epoch 0.

    Args:
        src_lengths: token count of each example's source (e.g. from `example_lengths`).
        tgt_lengths: token count of each target; `None` uses the source lengths only.
        max_tokens: token budget per batch (padded, per rank). Paper: ~25000 per side on 8 GPUs.
        max_sentences: optional cap on examples per batch.
        shuffle: shuffle batch order and break ties randomly (training); False for evaluation.
        seed: base random seed; must be the same on all ranks.
        num_replicas, rank: distributed split (defaults: single process).
        skip_oversize: see above.

    Raises:
        CheckError: lengths of different sizes / negative / non-integer, `max_tokens` or `max_sentences` not
            a positive int, `rank` outside `[0, num_replicas)`, an oversize example (unless skipped), or no
            examples.
    """

    def __init__(
        self,
        src_lengths: Sequence[int],
        tgt_lengths: Sequence[int] | None = None,
        max_tokens: int = 4096,
        *,
        max_sentences: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        skip_oversize: bool = False,
        num_batches_multiple: int | None = None,
    ):
        src = _as_lengths(src_lengths, "src_lengths")
        tgt = src if tgt_lengths is None else _as_lengths(tgt_lengths, "tgt_lengths")
        if len(src) != len(tgt):
            raise CheckError(f"src_lengths has {len(src)} entries but tgt_lengths has {len(tgt)}; one per example.")
        if len(src) == 0:
            raise CheckError("no examples: src_lengths is empty.")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens <= 0:
            raise CheckError(f"max_tokens must be a positive int, got {max_tokens!r}.")
        if max_sentences is not None and (
            isinstance(max_sentences, bool) or not isinstance(max_sentences, (int, np.integer)) or max_sentences <= 0
        ):
            raise CheckError(f"max_sentences must be a positive int or None, got {max_sentences!r}.")
        if not isinstance(num_replicas, (int, np.integer)) or num_replicas < 1:
            raise CheckError(f"num_replicas must be an int >= 1, got {num_replicas!r}.")
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < num_replicas:
            raise CheckError(f"rank must be in [0, num_replicas={num_replicas}), got {rank!r}.")
        self.src_lengths, self.tgt_lengths = src, tgt
        self.num_tokens = np.maximum(np.maximum(src, tgt), 1)
        self.max_tokens, self.max_sentences = int(max_tokens), max_sentences
        self.shuffle, self.seed = shuffle, int(seed)
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        if num_batches_multiple is None:
            num_batches_multiple = self.num_replicas
        if isinstance(num_batches_multiple, bool) or not isinstance(num_batches_multiple, (int, np.integer)) or \
                num_batches_multiple < 1:
            raise CheckError(f"num_batches_multiple must be an int >= 1, got {num_batches_multiple!r}.")
        self.num_batches_multiple = int(num_batches_multiple)
        self.epoch = 0

        over = np.nonzero(self.num_tokens > self.max_tokens)[0]
        if len(over) and not skip_oversize:
            show = ", ".join(f"#{i} ({self.num_tokens[i]} tokens)" for i in over[:5])
            raise CheckError(
                f"{len(over)} example(s) longer than max_tokens={self.max_tokens}: {show}"
                f"{' ...' if len(over) > 5 else ''}. Raise --max_tokens to at least {int(self.num_tokens.max())}, "
                f"truncate/filter long examples (e.g. tokenize_dataset(max_length=...)), or pass "
                f"skip_oversize=True to leave them out."
            )
        self.num_skipped = int(len(over))
        if self.num_skipped:
            logger.warning("TokenBudgetBatchSampler: skipping %d example(s) longer than max_tokens=%d",
                           self.num_skipped, self.max_tokens)
        keep = np.ones(len(src), dtype=bool)
        keep[over] = False
        self._valid = np.nonzero(keep)[0]
        if len(self._valid) == 0:
            raise CheckError(f"all {len(src)} examples are longer than max_tokens={self.max_tokens}.")
        self._sizes = self._batch_sizes(self._order(0))  # the same every epoch: only equal lengths are reordered

    # -- internals ------------------------------------------------------------------------------------------
    def _order(self, epoch: int) -> np.ndarray:
        idx = self._valid
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch, 0])
            idx = idx[rng.permutation(len(idx))]
        # stable sorts: primary key source length, secondary target length (fairseq LanguagePairDataset)
        idx = idx[np.argsort(self.tgt_lengths[idx], kind="stable")]
        idx = idx[np.argsort(self.src_lengths[idx], kind="stable")]
        return idx

    def _batch_sizes(self, order: np.ndarray) -> np.ndarray:
        """Greedy packing in `order`: each batch takes examples while (longest so far) x (count) fits the budget. A loop
        over batches, not examples: each step reads a window no longer than the batch can be, with numpy."""
        ntok = self.num_tokens[order]
        cap = self.max_sentences or len(order)
        sizes, start, n = [], 0, len(order)
        while start < n:
            width = min(n - start, cap, self.max_tokens // int(ntok[start]))
            longest = np.maximum.accumulate(ntok[start:start + width])
            fits = longest * np.arange(1, width + 1) <= self.max_tokens  # true, then false: both factors grow
            size = width if fits[-1] else int(np.argmin(fits))
            sizes.append(size)
            start += size
        return self._even_out(np.asarray(sizes, dtype=np.int64))

    def _even_out(self, sizes: np.ndarray) -> np.ndarray:
        """Split the largest batches in two until their count is a multiple of `num_batches_multiple`, so every
        process gets as many batches as the others and no example twice. Only the sizes are split (the same every
        epoch); a batch of one example cannot be split, and `__iter__` then repeats batches."""
        need = (-len(sizes)) % self.num_batches_multiple
        while need:
            splittable = np.nonzero(sizes >= 2)[0]
            if not len(splittable):
                break
            chosen = np.zeros(len(sizes), dtype=bool)
            chosen[splittable[np.argsort(-sizes[splittable], kind="stable")[:need]]] = True
            first = np.where(chosen, sizes // 2, sizes)
            halves = np.stack([first, sizes - first], axis=1).ravel()  # each split batch's two halves in place
            sizes = halves[halves > 0]
            need = (-len(sizes)) % self.num_batches_multiple
        return sizes

    def _epoch_batches(self, epoch: int) -> list[np.ndarray]:
        order = self._order(epoch)
        batches = np.split(order, np.cumsum(self._sizes)[:-1])
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch, 1])
            batches = [batches[j] for j in rng.permutation(len(batches))]
        return batches

    # -- public API -----------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Set the epoch used (with `seed`) for tie-breaking and batch shuffling. Call before each epoch."""
        self.epoch = int(epoch)

    def global_batches(self, epoch: int | None = None) -> list[list[int]]:
        """All batches of `epoch` (default: current) before the per-rank split, in iteration order."""
        return [b.tolist() for b in self._epoch_batches(self.epoch if epoch is None else int(epoch))]

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._epoch_batches(self.epoch)
        if self.num_replicas > 1:
            total = self.num_replicas * math.ceil(len(batches) / self.num_replicas)
            batches = batches + [batches[j % len(batches)] for j in range(total - len(batches))]
            batches = batches[self.rank::self.num_replicas]
        return (b.tolist() for b in batches)

    def __len__(self) -> int:
        """Batches this rank yields per epoch (the same on every rank and every epoch)."""
        return math.ceil(len(self._sizes) / self.num_replicas)

    @property
    def num_examples(self) -> int:
        """Examples covered per epoch (all of them minus `num_skipped`)."""
        return len(self._valid)


class PaddedBatches:
    """A tokenized `Dataset` read a batch at a time as one Arrow table and padded with numpy: the tensors
    `DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)` makes of the same rows (`input_ids` and
    `attention_mask` padded with `pad_token_id` and 0, `labels` with -100; the model shifts the labels into its
    decoder input itself), without a Python list per example: 7x faster a 25,000-token batch
    (benchmarks/bench_data.py), so the loader keeps up with an accelerator.

        batches = PaddedBatches(tokenized["train"], tokenizer.pad_token_id)
        loader = DataLoader(batches, batch_sampler=TokenBudgetBatchSampler(...), collate_fn=batches.collate)

    Raises:
        CheckError: `input_ids` or `labels` missing from the dataset.
    """

    def __init__(self, dataset, pad_token_id: int, label_pad_token_id: int = -100):
        for column in ("input_ids", "labels"):
            if column not in dataset.column_names:
                raise CheckError(f"column {column!r} not in dataset (columns: {', '.join(dataset.column_names)}); "
                                f"tokenize first with tokenize_dataset().")
        self.rows = dataset.select_columns(["input_ids", "labels"]).with_format("arrow")
        self.pad_token_id, self.label_pad_token_id = int(pad_token_id), int(label_pad_token_id)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitems__(self, indices: list[int]):
        return self.rows[list(indices)]

    def __getitem__(self, index: int):
        return self.rows[[index]]

    def collate(self, rows) -> dict[str, torch.Tensor]:
        """One Arrow table of rows (or a list of one-row tables) -> `{"input_ids", "attention_mask", "labels"}`, int64
        tensors of shape `(rows, longest)`."""
        import pyarrow as pa

        if isinstance(rows, list):
            rows = pa.concat_tables(rows)
        input_ids, attention_mask = _padded(rows.column("input_ids"), self.pad_token_id)
        labels, _ = _padded(rows.column("labels"), self.label_pad_token_id)
        return {"input_ids": input_ids, "attention_mask": attention_mask.long(), "labels": labels}


def _padded(column, value: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An Arrow list column -> (ids padded on the right with `value`, the mask of real tokens)."""
    column = column.combine_chunks()
    lengths = np.diff(column.offsets.to_numpy())
    width = int(lengths.max()) if len(lengths) else 0
    mask = np.arange(width) < lengths[:, None]
    padded = np.full((len(lengths), width), value, dtype=np.int64)
    padded[mask] = column.flatten().to_numpy()  # row-major: the rows' tokens in order
    return torch.from_numpy(padded), torch.from_numpy(mask)


class StreamingTokenBudgetBatches(IterableDataset):
    """Token-budget batches (§5.1) from a stream of sentence pairs larger than memory: memory stays flat in the
    corpus size.

    The stream is read in pools of `pool_pairs` pairs. Each pool is tokenized (in one batched call of the fast
    tokenizer), cut into batches exactly as `TokenBudgetBatchSampler` cuts a corpus (sorted by length, packed to
    `max_tokens` padded tokens, batch order shuffled with `seed` and the epoch), and its batches are dealt to the
    processes in turn, the pool's batch count made a multiple of `num_replicas` by splitting its largest batches: every
    process gets the same number of batches and no pair twice. Pairs longer than the length limits are left out and
    counted in `num_dropped`; order across pools is the stream's (shuffle the corpus on disk once, as
    tensor2tensor's and fairseq's streaming readers expect). With DataLoader workers, worker `w` of `W` prepares
    pools `w, w + W, ...`; the DataLoader takes their batches in turn, so the order depends on `W`, not on timing.

    Each item is a list of `{"input_ids", "attention_mask", "labels"}` features, ready for
    `transformers.DataCollatorForSeq2Seq`: use `DataLoader(stream, batch_size=None, collate_fn=collator)`.
    A resumed run skips the batches it has already consumed (`skip_first_batches`): the stream is read again, so it
    must yield the same pairs in the same order. With `repeat`, one iteration runs pass after pass (epochs `epoch`,
    `epoch + 1`, ...) without end, so that the batches a training loop sees are a function of their count alone and a
    resumed run that skips its first N batches continues exactly where an uninterrupted one is, past the first pass
    too.

    Args:
        pairs: a callable returning a fresh iterator of `(source, target)` strings each time (one per epoch), e.g.
            `lambda: iter_parallel_text(prefix, "en", "de")` (see `stream_parallel_pairs`).
        tokenizer: a fast tokenizer (`tokenizer(src)` and `tokenizer(text_target=tgt)` give the ids).
        max_tokens: token budget per batch per process (padded; fairseq's --max-tokens).
        max_source_length, max_target_length: longer pairs are left out (None: no limit besides `max_tokens`).
        pool_pairs: pairs read, tokenized and batched together (default 100,000; memory grows with it, not with the
            corpus).
        seed, shuffle: batch order within a pool (shuffled per epoch by default).
        num_replicas, rank: this process among the data-parallel ones.
        repeat: iterate pass after pass without end (a training loop stops at its step count).

    Raises:
        CheckError: a bad budget, pool size or rank (see `TokenBudgetBatchSampler`); when iterated, a pass that
            yields no batch (no pairs, or every pair over the length limits), where no DataLoader workers split it.
    """

    def __init__(self, pairs, tokenizer, *, max_tokens: int, max_source_length: int | None = None,
                 max_target_length: int | None = None, pool_pairs: int = 100_000, seed: int = 0,
                 shuffle: bool = True, num_replicas: int = 1, rank: int = 0, repeat: bool = False):
        if not callable(pairs):
            raise CheckError("pairs must be a callable returning a fresh iterator of (source, target) pairs, e.g. "
                            "lambda: iter_parallel_text(prefix, 'en', 'de').")
        for name, value in (("max_tokens", max_tokens), ("pool_pairs", pool_pairs)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise CheckError(f"{name} must be a positive int, got {value!r}.")
        if not isinstance(num_replicas, (int, np.integer)) or num_replicas < 1 or not 0 <= rank < num_replicas:
            raise CheckError(f"rank must be in [0, num_replicas) with num_replicas >= 1, got rank={rank!r}, "
                            f"num_replicas={num_replicas!r}.")
        self.pairs, self.tokenizer = pairs, tokenizer
        self.max_tokens, self.pool_pairs = int(max_tokens), int(pool_pairs)
        self.max_source_length, self.max_target_length = max_source_length, max_target_length
        self.seed, self.shuffle, self.num_replicas, self.rank = int(seed), shuffle, int(num_replicas), int(rank)
        self.epoch, self.num_dropped, self.repeat = 0, 0, repeat
        self._encode_source, self._encode_target = Encoder(tokenizer, None), Encoder(tokenizer, None, target=True)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose batch order to draw (with `seed`); call before each epoch, as with `DistributedSampler`."""
        self.epoch = int(epoch)

    def _pool_batches(self, pool: list[tuple[str, str]], pool_index: int,
                      epoch: int) -> Iterator[list[dict[str, list[int]]]]:
        # ids as one int32 array a pool and side, cut at offsets: a Python int per token would be 9x the memory
        sources, src = self._encode(self._encode_source, [s for s, _ in pool])
        targets, tgt = self._encode(self._encode_target, [t for _, t in pool])
        fits = np.maximum(np.maximum(src, tgt), 1) <= self.max_tokens
        if self.max_source_length is not None:
            fits &= src <= self.max_source_length
        if self.max_target_length is not None:
            fits &= tgt <= self.max_target_length
        kept = np.nonzero(fits)[0]
        self.num_dropped += len(pool) - len(kept)
        if not len(kept):
            return
        sampler = TokenBudgetBatchSampler(src[kept], tgt[kept], self.max_tokens, shuffle=self.shuffle,
                                          seed=self.seed * 1_000_003 + pool_index, num_replicas=self.num_replicas,
                                          rank=self.rank)
        sampler.set_epoch(epoch)
        src_starts, tgt_starts = np.cumsum(src) - src, np.cumsum(tgt) - tgt
        for batch in sampler:
            features = []
            for i in kept[batch].tolist():
                source = sources[src_starts[i]:src_starts[i] + src[i]].tolist()
                features.append({"input_ids": source, "attention_mask": [1] * len(source),
                                 "labels": targets[tgt_starts[i]:tgt_starts[i] + tgt[i]].tolist()})
            yield features

    @staticmethod
    def _encode(encoder, texts: list[str], chunk: int = 2000) -> tuple[np.ndarray, np.ndarray]:
        """All ids of `texts` in one int32 array, and each text's length."""
        ids, lengths = [], []
        for start in range(0, len(texts), chunk):
            encoded = encoder(texts[start:start + chunk])
            lengths.extend(map(len, encoded))
            ids.append(np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int32))
        return np.concatenate(ids) if ids else np.zeros(0, np.int32), np.asarray(lengths, dtype=np.int64)

    def __iter__(self) -> Iterator[list[dict[str, list[int]]]]:
        from torch.utils.data import get_worker_info

        worker = get_worker_info()
        worker_id, num_workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        for epoch in itertools.count(self.epoch):
            stream, pairs, dropped, batches = iter(self.pairs()), 0, self.num_dropped, 0
            for pool_index in itertools.count():
                pool = list(itertools.islice(stream, self.pool_pairs))
                if not pool:
                    break
                pairs += len(pool)
                if pool_index % num_workers == worker_id:
                    for batch in self._pool_batches(pool, pool_index, epoch):
                        batches += 1
                        yield batch
            if not batches:
                if num_workers == 1:  # a worker's own pools may all be left out while the others' are not
                    raise CheckError(self._no_batch(pairs, self.num_dropped - dropped))
                return
            if not self.repeat:
                return

    def _no_batch(self, pairs: int, dropped: int) -> str:
        if not pairs:
            return "the training stream holds no sentence pairs; give data with at least one pair."
        limits = {"max_source_length": self.max_source_length, "max_target_length": self.max_target_length,
                  "max_tokens": self.max_tokens}
        named = ", ".join(f"{name} {value}" for name, value in limits.items() if value is not None)
        return (f"the training stream yields no batch: all {dropped} of its {pairs} pairs are longer than the limits "
                f"({named} tokens), so no step could train. Raise --max_source_length, --max_target_length or "
                f"--max_tokens.")

    def check_first_batch(self) -> None:
        """Read the stream up to its first batch (the first pool holding a pair within the limits), before a training
        run starts, so that a run that would train no step is refused before it writes anything. Costs the reading and
        tokenizing of that pool; `num_dropped` is left as it was.

        Raises:
            CheckError: a whole pass yields no batch (naming the limits to raise), or what the stream's reader raises.
        """
        dropped, repeat = self.num_dropped, self.repeat
        self.repeat = False
        try:
            iterator = iter(self)
            next(iterator, None)
            iterator.close()
        finally:
            self.num_dropped, self.repeat = dropped, repeat


def padding_fraction(
    batches: Sequence[Sequence[int]], src_lengths: Sequence[int], tgt_lengths: Sequence[int] | None = None
) -> float:
    """Fraction of token slots that are padding when each batch's sources are padded to the batch's longest
    source and targets to the longest target (what `DataCollatorForSeq2Seq` does), summed over both sides:
    `sum(pad slots) / sum(all slots)` in [0, 1). `tgt_lengths=None` measures the source side only."""
    src = _as_lengths(src_lengths, "src_lengths")
    sides = [src] if tgt_lengths is None else [src, _as_lengths(tgt_lengths, "tgt_lengths")]
    total = real = 0
    for b in batches:
        if len(b) == 0:
            continue
        b = np.asarray(b, dtype=np.int64)
        for lens in sides:
            lb = lens[b]
            total += int(lb.max()) * len(b)
            real += int(lb.sum())
    if total == 0:
        raise CheckError("padding_fraction: no tokens in the given batches.")
    return 1.0 - real / total
