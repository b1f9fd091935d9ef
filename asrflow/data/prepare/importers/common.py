"""What the importers share: the stream of items they yield, line-by-line reading of the
corpus' text files, and reading audio headers a chunk at a time.

An importer (:mod:`~asrflow.data.prepare.importers.folder`,
:mod:`~asrflow.data.prepare.importers.kaldi`, :mod:`~asrflow.data.prepare.importers.recipes`)
streams, per split, the utterances to validate (:class:`~asrflow.data.prepare.validator.Candidate`)
and the items it had to reject while reading (see :mod:`asrflow.data.prepare.rejections` for
the reasons). Transcripts are streamed raw; normalisation and the remaining checks happen in
:class:`asrflow.data.prepare.validator.SplitValidator`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from lhotse import Recording, RecordingSet, SupervisionSegment, SupervisionSet

from asrflow.data.prepare.audio_checks import open_command_recording, open_recording
from asrflow.data.prepare.path_checks import resolve_inside
from asrflow.data.prepare.rejections import NON_UTF8, ItemRejected, Rejection
from asrflow.data.prepare.validator import Candidate, map_in_threads

T = TypeVar("T")


@dataclass
class ImportedSplit:
    """One split as read from the corpus, before validation, held in memory (small corpora, tests).

    Attributes:
        recordings: the split's recordings (audio headers read, native sampling rate).
        supervisions: one per utterance, raw transcript in ``text``, times in seconds.
        rejected: items refused while reading.
    """

    recordings: RecordingSet
    supervisions: SupervisionSet
    rejected: list[Rejection] = field(default_factory=list)


#: What an importer streams: utterances to validate, and items refused while reading.
Item = Candidate | Rejection

#: Utterances whose audio headers are read together in a thread pool.
PROBE_CHUNK = 512


def collect(items: Iterable[Item]) -> ImportedSplit:
    """Gather a stream into an :class:`ImportedSplit` (recordings once each, in first-seen order)."""
    recordings: dict[str, Recording] = {}
    supervisions: list[SupervisionSegment] = []
    rejected: list[Rejection] = []
    for item in items:
        if isinstance(item, Rejection):
            rejected.append(item)
        elif isinstance(item.recording, Recording):
            recordings.setdefault(item.recording.id, item.recording)
            supervisions.append(item.supervision)
    return ImportedSplit(
        RecordingSet.from_recordings(recordings.values()), SupervisionSet.from_segments(supervisions), rejected
    )


@dataclass(frozen=True)
class Line:
    """One line of a text file: its 1-based number and its text (``None`` if not UTF-8)."""

    number: int
    text: str | None
    raw: bytes
    error: str = ""


def read_lines(path: Path) -> Iterator[Line]:
    """Read a text file line by line as bytes and decode each line as UTF-8 on its own.

    The file is streamed (constant memory). A UTF-8 byte-order mark at the start of the
    file is dropped; ``\\r\\n`` endings are accepted. Blank lines are skipped.
    """
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            raw = raw.rstrip(b"\n").rstrip(b"\r")
            if not raw.strip():
                continue
            try:
                yield Line(number, raw.decode("utf-8"), raw)
            except UnicodeDecodeError as error:
                yield Line(number, None, raw, f"byte 0x{raw[error.start]:02x} at column {error.start + 1}")


def non_utf8_rejection(split: str, item_id: str, *, path: str | None, file: Path, line: Line) -> Rejection:
    return Rejection(
        split=split,
        id=item_id,
        path=path,
        reason=NON_UTF8,
        detail=f"line {line.number} of {file} is not valid UTF-8 ({line.error}); save the file as UTF-8",
    )


def decode_loose(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def probe_recordings(
    root: Path, pending: list[tuple[str, str]], split: str, *, commands: bool = False
) -> list[Recording | ItemRejected]:
    """Resolve and open ``(recording_id, raw_path)`` pairs in a thread pool.

    With ``commands`` (a Kaldi ``wav.scp`` under ``prepare.allow_commands``), a raw path
    ending in ``|`` is a shell command to run (:func:`open_command_recording`); otherwise every
    raw path is a file inside ``root``.
    """

    def probe(item: tuple[str, str]) -> Recording:
        recording_id, raw = item
        if commands and raw.endswith("|"):
            return open_command_recording(raw[:-1].strip(), recording_id)
        return open_recording(resolve_inside(root, raw), recording_id)

    return map_in_threads(probe, pending, f"reading audio headers ({split})", show=False)


def chunked(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """Consecutive lists of ``size`` items (the last one shorter)."""
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk
