"""Removing utterances CTC cannot align: too few output frames for their tokens."""

from __future__ import annotations

import logging

import torch
from lhotse import CutSet

from asrflow.data.manifests import cut_text
from asrflow.model.conformer_ctc import subsampled_lengths
from asrflow.tokenizer import Tokenizer

logger = logging.getLogger("asrflow.filters")


def ctc_frames_needed(token_ids: list[int]) -> int:
    """Output frames CTC needs: one per token plus a blank between each pair of repeats."""
    repeats = sum(1 for a, b in zip(token_ids, token_ids[1:], strict=False) if a == b)
    return len(token_ids) + repeats


def output_frames(num_frames: int) -> int:
    """Encoder output frames for ``num_frames`` input frames (subsampling by 4)."""
    return int(subsampled_lengths(torch.tensor(num_frames)))


def filter_ctc_feasible(
    cuts: CutSet, tokenizer: Tokenizer, frame_shift_s: float, max_speed: float = 1.0
) -> tuple[CutSet, list[str]]:
    """Keep cuts with a non-empty transcript and enough frames; returns (kept, removed ids).

    Args:
        cuts: cuts with features (their frame count is used) or without (duration / frame shift).
        tokenizer: the tokenizer the targets come from.
        frame_shift_s: seconds per input frame.
        max_speed: the fastest speed perturbation factor training may apply (1.1 shortens an
            utterance to 1/1.1 of its frames); a cut must be feasible at that speed too.
    """
    kept, removed = [], []
    for cut in cuts:
        ids = tokenizer.encode(cut_text(cut))
        num_frames = cut.num_frames if cut.has_features else round(cut.duration / frame_shift_s)
        num_frames = int(num_frames / max_speed)  # (frames at the fastest speed, rounded down)
        if ids and output_frames(num_frames) >= ctc_frames_needed(ids):
            kept.append(cut)
        else:
            removed.append(cut.id)
    if removed:
        logger.warning(
            "removed %d of %d utterances too short for their transcript after subsampling by 4 "
            "(or with an empty one): %s", len(removed), len(removed) + len(kept), ", ".join(removed[:10]),
        )
    return CutSet.from_cuts(kept), removed
