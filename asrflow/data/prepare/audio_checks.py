"""Whether an item's audio can be used: its header reads, it has samples, and it decodes to its end.

A recording comes from a file (:func:`open_recording`), from a Kaldi ``wav.scp`` command
(:func:`open_command_recording`), or from a Lhotse recipe whose manifest is checked as it is
(:func:`check_recording`). **Sampling rates** may differ between recordings; each recording
keeps its native rate in its manifest and the features stage resamples every cut to one rate.
"""

from __future__ import annotations

import subprocess
from io import BytesIO
from pathlib import Path

import soundfile
from lhotse import AudioSource, Recording
from lhotse.audio.backend import read_audio
from lhotse.qa import validate

from asrflow.data.prepare.rejections import (
    COMMAND_FAILED,
    INVALID_MANIFEST,
    MISSING_AUDIO,
    UNREADABLE_AUDIO,
    ZERO_LENGTH,
    ItemRejected,
)
from asrflow.errors import first_line

#: Seconds of audio decoded at the end of each recording to detect truncated files.
TAIL_CHECK_S = 0.05


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
