"""The reasons the ``prepare`` stage rejects a corpus item, and how a rejection is carried.

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
                            than ``SEGMENT_END_TOLERANCE_S`` after its recording
                            (:mod:`asrflow.data.prepare.supervision_checks`)
``channel_out_of_range``    ``channel: k`` and a multi-channel recording has no channel k
``too_short``               shorter than ``min_duration_s`` (train only)
``too_long``                longer than ``max_duration_s`` (``long_utterances: drop``), or a
                            single aligned word is (``split``) (train only)
``too_long_no_alignment``   ``long_utterances: split`` but the utterance has no word
                            alignment, so its transcript cannot be divided between pieces
``empty_transcript``        nothing left after text normalisation
``invalid_manifest``        Lhotse's own checks (:mod:`lhotse.qa`) refuse the item
==========================  ===============================================================

Where they are checked: paths in :mod:`asrflow.data.prepare.path_checks`, audio in
:mod:`asrflow.data.prepare.audio_checks`, a supervision against its recording in
:mod:`asrflow.data.prepare.supervision_checks` (long ones cut by
:mod:`asrflow.data.prepare.alignment`), ids and the streaming of a split in
:mod:`asrflow.data.prepare.validator`; the importers reject the lines they cannot read.
"""

from __future__ import annotations

from dataclasses import dataclass

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
