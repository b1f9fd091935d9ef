"""Checks on corpus items for the ``prepare`` stage, and the reasons an item is rejected.

An *item* is one utterance: a TSV line, a Kaldi ``text`` entry, or a supervision from a
Lhotse recipe. A bad item is rejected with a :class:`Rejection` (split, id, path, reason,
detail) and never stops the good ones. The reasons, in the order they are checked:

==========================  ===============================================================
reason                      meaning (and what to do)
==========================  ===============================================================
``malformed_line``          a TSV / Kaldi line lacks its fields; fix the line
``non_utf8_text``           the line is not valid UTF-8; save the file as UTF-8
``duplicate_id``            an id already kept (in this split or an earlier one): the first
                            *valid* copy of an id is kept and later copies are rejected; an
                            invalid copy is rejected for its own reason and does not claim
                            the id, so a valid copy after it survives
``piped_command``           a Kaldi ``wav.scp`` entry is a shell command (``... |``) and
                            ``prepare.allow_commands`` is off, or an archive offset
                            (``x.ark:12``); set the option, or convert the audio to files
``command_failed``          a ``wav.scp`` command (``prepare.allow_commands: true``) exits
                            non-zero or writes nothing to stdout; fix or drop its line
``path_outside_corpus``     the audio path leaves ``corpus_dir`` (``..``, an absolute path
                            elsewhere, or a symlink that resolves outside)
``missing_audio``           the audio file does not exist
``missing_recording``       a Kaldi utterance whose recording (wav.scp / segments) is absent
``missing_transcript``      a Kaldi ``segments`` entry with no line in ``text``
``unreadable_audio``        the header cannot be read, or the end of the audio cannot be
                            decoded (truncated / corrupt file)
``zero_length_audio``       the audio holds no samples
``bad_segment``             a segment starts before 0, ends before it starts, or ends more
                            than :data:`SEGMENT_END_TOLERANCE_S` after its recording
``channel_out_of_range``    ``channel: k`` and a multi-channel recording has no channel k
``too_short``               shorter than ``min_duration_s`` (train only)
``too_long``                longer than ``max_duration_s`` (``long_utterances: drop``), or a
                            single aligned word is (``split``) (train only)
``too_long_no_alignment``   ``long_utterances: split`` but the utterance has no word
                            alignment, so its transcript cannot be divided between pieces
``empty_transcript``        nothing left after text normalisation
``invalid_manifest``        Lhotse's own checks (:mod:`lhotse.qa`) refuse the item
==========================  ===============================================================

**Channels.** ``channel: mix`` keeps every channel of a multi-channel recording: the
supervision names all channels, the cut is a Lhotse ``MultiCut``, and the features stage
downmixes it (``cut.to_mono(mono_downmix=True)``, the average of the channels).
``channel: k`` (an int) selects channel ``k`` of multi-channel recordings (a ``MonoCut``
on that channel); a multi-channel recording without channel ``k`` is rejected. A mono
recording has one channel to give and is used as it is under either setting. When a
recipe's supervisions of one recording already name different channels (two-sided
telephone calls: one transcript per channel), they are kept as the recipe made them.

**Long utterances.** ``long_utterances: drop`` rejects an utterance longer than
``max_duration_s``. ``split`` cuts it into consecutive windows of at most
``max_duration_s`` each, but only when the utterance carries a word-level alignment
(``supervision.alignment["word"]``, e.g. LibriSpeech with its alignment files): words are
packed greedily into windows, a window ends half-way through the pause after its last word
(the last one at the utterance's end), and each piece's transcript is its own words, in
order, taken from the alignment. Piece ids are ``<id>-part<k>`` (k = 0, 1, ...). An
utterance without a word alignment is rejected as ``too_long_no_alignment``: cutting audio
without knowing where its words fall would pair pieces with the wrong text. Pieces then
pass the same checks as every utterance (length, transcript).

**Sampling rates** may differ between recordings; each recording keeps its native rate in
its manifest and the features stage resamples every cut to one rate.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import subprocess
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import TypeVar

import soundfile
from lhotse import AudioSource, Recording, RecordingSet, SupervisionSegment, SupervisionSet
from lhotse.audio.backend import read_audio
from lhotse.qa import validate
from lhotse.supervision import AlignmentItem
from lhotse.utils import fastcopy, is_equal_or_contains

from asrflow.data.prepare.text import TextConfig, normalize_text
from asrflow.errors import first_line
from asrflow.logs import progress

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

MALFORMED_LINE = "malformed_line"
NON_UTF8 = "non_utf8_text"
DUPLICATE_ID = "duplicate_id"
PIPED_COMMAND = "piped_command"
COMMAND_FAILED = "command_failed"
PATH_OUTSIDE = "path_outside_corpus"
MISSING_AUDIO = "missing_audio"
MISSING_RECORDING = "missing_recording"
MISSING_TRANSCRIPT = "missing_transcript"
UNREADABLE_AUDIO = "unreadable_audio"
ZERO_LENGTH = "zero_length_audio"
BAD_SEGMENT = "bad_segment"
CHANNEL_OUT_OF_RANGE = "channel_out_of_range"
TOO_SHORT = "too_short"
TOO_LONG = "too_long"
TOO_LONG_NO_ALIGNMENT = "too_long_no_alignment"
EMPTY_TRANSCRIPT = "empty_transcript"
INVALID_MANIFEST = "invalid_manifest"

#: A segment may end this many seconds after its recording (rounding in Kaldi ``segments``
#: files); it is clipped to the recording's end. A larger overrun is a ``bad_segment``.
SEGMENT_END_TOLERANCE_S = 0.05

#: Seconds of audio decoded at the end of each recording to detect truncated files.
TAIL_CHECK_S = 0.05

#: Slack for float rounding when comparing durations, in seconds.
EPSILON_S = 1e-6

#: Alignment symbols that mark silence rather than a word.
SILENCE_SYMBOLS = frozenset({"", "<eps>", "sil", "SIL", "<sil>", "sp", "<unk>_sil"})


@dataclass(frozen=True, kw_only=True)
class Rejection:
    """One rejected item: a line of ``rejected.jsonl``.

    Attributes:
        split: our split name (``train``, ``dev``, ``test``).
        id: the utterance id (or ``<file>:<line>`` when no id could be read).
        path: the audio path as the corpus gives it, or ``None``.
        reason: one of the reason codes of this module.
        detail: a sentence naming the problem and what to do about it.
    """

    split: str
    id: str
    path: str | None
    reason: str
    detail: str

    def to_dict(self) -> dict[str, str | None]:
        """The JSON object written to ``rejected.jsonl``."""
        return {
            "split": self.split,
            "id": self.id,
            "path": self.path,
            "reason": self.reason,
            "detail": self.detail,
        }


class ItemRejected(Exception):
    """Raised by a per-item check; carries the reason code and a detail sentence."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


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


