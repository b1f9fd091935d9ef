"""Removing utterances CTC cannot align: too few output frames for their tokens.

One rule for the train and the dev cuts (:func:`ctc_feasible`): a cut is kept when its
transcript has tokens and the encoder's output frames, at the fastest speed perturbation
training may apply, are at least the frames CTC needs for them (:func:`ctc_frames_needed`).
Each cut is judged from its manifest entry (its transcript by
:func:`~asrflow.data.manifests.entry_text`, its frames by :func:`entry_frames`), in one
sequential pass over a :class:`~asrflow.data.loading.cut_index.CutIndex` that tokenizes
:data:`VERDICT_CHUNK` transcripts at a time (:func:`ctc_verdicts`): train's index comes from
the manifest's line store, dev's cuts are indexed in memory (:func:`filter_ctc_feasible`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
from lhotse import CutSet

from asrflow.data.loading.cut_index import CutIndex
from asrflow.data.manifests import entry_text
from asrflow.model.conformer_ctc import subsampled_lengths
from asrflow.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
#: Cuts judged at once by :func:`ctc_verdicts` (their texts are tokenized as one batch).
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


def entry_frames(entry: dict, frame_shift_s: float) -> int:
    """Input frames of a cut's manifest entry: its features' count, or duration / frame shift."""
    features = entry.get("features")
    if isinstance(features, dict) and features.get("num_frames") is not None:
        return int(features["num_frames"])
    return round(float(entry["duration"]) / frame_shift_s)


def ctc_feasible(token_ids: Sequence[list[int]], input_frames: np.ndarray) -> np.ndarray:
    """The rule: ``(N,)`` bool, whether CTC can align each transcript's tokens to its input frames.

    Args:
        token_ids: each cut's transcript as token ids (an empty one is never feasible).
        input_frames: ``(N,)`` int64 input frames of each cut, at the fastest speed training applies.
    """
    needed = np.array([ctc_frames_needed(ids) if ids else NEVER for ids in token_ids], dtype=np.int64)
    return subsampled_lengths(np.asarray(input_frames, dtype=np.int64)) >= needed


def ctc_verdicts(index: CutIndex, tokenizer: Tokenizer, frame_shift_s: float, max_speed: float = 1.0) -> np.ndarray:
    """``(len(index),)`` bool, :func:`ctc_feasible` for every cut of ``index`` (in id order).

    One pass over the index's entries (its line store front to back, no ``Cut`` objects); the
    texts are tokenized :data:`VERDICT_CHUNK` at a time.

    Args:
        index: the cuts.
        tokenizer: the tokenizer the targets come from.
        frame_shift_s: seconds per input frame.
        max_speed: the fastest speed perturbation factor training may apply (1.1 shortens an
            utterance to 1/1.1 of its frames, rounded down); a cut must be feasible at that speed too.
    """
    keep = np.zeros(len(index), dtype=bool)
    positions: list[int] = []
    texts: list[str] = []
    frames: list[int] = []

    def judge() -> None:  # one batch of texts through the tokenizer, the frame arithmetic in numpy
        if positions:
            keep[positions] = ctc_feasible(tokenizer.encode_many(texts), np.array(frames, dtype=np.int64))
        positions.clear(), texts.clear(), frames.clear()

    for position, entry in index.iter_entries():  # only strings and ints are kept: no dicts for the GC to walk
        positions.append(position)
        texts.append(entry_text(entry))
        frames.append(int(entry_frames(entry, frame_shift_s) / max_speed))
        if len(positions) == VERDICT_CHUNK:
            judge()
    judge()
    return keep


def filter_ctc_feasible_index(
    index: CutIndex, tokenizer: Tokenizer, frame_shift_s: float, max_speed: float = 1.0, *, cache_key: str = ""
) -> tuple[CutIndex, list[str]]:
    """The cuts of ``index`` that pass :func:`ctc_verdicts`: returns (the sub-index kept, removed ids
    in id order).

    With a ``cache_key`` (naming the tokenizer's content), the verdicts are kept in the index's
    shared store (:meth:`CutIndex.cached_array`): a later start on the same store skips the pass.
    """
    name = f"ctc-{cache_key}-{frame_shift_s!r}-{max_speed!r}"
    if cache_key:
        keep = index.cached_array(name, lambda: ctc_verdicts(index, tokenizer, frame_shift_s, max_speed))
    else:
        keep = ctc_verdicts(index, tokenizer, frame_shift_s, max_speed)
    removed = index.id_list(np.flatnonzero(~keep))
    _warn_removed(removed, len(index))
    return index.select(np.flatnonzero(keep)), removed


def filter_ctc_feasible(
    cuts: CutSet, tokenizer: Tokenizer, frame_shift_s: float, max_speed: float = 1.0
) -> tuple[CutSet, list[str]]:
    """:func:`filter_ctc_feasible_index` for cuts held in memory (dev): the same verdicts; returns
    (the cuts kept, removed ids), both in the order of ``cuts``.

    Args:
        cuts: cuts with features (their frame count is used) or without (duration / frame shift).
        tokenizer, frame_shift_s, max_speed: as for :func:`ctc_verdicts`.
    """
    cuts = list(cuts)
    index = CutIndex.from_cuts(cuts)
    kept_ids = set(index.id_list(np.flatnonzero(ctc_verdicts(index, tokenizer, frame_shift_s, max_speed))))
    removed = [cut.id for cut in cuts if cut.id not in kept_ids]
    _warn_removed(removed, len(cuts))
    return CutSet.from_cuts(cut for cut in cuts if cut.id in kept_ids), removed


def _warn_removed(removed: list[str], total: int) -> None:
    """One warning naming how many of ``total`` utterances were removed, and the first ten (none: silent)."""
    if removed:
        logger.warning(
            "removed %d of %d utterances too short for their transcript after subsampling by 4 "
            "(or with an empty one): %s",
            len(removed),
            total,
            ", ".join(removed[:10]),
        )
