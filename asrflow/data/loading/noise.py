"""Noise for augmentation (``train.data.noise_dir``): a folder of audio, or a Lhotse manifest.

``train.data.noise_dir`` names either

* a **folder**: every file under it (sub-folders included) whose extension is one of
  :data:`AUDIO_SUFFIXES` is one noise recording, with its path relative to the folder as
  its id (``free-sound/noise-0001.wav``); other files (README, LICENSE) are ignored; or
* a **Lhotse manifest file** of recordings or cuts (``.jsonl.gz``, ``.jsonl``, ``.json``,
  ``.yaml``), such as ``musan_recordings_noise.jsonl.gz`` written by Lhotse's MUSAN recipe
  (``lhotse prepare musan``).

Every noise cut is mixed down to one channel (the average) and resampled to
``features.sampling_rate``; a cut made from a recording has the recording's id.
"""

from __future__ import annotations

from pathlib import Path

from lhotse import CutSet, Recording, RecordingSet, load_manifest

from asrflow.data.audio import to_mono_at_rate
from asrflow.errors import AsrflowError, first_line

#: The param that names the noise, for messages.
PARAM = "train.data.noise_dir"
#: File extensions read as noise audio in a folder (case-insensitive).
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".opus", ".mp3", ".aif", ".aiff", ".au", ".sph", ".w64", ".rf64")


def load_noise_cuts(path: str | Path, sampling_rate: int) -> CutSet:
    """The noise cuts of ``path`` (a folder of audio or a manifest), mono at ``sampling_rate`` Hz.

    Raises:
        AsrflowError: ``path`` is missing, holds no noise, or has a file that cannot be read.
    """
    path = Path(path)
    if path.is_dir():
        cuts = _cuts_of(_recordings_in(path))
    elif path.is_file():
        cuts = _cuts_in_manifest(path)
    else:
        raise AsrflowError(
            f"{PARAM} {path} not found: give a folder of noise audio or a Lhotse recordings/cuts manifest"
        )
    if len(cuts) == 0:
        raise AsrflowError(
            f"{PARAM} {path} holds no noise: put audio files ({', '.join(AUDIO_SUFFIXES)}) in the folder, "
            "or give a manifest with recordings"
        )
    return CutSet.from_cuts(to_mono_at_rate(cut, sampling_rate).with_id(cut.id) for cut in cuts)


def _cuts_of(recordings: RecordingSet) -> CutSet:
    """One cut per recording, named like it."""
    return CutSet.from_cuts(cut.with_id(cut.recording_id) for cut in CutSet.from_manifests(recordings=recordings))


def _recordings_in(folder: Path) -> RecordingSet:
    """One recording per audio file under ``folder``, sorted by id."""
    files = sorted(file for file in folder.rglob("*") if file.suffix.lower() in AUDIO_SUFFIXES and file.is_file())
    return RecordingSet.from_recordings(_read_recording(file, file.relative_to(folder).as_posix()) for file in files)


def _read_recording(file: Path, recording_id: str) -> Recording:
    """The recording of one noise file; unreadable or empty audio is a user error naming it."""
    try:
        recording = Recording.from_file(file, recording_id=recording_id)
    except Exception as error:  # any backend failure means the same to the user
        raise AsrflowError(
            f"{PARAM}: cannot read noise file {file} ({first_line(error)}); re-encode it or remove it"
        ) from None
    if recording.num_samples <= 0:
        raise AsrflowError(f"{PARAM}: noise file {file} holds no samples; remove it")
    return recording


def _cuts_in_manifest(path: Path) -> CutSet:
    """The cuts of a Lhotse recordings or cuts manifest; every cut must carry audio."""
    try:
        manifest = load_manifest(path)
    except Exception as error:  # Lhotse raises many types for a file that is not a manifest
        raise AsrflowError(
            f"{PARAM} {path} is not a Lhotse manifest Lhotse can read ({first_line(error)}); give a "
            "recordings or cuts manifest (.jsonl.gz) or a folder of noise audio"
        ) from None
    if isinstance(manifest, RecordingSet):
        return _cuts_of(manifest)
    if not isinstance(manifest, CutSet):
        raise AsrflowError(f"{PARAM} {path} holds a {type(manifest).__name__}; give a recordings or cuts manifest")
    silent = [cut.id for cut in manifest if not cut.has_recording]
    if silent:
        raise AsrflowError(
            f"{PARAM} {path}: cut(s) {', '.join(silent[:5])} have no audio (features only); give cuts with recordings"
        )
    return manifest
