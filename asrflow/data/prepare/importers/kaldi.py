"""The Kaldi data folder importer.

**Kaldi data folders** (``corpus: kaldi``). For each split name ``S``, the folder
``<corpus_dir>/S/`` holds:

* ``wav.scp``: ``<recording-id> <audio path>``. Paths are relative to ``corpus_dir`` or
  absolute inside it. An entry ending in ``|`` is a command that writes the audio to stdout
  (``sox x.sph -t wav - |``, as WSJ, Switchboard and most Kaldi recipes write): a data file
  that runs commands is code, so it is rejected (``piped_command``) unless
  ``prepare.allow_commands: true``; then the command is run once to read its audio (a
  failure rejects its utterances as ``command_failed``) and its recording is a Lhotse
  ``command`` source, which the later stages run again to load the audio. Commands run in
  the working directory and may read any file: ``corpus_dir`` does not bound them. Archive
  offsets (``wav.ark:123``) are always rejected (``piped_command``): convert the audio to files.
* ``text``: ``<utterance-id> <transcript>``. A repeated utterance id: every line goes to
  validation, which keeps the first *valid* transcript (as for TSVs). A repeated id in
  ``wav.scp`` or ``segments`` keeps its first line (the later ones are rejected as
  ``duplicate_id``): they name recordings and times, not the item's transcript.
* ``segments`` (optional): ``<utterance-id> <recording-id> <start-s> <end-s>``; an end of
  ``-1`` means the end of the recording. Without it, utterance id = recording id.
* ``utt2spk`` (optional): ``<utterance-id> <speaker>``.
"""

from __future__ import annotations

import logging
import re
import sys
from collections import OrderedDict
from collections.abc import Generator, Iterator
from pathlib import Path

from lhotse import Recording, SupervisionSegment

from asrflow.data.prepare.importers.common import (
    PROBE_CHUNK,
    ImportedSplit,
    Item,
    Line,
    chunked,
    collect,
    decode_loose,
    non_utf8_rejection,
    probe_recordings,
    read_lines,
)
from asrflow.data.prepare.rejections import (
    DUPLICATE_ID,
    MALFORMED_LINE,
    MISSING_RECORDING,
    MISSING_TRANSCRIPT,
    PIPED_COMMAND,
    ItemRejected,
    Rejection,
)
from asrflow.data.prepare.validator import Candidate
from asrflow.errors import AsrflowError

logger = logging.getLogger(__name__)

_ARCHIVE_OFFSET = re.compile(r"\.ark:\d+$")


def _kaldi_table(file: Path, split: str, *, min_fields: int, kind: str) -> Iterator[tuple[Line, list[str]] | Rejection]:
    """Lines of a Kaldi table split in two (key, rest) or more fields; bad lines become rejections."""
    for line in read_lines(file):
        key = decode_loose(line.raw.split(maxsplit=1)[0])
        if line.text is None:
            yield non_utf8_rejection(split, key, path=None, file=file, line=line)
            continue
        fields = line.text.split(maxsplit=1) if min_fields <= 2 else line.text.split()
        if len(fields) < min_fields:
            yield Rejection(
                split=split,
                id=key,
                path=None,
                reason=MALFORMED_LINE,
                detail=f"line {line.number} of {file} needs {min_fields} fields ({kind})",
            )
            continue
        yield line, fields


class _RecordingCache:
    """Audio headers of Kaldi recordings, read once while their segments are consecutive.

    Holds the last :data:`RECORDING_CACHE` recordings (segments of one recording usually
    follow each other; an interleaved order reads a header again, never wrongly).
    """

    def __init__(self, root: Path, wav: dict[str, str | ItemRejected], split: str, *, commands: bool) -> None:
        self.root, self.wav, self.split, self.commands = root, wav, split, commands
        self.cache: OrderedDict[str, Recording | ItemRejected] = OrderedDict()

    def fetch(self, rec_ids: list[str]) -> dict[str, Recording | ItemRejected | None]:
        """Each id's recording, its rejection, or ``None`` when ``wav.scp`` does not name it."""
        wanted = sorted({r for r in rec_ids if r not in self.cache and isinstance(self.wav.get(r), str)})
        for rec_id, result in zip(
            wanted,
            probe_recordings(self.root, [(r, self.wav[r]) for r in wanted], self.split, commands=self.commands),
            strict=True,
        ):
            self.cache[rec_id] = result
        found: dict[str, Recording | ItemRejected | None] = {}
        for rec_id in rec_ids:
            entry = self.wav.get(rec_id)
            found[rec_id] = self.cache.get(rec_id, entry if isinstance(entry, ItemRejected) else None)
            if rec_id in self.cache:
                self.cache.move_to_end(rec_id)
        while len(self.cache) > RECORDING_CACHE:
            self.cache.popitem(last=False)
        return found


#: Kaldi recordings whose headers stay cached (see :class:`_RecordingCache`).
RECORDING_CACHE = 1024


