"""A fixed batch of four utterances, its micro-batches and a small model, for tests of one training step.

Gradient accumulation and DDP's ``no_sync`` are checked by comparing a step on the whole batch with a step on
its micro-batches: :func:`utterances` makes the batch (as the collator packs it, random but always the same),
:func:`split_batch` cuts it into micro-batches padded as the collator pads them, :func:`small_model` draws the same
one-layer Conformer-CTC at every call.
"""

from __future__ import annotations

import torch

from asrflow.model.conformer_ctc import build_model
from tests.support.tiny_config import tiny_model_config

#: Utterances in :func:`utterances`, their longest length (frames), mel bins, target tokens each, vocabulary.
NUM_UTTERANCES, FRAMES, MEL_BINS, TOKENS, VOCAB = 4, 120, 80, 9, 8
#: Each utterance's length in frames (10 ms each).
LENGTHS = (120, 110, 90, 70)


def utterances() -> dict:
    """Four utterances of 120, 110, 90 and 70 frames: (N, T, F) features, (N, U) targets without blanks."""
    generator = torch.Generator().manual_seed(0)
    return {
        "features": torch.randn(NUM_UTTERANCES, FRAMES, MEL_BINS, generator=generator),  # (N, T, F)
        "feature_lens": torch.tensor(LENGTHS, dtype=torch.int64),
        "targets": torch.randint(1, VOCAB, (NUM_UTTERANCES, TOKENS), generator=generator),  # (N, U)
        "target_lens": torch.full((NUM_UTTERANCES,), TOKENS, dtype=torch.int64),
        "cut_ids": [f"utt{n}" for n in range(NUM_UTTERANCES)],
        "durations": torch.tensor(LENGTHS, dtype=torch.float64) / 100,
    }


def split_batch(batch: dict, pieces: int) -> list[dict]:
    """``pieces`` micro-batches, each padded only to its own longest utterance (as the collator does)."""
    size = NUM_UTTERANCES // pieces
    micro_batches = []
    for i in range(pieces):
        part = {key: value[i * size : (i + 1) * size] for key, value in batch.items()}
        part["features"] = part["features"][:, : int(part["feature_lens"].max())]
        micro_batches.append(part)
    return micro_batches


def small_model() -> torch.nn.Module:
    """A one-layer Conformer-CTC (d_model 32) for :data:`MEL_BINS` features and :data:`VOCAB` tokens, with the
    same drawn weights at every call (seed 1), dropout off, in training mode."""
    torch.manual_seed(1)
    config = tiny_model_config(dropout=0.0, subsampling_norm=False, blank_bias_init=None)
    return build_model(config, input_dim=MEL_BINS, vocab_size=VOCAB).train()
