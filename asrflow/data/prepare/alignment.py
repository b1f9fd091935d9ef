"""Cutting a long utterance into pieces at its word boundaries (``long_utterances: split``).

``split`` cuts an utterance longer than ``max_duration_s`` into consecutive windows of at
most ``max_duration_s`` each, but only when the utterance carries a word-level alignment
(``supervision.alignment["word"]``, e.g. LibriSpeech with its alignment files): words are
packed greedily into windows, a window ends half-way through the pause after its last word
(the last one at the utterance's end), and each piece's transcript is its own words, in
order, taken from the alignment. Piece ids are ``<id>-part<k>`` (k = 0, 1, ...). An
utterance without a word alignment is rejected as ``too_long_no_alignment``: cutting audio
without knowing where its words fall would pair pieces with the wrong text. Pieces then
pass the same checks as every utterance (length, transcript).
"""

from __future__ import annotations

from lhotse import SupervisionSegment
from lhotse.supervision import AlignmentItem
from lhotse.utils import fastcopy

from asrflow.data.prepare.rejections import TOO_LONG, TOO_LONG_NO_ALIGNMENT, ItemRejected

#: Slack for float rounding when comparing durations, in seconds.
EPSILON_S = 1e-6

#: Alignment symbols that mark silence rather than a word.
SILENCE_SYMBOLS = frozenset({"", "<eps>", "sil", "SIL", "<sil>", "sp", "<unk>_sil"})


def split_by_alignment(supervision: SupervisionSegment, max_duration_s: float) -> list[SupervisionSegment]:
    """Cut a long supervision into pieces of at most ``max_duration_s`` at word boundaries.

    The rule (see the module docstring): words of ``alignment["word"]`` (silences
    skipped) are packed greedily; a piece ends half-way through the pause after its last
    word, the last piece at the supervision's end. Times are in seconds, on the
    recording's time line.

    Raises:
        ItemRejected: ``too_long_no_alignment`` without a word alignment, ``too_long``
        when one word (with its surrounding pauses) is longer than ``max_duration_s``.
    """
    alignment = (supervision.alignment or {}).get("word") or []
    words: list[AlignmentItem] = sorted(
        (word for word in alignment if word.symbol.strip() not in SILENCE_SYMBOLS),
        key=lambda word: word.start,
    )
    if not words:
        raise ItemRejected(
            TOO_LONG_NO_ALIGNMENT,
            f"lasts {supervision.duration:.2f} s > max_duration_s and has no word alignment "
            "to split the transcript; shorten it, add word alignments, or raise prepare.max_duration_s",
        )

    groups = _word_groups(supervision, words, max_duration_s)
    return [
        fastcopy(
            supervision,
            id=f"{supervision.id}-part{index}",
            start=round(begin, 6),
            duration=round(end - begin, 6),
            text=" ".join(word.symbol for word in group),
            alignment={"word": group},
        )
        for index, (begin, end, group) in enumerate(groups)
    ]


def _word_groups(
    supervision: SupervisionSegment, words: list[AlignmentItem], max_duration_s: float
) -> list[tuple[float, float, list[AlignmentItem]]]:
    """``words`` (sorted, no silences) packed greedily into ``(start, end, words)`` windows of at
    most ``max_duration_s``, each ending half-way through the pause after its last word.

    Raises:
        ItemRejected: ``too_long`` when one word (with its surrounding pauses) is longer than ``max_duration_s``.
    """

    def boundary_after(index: int) -> float:
        if index == len(words) - 1:
            return supervision.end
        gap_middle = (words[index].end + words[index + 1].start) / 2
        return min(max(gap_middle, supervision.start), supervision.end)

    groups: list[tuple[float, float, list[AlignmentItem]]] = []
    start = supervision.start
    current: list[AlignmentItem] = []
    for index, word in enumerate(words):
        end = boundary_after(index)
        if end - start <= max_duration_s + EPSILON_S:
            current.append(word)
            continue
        if not current:
            raise _word_too_long(supervision, word, max_duration_s)
        new_start = boundary_after(index - 1)
        groups.append((start, new_start, current))
        start, current = new_start, [word]
        if end - start > max_duration_s + EPSILON_S:
            raise _word_too_long(supervision, word, max_duration_s)
    groups.append((start, supervision.end, current))
    return groups


def _word_too_long(supervision: SupervisionSegment, word: AlignmentItem, max_duration_s: float) -> ItemRejected:
    """The ``too_long`` rejection of a supervision with a word whose stretch alone exceeds ``max_duration_s``."""
    return ItemRejected(
        TOO_LONG,
        f"lasts {supervision.duration:.2f} s and the stretch around word {word.symbol!r} "
        f"alone is longer than max_duration_s = {max_duration_s} s; raise prepare.max_duration_s",
    )
