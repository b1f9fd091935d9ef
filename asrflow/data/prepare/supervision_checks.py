"""Checks of one supervision against its (good) recording: segment times, channel, duration, transcript.

**Channels.** ``channel: mix`` keeps every channel of a multi-channel recording: the
supervision names all channels, the cut is a Lhotse ``MultiCut``, and the features stage
downmixes it (``cut.to_mono(mono_downmix=True)``, the average of the channels).
``channel: k`` (an int) selects channel ``k`` of multi-channel recordings (a ``MonoCut``
on that channel); a multi-channel recording without channel ``k`` is rejected. A mono
recording has one channel to give and is used as it is under either setting. When a
recipe's supervisions of one recording already name different channels (two-sided
telephone calls: one transcript per channel), they are kept as the recipe made them.

**Long utterances.** ``long_utterances: drop`` rejects an utterance longer than
``max_duration_s``; ``split`` cuts it at its word boundaries
(:func:`asrflow.data.prepare.alignment.split_by_alignment`).
"""

from __future__ import annotations

from dataclasses import dataclass

from lhotse import Recording, SupervisionSegment
from lhotse.qa import validate
from lhotse.utils import fastcopy, is_equal_or_contains

from asrflow.data.prepare.alignment import split_by_alignment
from asrflow.data.prepare.rejections import (
    BAD_SEGMENT,
    CHANNEL_OUT_OF_RANGE,
    DUPLICATE_ID,
    EMPTY_TRANSCRIPT,
    INVALID_MANIFEST,
    TOO_LONG,
    TOO_SHORT,
    ItemRejected,
)
from asrflow.data.prepare.text import TextConfig, normalize_text
from asrflow.errors import first_line

#: A segment may end this many seconds after its recording (rounding in Kaldi ``segments``
#: files); it is clipped to the recording's end. A larger overrun is a ``bad_segment``.
SEGMENT_END_TOLERANCE_S = 0.05


@dataclass(frozen=True, kw_only=True)
class ValidationRules:
    """The checks' settings, taken from ``prepare`` in ``params.yaml``.

    Attributes:
        min_duration_s: shortest utterance kept, in seconds.
        max_duration_s: longest utterance kept, in seconds.
        long_utterances: ``drop`` or ``split``.
        channel: ``"mix"`` or a channel index.
        text: the text normalisation settings.
    """

    min_duration_s: float
    max_duration_s: float
    long_utterances: str
    channel: str | int
    text: TextConfig


def _choose_channel(
    recording: Recording, supervision: SupervisionSegment, rules: ValidationRules, per_channel: bool
) -> int | list[int]:
    channel_ids = list(recording.channel_ids)
    if len(channel_ids) == 1:
        return channel_ids[0]
    if per_channel:
        named = supervision.channel if isinstance(supervision.channel, list) else [supervision.channel]
        if all(channel in channel_ids for channel in named):
            return supervision.channel
        raise ItemRejected(
            CHANNEL_OUT_OF_RANGE,
            f"the supervision names channel(s) {named} but the recording has channels {channel_ids}",
        )
    if rules.channel == "mix":
        return channel_ids
    if rules.channel in channel_ids:
        return int(rules.channel)
    raise ItemRejected(
        CHANNEL_OUT_OF_RANGE,
        f"prepare.channel = {rules.channel} but the recording has channels {channel_ids}; "
        "use channel: mix or an index that exists",
    )


