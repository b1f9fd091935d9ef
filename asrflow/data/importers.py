"""Reading a corpus into Lhotse manifests: Lhotse recipes, a folder with TSVs, Kaldi folders.

Each importer returns, per split, a Lhotse ``RecordingSet`` and ``SupervisionSet`` plus the
items it had to reject while reading (see :mod:`asrflow.data.validation` for the reasons).
Transcripts are returned raw; normalisation and the remaining checks happen in
:func:`asrflow.data.validation.validate_split`.

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

**Kaldi data folders** (``corpus: kaldi``). For each split name ``S``, the folder
``<corpus_dir>/S/`` holds:

* ``wav.scp``: ``<recording-id> <audio path>``. Paths are relative to ``corpus_dir`` or
  absolute inside it. Piped commands (``sox x.sph -t wav - |``) and archive offsets
  (``feats.ark:123``) are rejected (``piped_command``): convert the audio to files first.
* ``text``: ``<utterance-id> <transcript>``. A repeated utterance id: every line goes to
  validation, which keeps the first *valid* transcript (as for TSVs). A repeated id in
  ``wav.scp`` or ``segments`` keeps its first line (the later ones are rejected as
  ``duplicate_id``): they name recordings and times, not the item's transcript.
* ``segments`` (optional): ``<utterance-id> <recording-id> <start-s> <end-s>``; an end of
  ``-1`` means the end of the recording. Without it, utterance id = recording id.
* ``utt2spk`` (optional): ``<utterance-id> <speaker>``.

**Lhotse recipes** (any other ``corpus`` value ``X``): ``lhotse.recipes.prepare_X(corpus_dir,
**recipe_args)``, called without an output directory (or with a temporary one when the
recipe requires it, read before it is removed). ``corpus_dir`` goes to the recipe's
``corpus_dir`` parameter, or to its first one (``audio_dir``, ``tedlium_root``...); other
parameters without a default must be set in ``recipe_args``. The recipe's result maps its
split names (``train``, ``dev-clean``, ...) to ``{"recordings": ..., "supervisions": ...}``;
nested parts are named with ``/`` (``en/train``); a recipe that returns one unsplit pair
offers it as the split ``all`` (carve dev and test from it: ``splits: {train: all, dev:
null, test: null}``). See :func:`recipe_splits`.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import logging
import re
import sys
import tempfile
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from lhotse import Recording, RecordingSet, SupervisionSegment, SupervisionSet

from asrflow.data.validation import (
    DUPLICATE_ID,
    MALFORMED_LINE,
    MISSING_RECORDING,
    MISSING_TRANSCRIPT,
    NON_UTF8,
    PIPED_COMMAND,
    Candidate,
    ItemRejected,
    Rejection,
    map_in_threads,
    open_recording,
    resolve_inside,
)
from asrflow.errors import AsrflowError, first_line

logger = logging.getLogger("asrflow")

#: First TSV fields that mark a header line.
TSV_HEADER_FIELDS = frozenset({"path", "audio", "file", "filename", "wav"})

_ARCHIVE_OFFSET = re.compile(r"\.ark:\d+$")

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


def _non_utf8(split: str, item_id: str, *, path: str | None, file: Path, line: Line) -> Rejection:
    return Rejection(
        split=split,
        id=item_id,
        path=path,
        reason=NON_UTF8,
        detail=f"line {line.number} of {file} is not valid UTF-8 ({line.error}); save the file as UTF-8",
    )


def _decode_loose(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def _probe(root: Path, pending: list[tuple[str, str]], split: str) -> list[Recording | ItemRejected]:
    """Resolve and open ``(recording_id, raw_path)`` pairs in a thread pool."""

    def probe(item: tuple[str, str]) -> Recording:
        recording_id, raw = item
        return open_recording(resolve_inside(root, raw), recording_id)

    return map_in_threads(probe, pending, f"reading audio headers ({split})", show=False)


def chunked(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """Consecutive lists of ``size`` items (the last one shorter)."""
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


# --------------------------------------------------------------------------- folder + TSV


def stream_folder(corpus_dir: Path, name: str, split: str) -> Iterator[Item]:
    """Stream ``<corpus_dir>/<name>.tsv`` (format in the module docstring), in file order.

    Holds one id -> first audio path entry per utterance (to give a second file with the
    same id its own recording id); audio headers are read :data:`PROBE_CHUNK` at a time.

    Raises:
        AsrflowError: when the TSV does not exist.
    """
    root = corpus_dir.resolve()
    tsv = root / f"{name}.tsv"
    if not tsv.is_file():
        found = sorted(p.name for p in root.glob("*.tsv"))
        raise AsrflowError(
            f"split {split!r}: {tsv} not found (corpus: folder wants <corpus_dir>/<split>.tsv); "
            f"TSV files there: {', '.join(found) or 'none'}; fix prepare.splits or add the file"
        )
    # Every line is a candidate, duplicates included: validation keeps the first *valid*
    # copy of an id and rejects the others as duplicates. Lines naming the same file share
    # one recording; a later file with the same id (``a.wav`` then ``a.flac``) gets its own
    # recording id ``<id>#<n>``, so that either can be the one kept.
    files_of: dict[str, str | list[str]] = {}

    def recording_id(item_id: str, raw: str) -> str:
        known = files_of.get(item_id)
        if known is None:
            files_of[item_id] = raw
            return item_id
        files = [known] if isinstance(known, str) else known
        if raw not in files:
            files.append(raw)
            files_of[item_id] = files
        index = files.index(raw)
        return item_id if index == 0 else f"{item_id}#{index + 1}"

    def entries() -> Iterator[Item | tuple[str, str, str, str | None]]:
        for line in read_lines(tsv):
            raw_path = _decode_loose(line.raw.split(b"\t", 1)[0]).strip()
            item_id = _folder_id(root, raw_path) or f"{tsv.name}:{line.number}"
            if line.text is None:
                yield _non_utf8(split, item_id, path=raw_path or None, file=tsv, line=line)
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

    for chunk in chunked(entries(), PROBE_CHUNK):
        rows = [(recording_id(row[0], row[1]), row) for row in chunk if isinstance(row, tuple)]
        probed = iter(_probe(root, [(rec_id, row[1]) for rec_id, row in rows], split))
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


# --------------------------------------------------------------------------- Kaldi


def _kaldi_table(file: Path, split: str, *, min_fields: int, kind: str) -> Iterator[tuple[Line, list[str]] | Rejection]:
    """Lines of a Kaldi table split in two (key, rest) or more fields; bad lines become rejections."""
    for line in read_lines(file):
        key = _decode_loose(line.raw.split(maxsplit=1)[0])
        if line.text is None:
            yield _non_utf8(split, key, path=None, file=file, line=line)
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

    def __init__(self, root: Path, wav: dict[str, str | ItemRejected], split: str) -> None:
        self.root, self.wav, self.split = root, wav, split
        self.cache: OrderedDict[str, Recording | ItemRejected] = OrderedDict()

    def fetch(self, rec_ids: list[str]) -> dict[str, Recording | ItemRejected | None]:
        """Each id's recording, its rejection, or ``None`` when ``wav.scp`` does not name it."""
        wanted = sorted({r for r in rec_ids if r not in self.cache and isinstance(self.wav.get(r), str)})
        for rec_id, result in zip(
            wanted, _probe(self.root, [(r, self.wav[r]) for r in wanted], self.split), strict=True
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


def stream_kaldi(corpus_dir: Path, name: str, split: str) -> Iterator[Item]:
    """Stream the Kaldi data folder ``<corpus_dir>/<name>/`` (format in the module docstring).

    ``text`` is streamed in file order. Held in memory: ``wav.scp`` (one path per
    recording), ``segments`` (recording, start, end per segment) and ``utt2spk`` (one
    speaker per utterance), about 300 bytes per segment in all.

    Raises:
        AsrflowError: when the folder, its ``wav.scp`` or its ``text`` is missing.
    """
    root = corpus_dir.resolve()
    folder = root / name
    for required in ("wav.scp", "text"):
        if not (folder / required).is_file():
            raise AsrflowError(
                f"split {split!r}: {folder / required} not found (corpus: kaldi wants "
                f"<corpus_dir>/<split>/wav.scp and text); fix prepare.splits or the folder"
            )

    # wav.scp: recording id -> raw path, or the reason it cannot be used. An unreadable
    # line rejects the utterances of its recording (utterances are the items).
    wav: dict[str, str | ItemRejected] = {}
    for row in _kaldi_table(folder / "wav.scp", split, min_fields=2, kind="id path"):
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
        if "|" in rest or _ARCHIVE_OFFSET.search(rest):
            wav[rec_id] = ItemRejected(
                PIPED_COMMAND,
                f"wav.scp entry {rest!r} is a command or archive offset, not a file; only plain "
                "audio paths are read: convert the audio to files (e.g. run the command into a .wav)",
            )
        else:
            wav[rec_id] = rest

    segments: dict[str, tuple[str, float, float]] | None = None
    unreadable_segments: set[str] = set()
    if (folder / "segments").is_file():
        segments = {}
        for row in _kaldi_table(folder / "segments", split, min_fields=4, kind="utt rec start end"):
            if isinstance(row, Rejection):
                unreadable_segments.add(row.id)
                yield row
                continue
            line, fields = row
            utt_id, rec_id = fields[0], sys.intern(fields[1])
            try:
                start, end = float(fields[2]), float(fields[3])
            except ValueError:
                unreadable_segments.add(utt_id)
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

    speakers: dict[str, str] = {}
    if (folder / "utt2spk").is_file():
        for line in read_lines(folder / "utt2spk"):
            fields = (line.text or "").split()
            if len(fields) == 2:
                speakers[fields[0]] = sys.intern(fields[1])
            else:
                logger.warning("%s line %d ignored (expected: utt speaker)", folder / "utt2spk", line.number)

    # Every text line is a candidate, a repeated id included: validation keeps the first
    # *valid* transcript of an utterance and rejects the others as duplicates.
    used: dict[str, tuple[str, float, float]] = {}
    unreadable_text: set[str] = set()
    recordings = _RecordingCache(root, wav, split)

    def utterances() -> Iterator[Item | tuple[str, str, float, float | None, str]]:
        for row in _kaldi_table(folder / "text", split, min_fields=1, kind="id transcript"):
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

    for chunk in chunked(utterances(), PROBE_CHUNK):
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

    for utt_id in segments or ():
        if utt_id not in unreadable_text:
            yield Rejection(
                split=split,
                id=utt_id,
                path=None,
                reason=MISSING_TRANSCRIPT,
                detail=f"segments lists {utt_id!r} but text has no line for it",
            )


def import_kaldi(corpus_dir: Path, name: str, split: str) -> ImportedSplit:
    """:func:`stream_kaldi`, gathered in memory."""
    return collect(stream_kaldi(corpus_dir, name, split))


# --------------------------------------------------------------------------- Lhotse recipes


def recipe_names() -> list[str]:
    """Names ``X`` of the recipes ``lhotse.recipes.prepare_X`` that Lhotse exposes."""
    import lhotse.recipes

    return sorted(name[len("prepare_") :] for name in dir(lhotse.recipes) if name.startswith("prepare_"))


def find_recipe(name: str) -> Any:
    """The function ``lhotse.recipes.prepare_<name>``.

    Raises:
        AsrflowError: when Lhotse has no such recipe (the message lists some that exist).
    """
    import lhotse.recipes

    function = getattr(lhotse.recipes, f"prepare_{name}", None)
    if function is None and re.fullmatch(r"[A-Za-z0-9_]+", name):
        try:
            module = importlib.import_module(f"lhotse.recipes.{name}")
            function = getattr(module, f"prepare_{name}", None)
        except ImportError:
            function = None
    if not callable(function):
        names = recipe_names()
        close = [n for n in names if n.startswith(name[:3].lower())][:5]
        examples = close or [n for n in ("yesno", "librispeech", "mini_librispeech", "commonvoice") if n in names]
        raise AsrflowError(
            f"params.yaml: prepare.corpus = {name!r} is not a Lhotse recipe nor 'folder' or 'kaldi'; "
            f"valid recipes include {', '.join(examples)} ({len(names)} in all, "
            "see lhotse.recipes); use corpus: folder or kaldi for your own data"
        )
    return function


#: The split name under which a recipe that returns one unsplit pair is offered.
UNSPLIT = "all"


@dataclass(frozen=True, kw_only=True)
class RecipeCall:
    """How ``lhotse.recipes.prepare_<name>`` must be called.

    Attributes:
        corpus_parameter: the parameter that receives ``prepare.corpus_dir``: ``corpus_dir``
            when the recipe has one, else its first parameter (``audio_dir``, ``tedlium_root``...).
        output_dir: ``required``, ``optional`` or ``none``: whether the recipe must be given
            a folder to write its manifests to (it then often returns lazy manifests read from it).
        required: other parameters without a default: they must come from ``prepare.recipe_args``.
        accepted: every parameter ``recipe_args`` may set.
    """

    name: str
    corpus_parameter: str
    output_dir: str
    required: tuple[str, ...]
    accepted: tuple[str, ...]
    takes_any: bool


def recipe_call(name: str, function: Any = None) -> RecipeCall:
    """Classify the recipe's signature (see :class:`RecipeCall`)."""
    function = function or find_recipe(name)
    parameters = inspect.signature(function).parameters
    named = [p for p in parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    corpus = "corpus_dir" if "corpus_dir" in parameters else (named[0].name if named else "")
    output = parameters.get("output_dir")
    output_kind = "none" if output is None else "required" if output.default is inspect.Parameter.empty else "optional"
    required = tuple(
        p.name for p in named if p.default is inspect.Parameter.empty and p.name not in (corpus, "output_dir")
    )
    accepted = tuple(p.name for p in named if p.name not in (corpus, "output_dir"))
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return RecipeCall(
        name=name,
        corpus_parameter=corpus,
        output_dir=output_kind,
        required=required,
        accepted=accepted,
        takes_any=takes_any,
    )


def _check_recipe_args(call: RecipeCall, recipe_args: dict[str, Any]) -> None:
    where = f"lhotse.recipes.prepare_{call.name}"
    own = {call.corpus_parameter, "output_dir"}
    unknown = sorted(key for key in recipe_args if key not in call.accepted and not call.takes_any)
    if unknown or own & set(recipe_args):
        raise AsrflowError(
            f"params.yaml: prepare.recipe_args {unknown or sorted(own & set(recipe_args))} not accepted by "
            f"{where} (prepare.corpus_dir is given as its {call.corpus_parameter}, and asrflow picks the "
            f"output folder); it takes: {', '.join(call.accepted) or 'nothing'}"
        )
    missing = [key for key in call.required if key not in recipe_args]
    if missing:
        raise AsrflowError(
            f"{where} needs {', '.join(missing)}: set them in params.yaml under prepare.recipe_args "
            f"(prepare.corpus_dir is given as its {call.corpus_parameter})"
        )


def _is_pair(value: Any) -> bool:
    """A ``{"recordings": <manifest>, ...}`` entry (a manifest, eager or lazy, has ``to_eager``)."""
    return isinstance(value, dict) and hasattr(value.get("recordings"), "to_eager")


def recipe_splits(name: str, manifests: Any) -> dict[str, dict]:
    """The recipe's result as ``{split name: {"recordings", "supervisions"}}``.

    Shapes: split names to pairs (``{"train": {...}, "dev": {...}}``); one unsplit pair
    (``{"recordings": ..., "supervisions": ...}`` or a 2-tuple), offered as :data:`UNSPLIT`;
    nested parts (``{"en": {"train": {...}}}`` or ``{"train": {"part1": {...}}}``), offered
    as ``en/train``, ``train/part1``. Entries that hold no recordings are left out.
    """
    if isinstance(manifests, tuple | list) and len(manifests) == 2:
        manifests = {"recordings": manifests[0], "supervisions": manifests[1]}
    if not isinstance(manifests, dict):
        raise AsrflowError(f"lhotse recipe prepare_{name} returned {type(manifests).__name__}, not manifests")
    if _is_pair(manifests):
        return {UNSPLIT: manifests}
    splits: dict[str, dict] = {}

    def walk(prefix: str, value: Any) -> None:
        if _is_pair(value):
            splits[prefix] = value
        elif isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}/{key}" if prefix else str(key), inner)

    walk("", manifests)
    return splits


def run_recipe(name: str, corpus_dir: Path, recipe_args: dict[str, Any]) -> dict[str, ImportedSplit]:
    """Call ``lhotse.recipes.prepare_<name>`` on ``corpus_dir`` with ``recipe_args``.

    ``corpus_dir`` goes to the recipe's ``corpus_dir`` parameter (or its first one, see
    :class:`RecipeCall`); a recipe that requires ``output_dir`` gets a temporary folder,
    and its (often lazy) manifests are read into memory before that folder is removed.

    Returns:
        The recipe's splits by the recipe's own split names (:func:`recipe_splits`).

    Raises:
        AsrflowError: unknown recipe, a ``recipe_args`` key the recipe does not take or a
        required one missing, or a failure of the recipe (typically the corpus is not laid
        out as it expects).
    """
    function = find_recipe(name)
    call = recipe_call(name, function)
    _check_recipe_args(call, recipe_args)
    kwargs = dict(recipe_args)
    with tempfile.TemporaryDirectory(prefix="asrflow-recipe-") as scratch:
        if call.output_dir == "required":
            kwargs["output_dir"] = scratch
        try:
            if call.corpus_parameter == "corpus_dir":
                manifests = function(corpus_dir=corpus_dir, **kwargs)
            else:
                manifests = function(corpus_dir, **kwargs)
            splits = {}
            for part, value in recipe_splits(name, manifests).items():
                supervisions = value.get("supervisions")
                if supervisions is None:
                    raise AsrflowError(
                        f"lhotse recipe prepare_{name} gives no transcripts for split {part!r}; "
                        "asrflow needs supervisions with text"
                    )
                # Read now: lazy manifests may live in the scratch folder, removed below.
                splits[part] = ImportedSplit(value["recordings"].to_eager(), supervisions.to_eager())
        except AsrflowError:
            raise
        except Exception as error:  # the recipe's own checks are asserts and assorted errors
            raise AsrflowError(
                f"lhotse recipe prepare_{name} failed on {corpus_dir}: {type(error).__name__}: "
                f"{first_line(error)}; check that corpus_dir holds the corpus laid out as the recipe "
                f"expects (see the docstring of lhotse.recipes.prepare_{name})"
            ) from None
    return splits


# --------------------------------------------------------------------------- recipe manifests, cached and streamed

#: Written into the recipe cache; a different value makes the cache stale.
RECIPE_CACHE_FORMAT = 1
_RECIPE_KEY_FILE = "key.json"


def recipe_cache_key(name: str, corpus_dir: Path, recipe_args: dict[str, Any]) -> dict[str, Any]:
    """What the recipe's output depends on: the recipe, its arguments, Lhotse's version, the corpus listing."""
    import lhotse

    from asrflow.data.listing import corpus_fingerprint

    return {
        "format": RECIPE_CACHE_FORMAT,
        "recipe": name,
        "recipe_args": recipe_args,
        "lhotse": lhotse.__version__,
        "corpus_dir": str(corpus_dir.resolve()),
        "corpus": corpus_fingerprint(corpus_dir),
    }


def cached_recipe(name: str, corpus_dir: Path, recipe_args: dict[str, Any], cache_dir: Path) -> dict[str, Path]:
    """The recipe's splits as folders of ``recordings.jsonl.gz`` / ``supervisions.jsonl.gz``.

    The recipe runs only when ``cache_dir`` holds no result for the same
    :func:`recipe_cache_key` (another recipe, other arguments, another Lhotse, or any
    file of the corpus added, removed, resized or touched); its result is then written
    there, whole or not at all, with recordings sorted by id and supervisions by
    (recording id, start, id), so that :func:`stream_recipe_split` joins them in one pass.

    Returns:
        The recipe's split name -> its folder in the cache.

    Raises:
        AsrflowError: as :func:`run_recipe`.
    """
    import json

    from asrflow.files import atomic_path

    key = recipe_cache_key(name, corpus_dir, recipe_args)
    key_file = cache_dir / _RECIPE_KEY_FILE
    if key_file.is_file():
        stored = json.loads(key_file.read_text())
        if stored.get("key") == key:
            logger.info(
                "prepare: recipe %s unchanged since its last run; reading its manifests from %s", name, cache_dir
            )
            return {split: cache_dir / folder for split, folder in stored["splits"].items()}
    splits = run_recipe(name, corpus_dir, recipe_args)
    folders = {split: f"part{index:03d}" for index, split in enumerate(sorted(splits))}
    with atomic_path(cache_dir) as tmp:
        tmp.mkdir()
        for split, part in splits.items():
            folder = tmp / folders[split]
            folder.mkdir()
            recordings = sorted(part.recordings, key=lambda r: r.id)
            supervisions = sorted(part.supervisions, key=lambda s: (s.recording_id, s.start, s.id))
            RecordingSet.from_recordings(recordings).to_file(folder / "recordings.jsonl.gz")
            SupervisionSet.from_segments(supervisions).to_file(folder / "supervisions.jsonl.gz")
        (tmp / _RECIPE_KEY_FILE).write_text(json.dumps({"key": key, "splits": folders}, indent=2, sort_keys=True))
    return {split: cache_dir / folder for split, folder in folders.items()}


def stream_recipe_split(folder: Path, split: str) -> Iterator[Item]:
    """Stream one cached recipe split (see :func:`cached_recipe`): a merge join on recording id.

    Holds the supervisions of one recording at a time (to see whether they name different
    channels: two-sided calls keep the recipe's channels).
    """
    from lhotse import load_manifest_lazy

    recordings = iter(load_manifest_lazy(folder / "recordings.jsonl.gz"))
    supervisions = load_manifest_lazy(folder / "supervisions.jsonl.gz")
    current: Recording | None = next(recordings, None)
    for rec_id, group in itertools.groupby(supervisions, key=lambda s: s.recording_id):
        group = list(group)
        while current is not None and current.id < rec_id:
            current = next(recordings, None)
        recording = current if current is not None and current.id == rec_id else None
        channels = {tuple(s.channel) if isinstance(s.channel, list) else s.channel for s in group}
        for supervision in group:
            yield Candidate(supervision=supervision, recording=recording, per_channel=len(channels) > 1)
