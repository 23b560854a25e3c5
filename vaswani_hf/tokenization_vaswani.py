"""The joint subword vocabulary of §5.1: one BPE model (Sennrich et al., 2016) learned from source and target text
together, so that one embedding matrix can serve both languages (§3.4).

Built with `tokenizers` and returned as a standard transformers fast tokenizer: it saves as `tokenizer.json` and a
`tokenizer_config.json` that names transformers' own class and carries no `auto_map`, so it loads back with no code of
ours (nothing beyond the config and modeling files is remote code). Where this package is not installed,
`PreTrainedTokenizerFast.from_pretrained(folder)` reads those two files only; `AutoTokenizer.from_pretrained(folder)`
on a model folder reads its `config.json` first, whose class is remote code, and so asks for `trust_remote_code=True`
as the model does (a folder holding the tokenizer alone needs nothing).

Design:
- SentencePiece-style spaces: the normalizer turns every space into "▁" and puts one "▁" in front of the text, the
  `Metaspace` pre-tokenizer splits words before each "▁", and the decoder turns "▁" back into spaces and drops the
  one it added, so decoding restores the spaces of the input exactly, leading, trailing and repeated ones included;
- byte fallback: characters the BPE never saw are spelled as UTF-8 byte tokens `<0x00>`..`<0xFF>` instead of
  `<unk>`, so `tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text` for any string, with
  one exception: the character "▁" (U+2581) itself, which stands for a space and decodes as one (tests/
  test_tokenization.py checks this on arbitrary Unicode with a BPE learned from Multi30k). A Python string holding a
  lone surrogate (U+D800..U+DFFF, e.g. from `errors="surrogateescape"`) is not Unicode text: `tokenizers` refuses it
  with a TypeError;
- special-token strings written in the text ("<s>", "</s>", ...) are tokenized as text (`split_special_tokens=True`),
  so they round-trip too and cannot inject control tokens;
- special tokens `<pad>`=0, `<s>`=1, `</s>`=2, `<unk>`=3 (the ids `VaswaniConfig` expects); sources and targets end in
  `</s>`; the decoder input starts with `<s>` (the model shifts the labels).
"""

from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
BYTE_TOKENS = [f"<0x{i:02X}>" for i in range(256)]


def _iterate_texts(sources: Iterable) -> Iterator[str]:
    for source in sources:
        if isinstance(source, (str, Path)):
            path = Path(source)
            if not path.is_file():
                raise FileNotFoundError(f"train_joint_bpe: no such text file: {path}")
            opener = __import__("gzip").open if path.suffix == ".gz" else open
            with opener(path, "rt", encoding="utf-8") as handle:
                for line in handle:
                    yield line.rstrip("\n")
        else:
            for text in source:
                if not isinstance(text, str):
                    raise TypeError(f"train_joint_bpe: iterators must yield str, got {type(text).__name__}")
                yield text


def train_joint_bpe(
    sources: Iterable,
    vocab_size: int = 8000,
    min_frequency: int = 2,
    model_max_length: int = 1024,
    show_progress: bool = False,
) -> PreTrainedTokenizerFast:
    """Learn one BPE vocabulary from source and target text together (§5.1).

    Args:
        sources: text files (paths, `.gz` allowed) and/or iterables of strings, e.g.
            `["train.de", "train.en"]` or `[german_sentences, english_sentences]`; all are pooled.
        vocab_size: size of the whole vocabulary including the 4 special and 256 byte tokens (default 8000, which
            suits Multi30k; the paper used 37000 for WMT English-German).
        min_frequency: a pair must occur this often to be merged.
        model_max_length: the tokenizer's `model_max_length` (used by `truncation=True`).
    Returns:
        a `PreTrainedTokenizerFast` whose `tokenizer(src, text_target=tgt)` gives `input_ids`, `attention_mask` and
        `labels`.
    Raises:
        ValueError: `vocab_size` too small to hold the special and byte tokens, or no text at all.
        FileNotFoundError: a path that does not exist.
    """
    reserved = len(SPECIAL_TOKENS) + len(BYTE_TOKENS)
    if vocab_size <= reserved:
        raise ValueError(f"train_joint_bpe: vocab_size must exceed {reserved} (special and byte tokens), "
                         f"got {vocab_size}.")
    seen = {"text": False}

    def texts():  # streamed, never held as a list: the corpus may be larger than memory
        for text in _iterate_texts(sources):
            seen["text"] = seen["text"] or bool(text.strip())
            yield text


    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    _pipeline(tokenizer)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(BYTE_TOKENS),
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts(), trainer=trainer)
    if not seen["text"]:
        raise ValueError("train_joint_bpe: the training text is empty; pass the files or sentences to learn from.")

    # Rebuild the model with the 256 byte tokens appended and byte fallback on: unseen characters become bytes.
    learned = tokenizer.model
    vocab = tokenizer.get_vocab()
    for token in BYTE_TOKENS:
        vocab.setdefault(token, len(vocab))
    merges = _merges_of(tokenizer)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    del learned
    return _wrap(tokenizer, model_max_length)


def _merges_of(tokenizer: Tokenizer) -> list[tuple[str, str]]:
    import json

    model = json.loads(tokenizer.to_str())["model"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def _pipeline(tokenizer: Tokenizer) -> None:
    """Spaces become "▁" and every text gets one leading "▁" (also one that already starts with a space or "▁",
    which Metaspace's own prepending would skip, losing a leading space on decode); words split before each "▁"."""
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")


def _wrap(tokenizer: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    _pipeline(tokenizer)
    # As Llama's tokenizer decodes: "▁" back to a space, bytes back to characters, one leading space dropped.
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    eos_id = tokenizer.token_to_id("</s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        # "<s>", "</s>", "<pad>" or "<unk>" written in the text are text (e.g. HTML's <s> in web-crawled data), not
        # special tokens; the special ids come only from the post-processor (the closing </s>) and from padding.
        split_special_tokens=True,
    )


__all__ = ["train_joint_bpe", "SPECIAL_TOKENS"]
