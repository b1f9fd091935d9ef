"""The folder + TSV importer.

**Folder + TSV** (``corpus: folder``). For each split name ``S``, the file
``<corpus_dir>/S.tsv`` holds one utterance per line::

    relative/path/to/audio.wav<TAB>the transcript[<TAB>speaker]

* Paths are relative to ``corpus_dir`` (an absolute path is accepted only if it lies
  inside ``corpus_dir``); any format libsndfile or Lhotse reads (wav, flac, ogg, mp3...).
* An optional header line is recognised by its first field: ``path``, ``audio``,
  ``file``, ``filename`` or ``wav`` (any case).
* Blank lines are skipped. The third column (speaker) is optional.
* The utterance id (and recording id) is the audio path relative to ``corpus_dir``
  without its extension, e.g. ``spk1/utt001``.
* Each line is decoded as UTF-8 on its own, so one bad line rejects one item.
* A path listed twice: every line goes to validation, which keeps the first *valid* copy
  and rejects the later ones as ``duplicate_id`` (an invalid copy claims nothing).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from lhotse import SupervisionSegment

from asrflow.data.prepare.importers.common import (
    PROBE_CHUNK,
    ImportedSplit,
    Item,
    chunked,
    collect,
    decode_loose,
    non_utf8_rejection,
    probe_recordings,
    read_lines,
)
from asrflow.data.prepare.rejections import MALFORMED_LINE, ItemRejected, Rejection
from asrflow.data.prepare.validator import Candidate
from asrflow.errors import AsrflowError

#: First TSV fields that mark a header line.
TSV_HEADER_FIELDS = frozenset({"path", "audio", "file", "filename", "wav"})


#: A TSV line that passed the line checks: ``(item id, raw audio path, transcript, speaker)``.
Row = tuple[str, str, str, str | None]


def stream_folder(corpus_dir: Path, name: str, split: str) -> Iterator[Item]:
    """Stream ``<corpus_dir>/<name>.tsv`` (format in the module docstring), in file order.

    Holds one id -> first audio path entry per utterance (to give a second file with the
    same id its own recording id); audio headers are read :data:`PROBE_CHUNK` at a time.

    Raises:
        AsrflowError: when the TSV does not exist.
    """
    root = corpus_dir.resolve()
    tsv = _tsv_file(root, name, split)
    # Every line is a candidate, duplicates included: validation keeps the first *valid*
    # copy of an id and rejects the others as duplicates.
    recording_ids = _RecordingIds()
    for chunk in chunked(_tsv_rows(tsv, root, split), PROBE_CHUNK):
        yield from _probed(chunk, root, split, recording_ids)


def _tsv_file(root: Path, name: str, split: str) -> Path:
    """``<root>/<name>.tsv``.

    Raises:
        AsrflowError: when it does not exist (naming the TSV files there).
    """
    tsv = root / f"{name}.tsv"
    if not tsv.is_file():
        found = sorted(p.name for p in root.glob("*.tsv"))
        raise AsrflowError(
            f"split {split!r}: {tsv} not found (corpus: folder wants <corpus_dir>/<split>.tsv); "
            f"TSV files there: {', '.join(found) or 'none'}; fix prepare.splits or add the file"
        )
    return tsv


class _RecordingIds:
    """The recording id of each TSV line. Lines naming the same file share one recording; a
    later file with the same id (``a.wav`` then ``a.flac``) gets its own recording id
    ``<id>#<n>``, so that either can be the one kept."""

    def __init__(self) -> None:
        self.files_of: dict[str, str | list[str]] = {}

    def of(self, item_id: str, raw: str) -> str:
        known = self.files_of.get(item_id)
        if known is None:
            self.files_of[item_id] = raw
            return item_id
        files = [known] if isinstance(known, str) else known
        if raw not in files:
            files.append(raw)
            self.files_of[item_id] = files
        index = files.index(raw)
        return item_id if index == 0 else f"{item_id}#{index + 1}"


def _tsv_rows(tsv: Path, root: Path, split: str) -> Iterator[Item | Row]:
    """The TSV's lines in file order: a :data:`Row` each, or the rejection of a bad line (header skipped)."""
    for line in read_lines(tsv):
        raw_path = decode_loose(line.raw.split(b"\t", 1)[0]).strip()
        item_id = _folder_id(root, raw_path) or f"{tsv.name}:{line.number}"
        if line.text is None:
            yield non_utf8_rejection(split, item_id, path=raw_path or None, file=tsv, line=line)
            continue
        fields = line.text.split("\t")
        if line.number == 1 and fields[0].strip().lower() in TSV_HEADER_FIELDS:
            continue
        if len(fields) not in (2, 3) or not fields[0].strip():
            yield Rejection(
                split=split,
                id=item_id,
                path=raw_path or None,
                reason=MALFORMED_LINE,
                detail=f"line {line.number} of {tsv} has {len(fields)} tab-separated field(s); "
                "expected path<TAB>transcript[<TAB>speaker]",
            )
            continue
        speaker = (fields[2].strip() or None) if len(fields) == 3 else None
        yield (item_id, raw_path, fields[1], speaker)


def _probed(chunk: list[Item | Row], root: Path, split: str, recording_ids: _RecordingIds) -> Iterator[Item]:
    """One chunk of rows with their audio headers read (in a thread pool), in order: a candidate
    per readable row, a rejection for the others (and the rejections already in the chunk)."""
    rows = [(recording_ids.of(row[0], row[1]), row) for row in chunk if isinstance(row, tuple)]
    probed = iter(probe_recordings(root, [(rec_id, row[1]) for rec_id, row in rows], split))
    ids = iter(rec_id for rec_id, _ in rows)
    for row in chunk:
        if not isinstance(row, tuple):
            yield row
            continue
        rec_id, result = next(ids), next(probed)
        item_id, raw, text, speaker = row
        if isinstance(result, ItemRejected):
            yield Rejection(split=split, id=item_id, path=raw, reason=result.reason, detail=result.detail)
            continue
        supervision = SupervisionSegment(
            id=item_id,
            recording_id=rec_id,
            start=0.0,
            duration=result.duration,
            channel=0,
            text=text,
            speaker=speaker,
        )
        yield Candidate(supervision=supervision, recording=result, path=raw, checked=True)


def import_folder(corpus_dir: Path, name: str, split: str) -> ImportedSplit:
    """:func:`stream_folder`, gathered in memory."""
    return collect(stream_folder(corpus_dir, name, split))


def _folder_id(root: Path, raw_path: str) -> str | None:
    """The id of a TSV item: its path relative to ``root`` without extension (posix)."""
    if not raw_path:
        return None
    path = Path(raw_path)
    if path.is_absolute() and path.is_relative_to(root):
        path = path.relative_to(root)
    return path.with_suffix("").as_posix()