#: A ``segments`` entry: recording id, start and end in seconds (``-1``: the recording's end).
Segment = tuple[str, float, float]
#: A ``text`` line to read the audio of: utterance id, recording id, start, end (``None``: the
#: recording's end), transcript.
TextRow = tuple[str, str, float, float | None, str]


def stream_kaldi(corpus_dir: Path, name: str, split: str, *, allow_commands: bool = False) -> Iterator[Item]:
    """Stream the Kaldi data folder ``<corpus_dir>/<name>/`` (format in the module docstring).

    ``allow_commands`` (``prepare.allow_commands``) runs the ``wav.scp`` entries that are
    commands; without it they are rejected.

    ``text`` is streamed in file order. Held in memory: ``wav.scp`` (one path per
    recording), ``segments`` (recording, start, end per segment) and ``utt2spk`` (one
    speaker per utterance), about 300 bytes per segment in all.

    Raises:
        AsrflowError: when the folder, its ``wav.scp`` or its ``text`` is missing.
    """
    root = corpus_dir.resolve()
    folder = _kaldi_folder(root, name, split)
    wav = yield from _read_wav_scp(folder / "wav.scp", split, allow_commands=allow_commands)
    segments, unreadable_segments = yield from _read_segments(folder / "segments", split)
    speakers = _read_utt2spk(folder / "utt2spk")
    unreadable_text: set[str] = set()
    rows = _text_rows(
        folder / "text", split, segments, unreadable_segments=unreadable_segments, unreadable_text=unreadable_text
    )
    recordings = _RecordingCache(root, wav, split, commands=allow_commands)
    for chunk in chunked(rows, PROBE_CHUNK):
        yield from _candidates(chunk, recordings, wav, speakers=speakers, split=split)
    for utt_id in segments or ():  # what text did not consume
        if utt_id not in unreadable_text:
            yield Rejection(
                split=split,
                id=utt_id,
                path=None,
                reason=MISSING_TRANSCRIPT,
                detail=f"segments lists {utt_id!r} but text has no line for it",
            )


def _kaldi_folder(root: Path, name: str, split: str) -> Path:
    """``<root>/<name>``, checked to hold ``wav.scp`` and ``text``.

    Raises:
        AsrflowError: naming the missing file.
    """
    folder = root / name
    for required in ("wav.scp", "text"):
        if not (folder / required).is_file():
            raise AsrflowError(
                f"split {split!r}: {folder / required} not found (corpus: kaldi wants "
                f"<corpus_dir>/<split>/wav.scp and text); fix prepare.splits or the folder"
            )
    return folder


def _read_wav_scp(
    file: Path, split: str, *, allow_commands: bool
) -> Generator[Rejection, None, dict[str, str | ItemRejected]]:
    """Yields the rejections of repeated recording ids; returns recording id -> raw path (a
    command keeps its ``|``), or the reason it cannot be used. An unreadable line rejects the
    utterances of its recording (utterances are the items)."""
    wav: dict[str, str | ItemRejected] = {}
    for row in _kaldi_table(file, split, min_fields=2, kind="id path"):
        if isinstance(row, Rejection):
            wav.setdefault(row.id, ItemRejected(row.reason, row.detail))
            continue
        line, (rec_id, rest) = row
        rest = rest.strip()
        if rec_id in wav:
            yield Rejection(
                split=split,
                id=rec_id,
                path=rest,
                reason=DUPLICATE_ID,
                detail=f"wav.scp line {line.number} repeats recording id {rec_id!r}; the first is kept",
            )
            continue
        refused = _refusal(rest, allow_commands=allow_commands)
        wav[rec_id] = rest if refused is None else ItemRejected(PIPED_COMMAND, refused)
    return wav


def _refusal(entry: str, *, allow_commands: bool) -> str | None:
    """Why a ``wav.scp`` entry (stripped) is not read, or ``None`` when it is (a path, or an allowed command)."""
    if _ARCHIVE_OFFSET.search(entry):
        return (
            f"wav.scp entry {entry!r} is an archive offset, not an audio file; convert the audio to files "
            "(e.g. wav-copy the archive into .wav files)"
        )
    if entry.endswith("|"):
        if allow_commands:
            return None
        return (
            f"wav.scp entry {entry!r} is a command; running it means running code from the data file, so "
            "commands are refused unless you set prepare.allow_commands: true in params.yaml (prepare and "
            "the later stages then run each wav.scp command to read the audio it writes to stdout); or "
            "convert the audio to files (run the command into a .wav)"
        )
    if "|" in entry:
        return (
            f"wav.scp entry {entry!r} holds a '|' but does not end with one, as a Kaldi command does; "
            "fix the line, or convert the audio to files"
        )
    return None