def check_supervision(
    supervision: SupervisionSegment, recording: Recording, rules: ValidationRules, per_channel: bool
) -> list[SupervisionSegment]:
    """Check one supervision against its (good) recording; returns the piece(s) to finish.

    Times are in seconds on the recording's time line. A segment that overruns its recording
    by at most :data:`SEGMENT_END_TOLERANCE_S` is clipped to its end; the channel is chosen
    (see the module docstring); a supervision over ``rules.max_duration_s`` is dropped or
    cut (:func:`~asrflow.data.prepare.alignment.split_by_alignment`).

    Raises:
        ItemRejected: ``bad_segment``, ``channel_out_of_range``, ``too_short``, ``too_long``
        or ``too_long_no_alignment``.
    """
    start, end = supervision.start, supervision.end
    if (
        start < 0
        or supervision.duration <= 0
        or start >= recording.duration
        or (end > recording.duration + SEGMENT_END_TOLERANCE_S)
    ):
        raise ItemRejected(
            BAD_SEGMENT,
            f"segment [{start:.3f}, {end:.3f}] s does not fit recording {recording.id} "
            f"of {recording.duration:.3f} s; fix the segment times",
        )
    if end > recording.duration:
        supervision = fastcopy(supervision, duration=round(recording.duration - start, 6))
    channel = _choose_channel(recording, supervision, rules, per_channel)
    supervision = fastcopy(supervision, channel=channel)
    if supervision.duration < rules.min_duration_s:
        raise ItemRejected(
            TOO_SHORT,
            f"lasts {supervision.duration:.3f} s < min_duration_s = {rules.min_duration_s} s",
        )
    if supervision.duration > rules.max_duration_s:
        if rules.long_utterances == "drop":
            raise ItemRejected(
                TOO_LONG,
                f"lasts {supervision.duration:.2f} s > max_duration_s = {rules.max_duration_s} s "
                "(long_utterances: drop); raise max_duration_s or use long_utterances: split",
            )
        pieces = split_by_alignment(supervision, rules.max_duration_s)
    else:
        pieces = [supervision]
    return pieces


def _finish_piece(piece: SupervisionSegment, recording: Recording, rules: ValidationRules) -> SupervisionSegment:
    if piece.duration < rules.min_duration_s:
        raise ItemRejected(TOO_SHORT, f"lasts {piece.duration:.3f} s < min_duration_s = {rules.min_duration_s} s")
    text = normalize_text(piece.text or "", rules.text)
    if not text:
        raise ItemRejected(
            EMPTY_TRANSCRIPT,
            f"transcript {piece.text!r} is empty after normalisation; add the transcript or drop the item",
        )
    piece = fastcopy(piece, text=text)
    try:
        validate(piece)
    except AssertionError as error:
        raise ItemRejected(INVALID_MANIFEST, first_line(error)) from None
    # The pair checks of lhotse.qa.validate_recordings_and_supervisions, for one pair.
    if not -1e-3 <= piece.start <= piece.end <= recording.duration + 1e-3:
        raise ItemRejected(
            INVALID_MANIFEST, f"spans [{piece.start}, {piece.end}] s, outside its recording [0, {recording.duration}] s"
        )
    if not is_equal_or_contains(recording.channel_ids, piece.channel):
        raise ItemRejected(
            INVALID_MANIFEST, f"channel {piece.channel} is not in its recording's channels {recording.channel_ids}"
        )
    return piece


def finish_pieces(
    pieces: list[SupervisionSegment], recording: Recording, rules: ValidationRules, seen_ids: set[str]
) -> tuple[list[SupervisionSegment], list[tuple[str, ItemRejected]]]:
    """The pieces of one item that pass the last checks, and ``(id, why)`` for the others.

    A kept piece's id goes into ``seen_ids``, so a later piece (or item) with the same id is
    a duplicate; a rejected piece leaves its id free for a later valid copy.
    """
    finished: list[SupervisionSegment] = []
    failed: list[tuple[str, ItemRejected]] = []
    for piece in pieces:
        try:
            if piece.id in seen_ids:
                raise ItemRejected(DUPLICATE_ID, f"piece id {piece.id!r} was already used by a kept item")
            finished.append(_finish_piece(piece, recording, rules))
            seen_ids.add(piece.id)
        except ItemRejected as error:
            failed.append((piece.id, error))
    return finished, failed
