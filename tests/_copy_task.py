"""Tiny models for tests: a seeded VaswaniForConditionalGeneration, optionally trained briefly on a copy task so that
its outputs are sentences of varied length that end in </s>, not noise (used by the decoding, export and plot tests).
"""

from pathlib import Path

import torch

from vaswani_hf import VaswaniConfig, VaswaniForConditionalGeneration

ROOT_DIR = Path(__file__).resolve().parents[1]
PAD, BOS, EOS = 0, 1, 2
VOCAB = 24  # ids 4..23 are "words"


def tiny_config(**overrides) -> VaswaniConfig:
    params = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, num_heads=4, d_ff=64,
                  dropout=0.0, label_smoothing=0.0, max_position_embeddings=128)
    params.update(overrides)
    return VaswaniConfig(**params)


def copy_batch(generator: torch.Generator, batch: int = 32, min_len: int = 2, max_len: int = 9):
    """Sources of random words + </s>, right-padded; labels = the same sentence (copy task)."""
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=generator)
    width = int(lengths.max()) + 1
    ids = torch.full((batch, width), PAD, dtype=torch.long)
    for row, length in enumerate(lengths.tolist()):
        ids[row, :length] = torch.randint(4, VOCAB, (length,), generator=generator)
        ids[row, length] = EOS
    mask = ids.ne(PAD).long()
    labels = ids.masked_fill(ids.eq(PAD), -100)
    return ids, mask, labels


def trained_copy_model(steps: int = 40, seed: int = 0, **overrides) -> VaswaniForConditionalGeneration:
    """A tiny model trained `steps` Adam steps on the copy task (a few seconds on one CPU core); eval mode."""
    torch.manual_seed(seed)
    model = VaswaniForConditionalGeneration(tiny_config(**overrides))
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        ids, mask, labels = copy_batch(generator)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def sources(seed: int = 1, batch: int = 6, min_len: int = 2, max_len: int = 9):
    ids, mask, _ = copy_batch(torch.Generator().manual_seed(seed), batch, min_len, max_len)
    return ids, mask
