"""The validator of a split: streams its utterances through the checks, a chunk at a time, in threads.

It checks each recording once (:func:`~asrflow.data.prepare.audio_checks.check_recording`,
in a thread pool), each supervision against it
(:mod:`asrflow.data.prepare.supervision_checks`), and that an id is kept once: the first
*valid* copy of an id is kept and later copies are rejected (``duplicate_id``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from lhotse import Recording, RecordingSet, SupervisionSegment, SupervisionSet

from asrflow.data.prepare.audio_checks import audio_path, check_recording
from asrflow.data.prepare.rejections import DUPLICATE_ID, MISSING_RECORDING, ItemRejected, Rejection
from asrflow.data.prepare.supervision_checks import ValidationRules, check_supervision, finish_pieces
from asrflow.logs import progress

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class ValidatedSplit:
    """What survives the checks of one split, plus what did not.

    Attributes:
        recordings: recordings referenced by a kept supervision, sorted by id.
        supervisions: kept supervisions (normalised text, chosen channel), sorted by id.
        rejected: the rejected items, in input order.
    """

    recordings: RecordingSet
    supervisions: SupervisionSet
    rejected: list[Rejection] = field(default_factory=list)


def map_in_threads(
    function: Callable[[T], R], items: Iterable[T], desc: str, *, show: bool = True
) -> list[R | ItemRejected]:
    """Apply ``function`` to every item in a thread pool (I/O bound), keeping input order.

    An :class:`ItemRejected` raised for an item is returned in its place. ``desc`` labels
    the progress bar (or the periodic log line when stderr is not a terminal); ``show=False``
    shows none (the caller reports progress over many calls).
    """

    def guarded(item: T) -> R | ItemRejected:
        try:
            return function(item)
        except ItemRejected as rejected:
            return rejected

    items = list(items)
    if len(items) < 8:
        return [guarded(item) for item in items]
    workers = max(1, min(16, 2 * (os.cpu_count() or 1)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = pool.map(guarded, items)
        return list(progress(results, desc, total=len(items)) if show else results)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One utterance as read from the corpus, streamed to validation.

    Attributes:
        supervision: raw transcript in ``text``, times in seconds.
        recording: its recording (header read), or why it cannot be used, or ``None``
            when the corpus has no such recording.
        path: the audio path as the corpus gives it, for the report.
        per_channel: the corpus names the channel of each supervision of this recording
            (two-sided calls): keep the supervision's channel as it is.
        checked: the recording was read by :func:`~asrflow.data.prepare.audio_checks.open_recording`,
            which also checked that it decodes to its end.
    """

    supervision: SupervisionSegment
    recording: Recording | ItemRejected | None
    path: str | None = None
    per_channel: bool = False
    checked: bool = False


@dataclass(frozen=True)
class Kept:
    """An utterance that passed every check: its piece(s) and its (checked) recording.

    Attributes:
        pieces: the supervision, or its pieces under ``long_utterances: split``
            (normalised text, chosen channel).
        recording: the recording they belong to.
    """

    pieces: list[SupervisionSegment]
    recording: Recording


