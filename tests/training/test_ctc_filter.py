"""Removing utterances CTC cannot align, on generated cuts (no audio) and the real yesno tokenizer.

The yesno tokenizer spells words letter by letter, so "NOO YESS" holds two repeated tokens:
CTC needs a blank between each pair, i.e. two output frames more than tokens.
"""

from __future__ import annotations

import math

import pytest
from lhotse import CutSet, MonoCut, SupervisionSegment

from asrflow.data.loading import ctc_filter
from asrflow.data.loading.augment import SPEED_FACTORS
from asrflow.data.loading.ctc_filter import ctc_frames_needed, filter_ctc_feasible, output_frames
from asrflow.data.loading.cut_index import CutIndex
from asrflow.tokenizer import MODEL_FILE, Tokenizer

FRAME_SHIFT_S = 0.01
REPEATED = "NOO YESS"
PLAIN = "NO YES"
SAME_LENGTH_PLAIN = "NO YESNO"  # as many tokens as REPEATED, none repeated


def _cut(cut_id: str, frames: int, text: str) -> MonoCut:
    duration = round(frames * FRAME_SHIFT_S, 6)
    supervision = SupervisionSegment(id=cut_id, recording_id=cut_id, start=0.0, duration=duration, text=text)
    return MonoCut(id=cut_id, start=0.0, duration=duration, channel=0, supervisions=[supervision])


def _min_input_frames(output_needed: int) -> int:
    """Fewest input frames whose subsampled length reaches ``output_needed``."""
    frames = 1
    while output_frames(frames) < output_needed:
        frames += 1
    return frames


@pytest.fixture(scope="module")
def tokenizer(yesno_data) -> Tokenizer:
    return Tokenizer(yesno_data / "lang" / MODEL_FILE)


def test_repeated_tokens_need_a_blank_between_them(tokenizer):
    repeated, plain = tokenizer.encode(REPEATED), tokenizer.encode(PLAIN)
    assert ctc_frames_needed(plain) == len(plain)
    assert ctc_frames_needed(repeated) == len(repeated) + 2


@pytest.mark.parametrize("chunk", [2, 10_000])
def test_filter_counts_too_short_repeats_and_empty_transcripts(tokenizer, chunk, monkeypatch):
    """The same verdicts from the cuts and from their index, whose pass judges ``chunk`` cuts at a time."""
    repeated = tokenizer.encode(REPEATED)
    enough = _min_input_frames(ctc_frames_needed(repeated))
    tokens_only = _min_input_frames(len(repeated))  # room for the tokens, not for the blanks between repeats
    assert tokens_only < enough
    plain = tokenizer.encode(SAME_LENGTH_PLAIN)
    assert len(plain) == len(repeated) and ctc_frames_needed(plain) == len(plain)
    cuts = CutSet.from_cuts(
        [
            _cut("fits", enough, REPEATED),
            _cut("one-frame-short", enough - 1, REPEATED),
            _cut("no-room-for-blanks", tokens_only, REPEATED),
            _cut("plain-fits", tokens_only, SAME_LENGTH_PLAIN),
            _cut("empty", enough, ""),
        ]
    )
    kept, removed = filter_ctc_feasible(cuts, tokenizer, FRAME_SHIFT_S)
    assert removed == ["one-frame-short", "no-room-for-blanks", "empty"]
    assert sorted(cut.id for cut in kept) == ["fits", "plain-fits"]
    monkeypatch.setattr(ctc_filter, "VERDICT_CHUNK", chunk)
    kept_index, removed_index = ctc_filter.filter_ctc_feasible_index(CutIndex.from_cuts(cuts), tokenizer, FRAME_SHIFT_S)
    assert removed_index == sorted(removed) and kept_index.id_list() == ["fits", "plain-fits"]


def test_filter_accounts_for_the_fastest_speed_perturbation(tokenizer):
    repeated = tokenizer.encode(REPEATED)
    enough = _min_input_frames(ctc_frames_needed(repeated))
    fastest = max(SPEED_FACTORS)
    assert fastest == 1.1
    enough_when_fast = math.ceil(enough * fastest) + 1
    cuts = CutSet.from_cuts([_cut("fits-at-1.0", enough, REPEATED), _cut("fits-at-1.1", enough_when_fast, REPEATED)])

    kept, removed = filter_ctc_feasible(cuts, tokenizer, FRAME_SHIFT_S)
    assert removed == []
    kept, removed = filter_ctc_feasible(cuts, tokenizer, FRAME_SHIFT_S, max_speed=fastest)
    assert removed == ["fits-at-1.0"]
    assert [cut.id for cut in kept] == ["fits-at-1.1"]
