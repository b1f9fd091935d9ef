"""Removing utterances CTC cannot align: too few output frames for their tokens."""

from __future__ import annotations

import logging

import numpy as np
import torch
from lhotse import CutSet

from asrflow.data.index import CutIndex
from asrflow.data.manifests import cut_text
from asrflow.model.conformer_ctc import subsampled_lengths
from asrflow.tokenizer import Tokenizer

logger = logging.getLogger("asrflow.filters")
#: Cuts judged at once by :func:`filter_ctc_feasible_index` (their texts are tokenized as one batch).
VERDICT_CHUNK = 10_000
#: Output frames "needed" by an empty transcript: more than any cut has, so it is removed.
NEVER = np.iinfo(np.int64).max


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
            "(or with an empty one): %s",
            len(removed),
            len(removed) + len(kept),
            ", ".join(removed[:10]),
        )
    return CutSet.from_cuts(kept), removed


def entry_frames(entry: dict, frame_shift_s: float) -> int:
    """Input frames of a cut's manifest entry: its features' count, or duration / frame shift."""
    features = entry.get("features")
    if isinstance(features, dict) and features.get("num_frames") is not None:
        return int(features["num_frames"])
    return round(float(entry["duration"]) / frame_shift_s)


def filter_ctc_feasible_index(
    index: CutIndex, tokenizer: Tokenizer, frame_shift_s: float, max_speed: float = 1.0, *, cache_key: str = ""
) -> tuple[CutIndex, list[str]]:
    """:func:`filter_ctc_feasible` over a :class:`CutIndex`: one sequential pass over its
    line store (manifest entries, no ``Cut`` objects); returns (the sub-index kept, removed ids).

    Same rule, same ids removed, as :func:`filter_ctc_feasible` on the same cuts. With a
    ``cache_key`` (naming the tokenizer's content), the verdicts are kept in the index's shared
    store (:meth:`CutIndex.cached_array`): a later start on the same store skips the pass.
    """

    def verdicts() -> np.ndarray:
        keep = np.zeros(len(index), dtype=bool)
        positions: list[int] = []
        texts: list[str] = []
        frames: list[int] = []

        def judge() -> None:  # one batch of texts through the tokenizer, the frame arithmetic in numpy
            needed = [ctc_frames_needed(ids) if ids else NEVER for ids in tokenizer.encode_many(texts)]
            keep[positions] = subsampled_lengths(np.array(frames, dtype=np.int64)) >= np.array(needed)
            positions.clear(), texts.clear(), frames.clear()

        for position, entry in index.iter_entries():  # only strings and ints are kept: no dicts for the GC to walk
            positions.append(position)
            texts.append(" ".join(s["text"] for s in entry.get("supervisions", []) if s.get("text")))
            frames.append(int(entry_frames(entry, frame_shift_s) / max_speed))
            if len(positions) == VERDICT_CHUNK:
                judge()
        judge()
        return keep

    name = f"ctc-{cache_key}-{frame_shift_s!r}-{max_speed!r}"
    keep = index.cached_array(name, verdicts) if cache_key else verdicts()
    removed = index.id_list(np.flatnonzero(~keep))
    if removed:
        logger.warning(
            "removed %d of %d utterances too short for their transcript after subsampling by 4 "
            "(or with an empty one): %s",
            len(removed),
            len(index),
            ", ".join(removed[:10]),
        )
    return index.select(np.flatnonzero(keep)), removed