class SplitValidator:
    """Checks a split's utterances as they stream by, a chunk at a time.

    Each recording is checked once (:func:`check_recording`, in a thread pool per chunk);
    the last :data:`CHECKED_CACHE` results are kept, so the segments of one recording that
    follow each other cost one check. ``seen_ids`` (ids kept so far, in this split and
    earlier ones) is the one thing that grows: one string per kept utterance.

    Args:
        split: our split name, for the report.
        rules: the checks' settings.
        seen_ids: ids kept in earlier splits; updated with the ids kept here.
        duration_limits: apply ``min_duration_s`` / ``max_duration_s`` (train); ``False``
            keeps a corpus' own dev and test whole, as published.
    """

    def __init__(self, split: str, rules: ValidationRules, seen_ids: set[str], *, duration_limits: bool = True) -> None:
        self.split = split
        self.rules = (
            rules if duration_limits else dataclasses.replace(rules, min_duration_s=0.0, max_duration_s=math.inf)
        )
        self.seen_ids = seen_ids
        self.checked: OrderedDict[str, Recording | ItemRejected] = OrderedDict()

    def _check_recordings(self, recordings: list[Recording]) -> None:
        fresh = list({r.id: r for r in recordings if r.id not in self.checked}.values())
        results = map_in_threads(check_recording, fresh, f"checking audio ({self.split})", show=False)
        for recording, result in zip(fresh, results, strict=True):
            self.checked[recording.id] = result
        for recording in recordings:
            self.checked.move_to_end(recording.id)
        while len(self.checked) > CHECKED_CACHE + len(recordings):
            self.checked.popitem(last=False)

    def _rejection(self, item_id: str, recording: Recording | None, error: ItemRejected) -> Rejection:
        return Rejection(
            split=self.split, id=item_id, path=audio_path(recording), reason=error.reason, detail=error.detail
        )

    def check(self, candidates: list) -> Iterator[Kept | Rejection]:
        """Check a chunk of :class:`Candidate`; yields, in order, what is kept or rejected."""
        self._check_recordings(
            [c.recording for c in candidates if isinstance(c.recording, Recording) and not c.checked]
        )
        for candidate in candidates:
            supervision, recording = candidate.supervision, candidate.recording
            known = recording if isinstance(recording, Recording) else None
            try:
                if supervision.id in self.seen_ids:
                    raise ItemRejected(
                        DUPLICATE_ID, f"id {supervision.id!r} was already used by a kept item; the first is kept"
                    )
                if recording is None:
                    raise ItemRejected(
                        MISSING_RECORDING, f"recording {supervision.recording_id!r} is not in the corpus"
                    )
                if isinstance(recording, ItemRejected):
                    raise recording
                status = recording if candidate.checked else self.checked[recording.id]
                if isinstance(status, ItemRejected):
                    raise status
                pieces = check_supervision(supervision, recording, self.rules, candidate.per_channel)
            except ItemRejected as error:
                yield Rejection(
                    split=self.split,
                    id=supervision.id,
                    path=candidate.path or audio_path(known),
                    reason=error.reason,
                    detail=error.detail,
                )
                continue
            finished, failed = finish_pieces(pieces, recording, self.rules, self.seen_ids)
            for piece_id, error in failed:
                yield self._rejection(piece_id, recording, error)
            if finished:
                self.seen_ids.add(supervision.id)
                yield Kept(finished, recording)


#: Recordings whose check results :class:`SplitValidator` keeps.
CHECKED_CACHE = 1024


def validate_split(
    split: str,
    recordings: RecordingSet,
    *,
    supervisions: SupervisionSet,
    rules: ValidationRules,
    seen_ids: set[str],
) -> ValidatedSplit:
    """Check every supervision of one split held in memory (:class:`SplitValidator` on one chunk).

    Args:
        split: our split name, for the report.
        recordings: the split's recordings (extra or duplicate ones are ignored).
        supervisions: the split's supervisions, in corpus order (the first valid copy of a
            duplicated id is kept).
        rules: the checks' settings.
        seen_ids: ids kept in earlier splits; updated with the ids kept here (an item's id
            and its pieces' ids).

    Returns:
        The kept recordings and supervisions (sorted by id) and the rejections.
    """
    by_id: dict[str, Recording] = {}
    for recording in recordings:
        if recording.id in by_id:
            logger.warning("%s: recording id %s appears twice; the first is used", split, recording.id)
            continue
        by_id[recording.id] = recording
    supervisions = list(supervisions)
    channels_named: dict[str, set] = defaultdict(set)
    for supervision in supervisions:
        channel = supervision.channel
        channels_named[supervision.recording_id].add(tuple(channel) if isinstance(channel, list) else channel)
    candidates = [
        Candidate(
            supervision=s,
            recording=by_id.get(s.recording_id),
            per_channel=len(channels_named[s.recording_id]) > 1,
        )
        for s in supervisions
    ]
    kept: list[SupervisionSegment] = []
    rejected: list[Rejection] = []
    for outcome in SplitValidator(split, rules, seen_ids).check(candidates):
        if isinstance(outcome, Rejection):
            rejected.append(outcome)
        else:
            kept.extend(outcome.pieces)
    kept.sort(key=lambda s: s.id)
    kept_recordings = sorted({s.recording_id for s in kept})
    return ValidatedSplit(
        RecordingSet.from_recordings(by_id[rid] for rid in kept_recordings),
        SupervisionSet.from_segments(kept),
        rejected,
    )