def resolve_inside(root: Path, raw: str) -> Path:
    """Turn an audio path from a transcript file into a path inside ``root``.

    Args:
        root: the corpus folder, already resolved (absolute, no symlinks).
        raw: the path as written in the file: relative to ``root``, or absolute.

    Returns:
        The normalised absolute path (inside ``root``) of an existing file.

    Raises:
        ItemRejected: ``path_outside_corpus`` or ``missing_audio``.
    """
    candidate = Path(raw)
    if not candidate.is_absolute():
        candidate = root / candidate
    lexical = Path(os.path.normpath(candidate))
    if not lexical.is_relative_to(root):
        raise ItemRejected(
            PATH_OUTSIDE,
            f"audio path {raw!r} points outside corpus_dir {root}; "
            "audio must live inside corpus_dir (no '..', no absolute paths elsewhere)",
        )
    real = lexical.resolve() if lexical.is_symlink() else _resolved_folder(str(lexical.parent)) / lexical.name
    if not real.is_relative_to(root):
        raise ItemRejected(
            PATH_OUTSIDE,
            f"audio path {raw!r} is a symlink to {real}, outside corpus_dir {root}; "
            "copy the file into corpus_dir instead of linking it",
        )
    if not real.is_file():
        raise ItemRejected(MISSING_AUDIO, f"audio file {raw!r} not found in {root}; add it or drop its line")
    return lexical