def _read_segments(file: Path, split: str) -> Generator[Rejection, None, tuple[dict[str, Segment] | None, set[str]]]:
    """Yields the rejections of bad or repeated lines; returns utterance id -> :data:`Segment`
    (``None`` without a ``segments`` file) and the ids of unreadable lines."""
    unreadable: set[str] = set()
    if not file.is_file():
        return None, unreadable
    segments: dict[str, Segment] = {}
    for row in _kaldi_table(file, split, min_fields=4, kind="utt rec start end"):
        if isinstance(row, Rejection):
            unreadable.add(row.id)
            yield row
            continue
        line, fields = row
        utt_id, rec_id = fields[0], sys.intern(fields[1])
        try:
            start, end = float(fields[2]), float(fields[3])
        except ValueError:
            unreadable.add(utt_id)
            yield Rejection(
                split=split,
                id=utt_id,
                path=None,
                reason=MALFORMED_LINE,
                detail=f"segments line {line.number}: start/end are not numbers",
            )
            continue
        if utt_id in segments:
            yield Rejection(
                split=split,
                id=utt_id,
                path=None,
                reason=DUPLICATE_ID,
                detail=f"segments line {line.number} repeats {utt_id!r}; the first is kept",
            )
            continue
        segments[utt_id] = (rec_id, start, end)
    return segments, unreadable


def _read_utt2spk(file: Path) -> dict[str, str]:
    """Utterance id -> speaker (empty without an ``utt2spk`` file; a bad line is logged and ignored)."""
    speakers: dict[str, str] = {}
    if file.is_file():
        for line in read_lines(file):
            fields = (line.text or "").split()
            if len(fields) == 2:
                speakers[fields[0]] = sys.intern(fields[1])
            else:
                logger.warning("%s line %d ignored (expected: utt speaker)", file, line.number)
    return speakers


def _text_rows(
    file: Path,
    split: str,
    segments: dict[str, Segment] | None,
    *,
    unreadable_segments: set[str],
    unreadable_text: set[str],
) -> Iterator[Rejection | TextRow]:
    """``text`` in file order, each line with its segment (taken out of ``segments``), or its rejection.

    Every text line is a candidate, a repeated id included: validation keeps the first
    *valid* transcript of an utterance and rejects the others as duplicates. The ids of
    unreadable lines are added to ``unreadable_text``.
    """
    used: dict[str, Segment] = {}
    for row in _kaldi_table(file, split, min_fields=1, kind="id transcript"):
        if isinstance(row, Rejection):
            unreadable_text.add(row.id)
            yield row
            continue
        _line, fields = row
        utt_id, transcript = fields[0], fields[1] if len(fields) > 1 else ""
        if segments is None:
            yield (utt_id, utt_id, 0.0, None, transcript)
            continue
        if utt_id in unreadable_segments:
            continue  # rejected with its segments line
        segment = segments.pop(utt_id, None) or used.get(utt_id)
        if segment is None:
            yield Rejection(
                split=split,
                id=utt_id,
                path=None,
                reason=MISSING_RECORDING,
                detail=f"text lists {utt_id!r} but segments has no line for it",
            )
            continue
        used[utt_id] = segment
        rec_id, start, end = segment
        yield (utt_id, rec_id, start, None if end < 0 else end, transcript)


def _candidates(
    chunk: list[Rejection | TextRow],
    recordings: _RecordingCache,
    wav: dict[str, str | ItemRejected],
    *,
    speakers: dict[str, str],
    split: str,
) -> Iterator[Item]:
    """One chunk of text rows with their recordings read, in order: a candidate per usable row,
    a rejection for the others (and the rejections already in the chunk)."""
    found = recordings.fetch([row[1] for row in chunk if isinstance(row, tuple)])
    for row in chunk:
        if not isinstance(row, tuple):
            yield row
            continue
        utt_id, rec_id, start, end, transcript = row
        entry = wav.get(rec_id)
        raw = entry if isinstance(entry, str) else None
        status = found[rec_id]
        if status is None:
            yield Rejection(
                split=split,
                id=utt_id,
                path=None,
                reason=MISSING_RECORDING,
                detail=f"recording {rec_id!r} of utterance {utt_id!r} is not in wav.scp",
            )
            continue
        if isinstance(status, ItemRejected):
            yield Rejection(split=split, id=utt_id, path=raw, reason=status.reason, detail=status.detail)
            continue
        duration = (status.duration if end is None else end) - start
        supervision = SupervisionSegment(
            id=utt_id,
            recording_id=rec_id,
            start=start,
            duration=round(duration, 6),
            channel=0,
            text=transcript,
            speaker=speakers.get(utt_id),
        )
        yield Candidate(supervision=supervision, recording=status, path=raw, checked=True)


def import_kaldi(corpus_dir: Path, name: str, split: str, *, allow_commands: bool = False) -> ImportedSplit:
    """:func:`stream_kaldi`, gathered in memory."""
    return collect(stream_kaldi(corpus_dir, name, split, allow_commands=allow_commands))