@functools.lru_cache(maxsize=4096)
def _resolved_folder(folder: str) -> Path:
    """A folder's real path (the folders of a corpus are few; their files many)."""
    return Path(folder).resolve()


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
        checked: the recording was read by :func:`open_recording`,
            which also checked that it decodes to its end.
    """

    supervision: SupervisionSegment
    recording: Recording | ItemRejected | None
    path: str | None = None
    per_channel: bool = False
    checked: bool = False


def open_recording(path: Path, recording_id: str) -> Recording:
    """Read an audio file's header into a Lhotse :class:`Recording`, and check that it decodes to its end.

    One open of the file with libsndfile (header, then the last :data:`TAIL_CHECK_S`); a
    format libsndfile does not read goes through Lhotse's backends
    (:meth:`Recording.from_file`, then :func:`check_recording`). The recording is the one
    :meth:`Recording.from_file` gives.

    Raises:
        ItemRejected: ``unreadable_audio`` when no backend can read the header or the end of
        the audio cannot be decoded; ``zero_length_audio`` when it holds no samples.
    """
    try:
        handle = soundfile.SoundFile(path)
    except Exception:  # not a format libsndfile reads: let Lhotse's other backends try
        return check_recording(_lhotse_recording(path, recording_id))
    with handle:
        rate, frames, channels = handle.samplerate, handle.frames, handle.channels
        if frames <= 0:
            raise ItemRejected(ZERO_LENGTH, f"audio {path} holds no samples; remove it")
        tail = min(frames, max(1, round(TAIL_CHECK_S * rate)))
        try:
            handle.seek(frames - tail)
            decoded = len(handle.read(tail, dtype="float32", always_2d=True))
        except Exception as error:
            raise ItemRejected(
                UNREADABLE_AUDIO,
                f"audio {path} cannot be decoded to its end ({first_line(error)}); "
                "the file is probably truncated or corrupt: re-encode or replace it",
            ) from None
        if decoded < tail:
            raise ItemRejected(
                UNREADABLE_AUDIO,
                f"audio {path} ends {tail - decoded} samples before its header says; "
                "the file is probably truncated: re-encode or replace it",
            )
    recording = Recording(
        id=recording_id,
        sources=[AudioSource(type="file", channels=list(range(channels)), source=str(path))],
        sampling_rate=rate,
        num_samples=frames,
        duration=frames / rate,
    )
    return _valid_manifest(recording)


def _valid_manifest(recording: Recording) -> Recording:
    """``recording``, once Lhotse's own checks (:func:`lhotse.qa.validate`) accept it.

    Raises:
        ItemRejected: ``invalid_manifest``.
    """
    try:
        validate(recording)
    except AssertionError as error:
        raise ItemRejected(INVALID_MANIFEST, f"{first_line(error)}; re-encode the file") from None
    return recording


#: Characters of a failed command's stderr quoted in its rejection.
COMMAND_STDERR_CHARS = 300


def open_command_recording(command: str, recording_id: str) -> Recording:
    """Run a Kaldi ``wav.scp`` command and read the audio it writes to stdout into a Lhotse :class:`Recording`.

    ``command`` is the entry without its trailing ``|`` (``sox x.sph -t wav -``). It runs as
    Lhotse runs a ``command`` audio source (``sh -c``, in the working directory, stdout read
    whole), with no stdin, so that its exit status and stderr can be reported; its output is
    decoded whole by Lhotse's :func:`~lhotse.audio.backend.read_audio`, the reader the later
    stages use, so the sample count is the one they will load. The recording is a
    ``command`` source: the later stages run the command again through Lhotse each time they
    load its audio. Memory: the output and its samples (float32, channels x samples), for the
    length of the call.

    Raises:
        ItemRejected: ``command_failed`` (non-zero exit, or nothing on stdout),
        ``unreadable_audio`` (the output is not audio Lhotse reads), ``zero_length_audio``
        or ``invalid_manifest``.
    """
    try:
        done = subprocess.run(command, shell=True, stdin=subprocess.DEVNULL, capture_output=True, check=False)
    except OSError as error:  # no shell to run it (sh -c itself reports a missing program)
        raise ItemRejected(COMMAND_FAILED, f"command {command!r} cannot be started ({error})") from None
    stderr = done.stderr.decode("utf-8", errors="replace").strip()[-COMMAND_STDERR_CHARS:]
    said = f"; it says: {stderr!r}" if stderr else ""
    if done.returncode != 0 or not done.stdout:
        status = f"exits with status {done.returncode}" if done.returncode != 0 else "writes nothing to stdout"
        raise ItemRejected(
            COMMAND_FAILED,
            f"command {command!r} {status}{said}; fix the command (run it in a shell from the working directory "
            "to see why) or drop its wav.scp line",
        )
    try:
        samples, rate = read_audio(BytesIO(done.stdout))
    except Exception as error:  # any backend failure means the same thing to the user
        raise ItemRejected(
            UNREADABLE_AUDIO,
            f"command {command!r} writes {len(done.stdout)} bytes that are not audio ({first_line(error)}){said}; "
            "make it write a WAV to stdout (sox: -t wav -)",
        ) from None
    channels, frames = (1, len(samples)) if samples.ndim == 1 else samples.shape
    if frames <= 0:
        raise ItemRejected(ZERO_LENGTH, f"command {command!r} writes audio with no samples; drop its wav.scp line")
    return _valid_manifest(
        Recording(
            id=recording_id,
            sources=[AudioSource(type="command", channels=list(range(channels)), source=command)],
            sampling_rate=rate,
            num_samples=frames,
            duration=frames / rate,
        )
    )


def _lhotse_recording(path: Path, recording_id: str) -> Recording:
    try:
        return Recording.from_file(path, recording_id=recording_id)
    except Exception as error:  # any backend failure means the same thing to the user
        raise ItemRejected(
            UNREADABLE_AUDIO,
            f"cannot read the audio header of {path} ({first_line(error)}); re-encode or replace the file",
        ) from None


def audio_path(recording: Recording | None) -> str | None:
    """The first source of a recording as a string (a path for file sources), or ``None``."""
    if recording is None or not recording.sources:
        return None
    source = recording.sources[0]
    return str(source.source) if source.type in ("file", "command", "url") else None


def check_recording(recording: Recording) -> Recording:
    """Check that a recording's audio exists, has samples, and decodes to its end.

    Raises:
        ItemRejected: ``missing_audio``, ``zero_length_audio``, ``unreadable_audio`` or
        ``invalid_manifest``.
    """
    for source in recording.sources:
        if source.type == "file" and not Path(source.source).is_file():
            raise ItemRejected(MISSING_AUDIO, f"audio file {source.source} not found; restore it")
    if recording.num_samples <= 0 or recording.duration <= 0:
        raise ItemRejected(ZERO_LENGTH, f"audio {audio_path(recording)} holds no samples; remove it")
    _valid_manifest(recording)
    try:
        offset = max(0.0, recording.duration - TAIL_CHECK_S)
        recording.load_audio(offset=offset)
    except Exception as error:
        raise ItemRejected(
            UNREADABLE_AUDIO,
            f"audio {audio_path(recording)} cannot be decoded to its end ({first_line(error)}); "
            "the file is probably truncated or corrupt: re-encode or replace it",
        ) from None
    return recording


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
            raise ItemRejected(
                TOO_LONG,
                f"lasts {supervision.duration:.2f} s and the stretch around word {word.symbol!r} "
                f"alone is longer than max_duration_s = {max_duration_s} s; raise prepare.max_duration_s",
            )
        new_start = boundary_after(index - 1)
        groups.append((start, new_start, current))
        start, current = new_start, [word]
        if end - start > max_duration_s + EPSILON_S:
            raise ItemRejected(
                TOO_LONG,
                f"lasts {supervision.duration:.2f} s and the stretch around word {word.symbol!r} "
                f"alone is longer than max_duration_s = {max_duration_s} s; raise prepare.max_duration_s",
            )
    groups.append((start, supervision.end, current))
    return groups


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


def _check_supervision(
    supervision: SupervisionSegment, recording: Recording, rules: ValidationRules, per_channel: bool
) -> list[SupervisionSegment]:
    """Checks of one supervision against its (good) recording; returns the kept piece(s)."""
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


def _finish_pieces(
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
                pieces = _check_supervision(supervision, recording, self.rules, candidate.per_channel)
            except ItemRejected as error:
                yield Rejection(
                    split=self.split,
                    id=supervision.id,
                    path=candidate.path or audio_path(known),
                    reason=error.reason,
                    detail=error.detail,
                )
                continue
            finished, failed = _finish_pieces(pieces, recording, self.rules, self.seen_ids)
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
