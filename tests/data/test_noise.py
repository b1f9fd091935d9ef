"""Noise for augmentation: a folder of audio in any readable format, or a Lhotse manifest."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from lhotse import CutSet, Recording, RecordingSet, SupervisionSegment, SupervisionSet

from asrflow.data.loading.noise import load_noise_cuts
from asrflow.errors import AsrflowError


def write_noise(path: Path, seconds: float, rate: int, channels: int = 1) -> Path:
    """Seeded white noise at ``rate`` Hz; the file format follows the extension."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(len(path.name))
    sf.write(path, (0.1 * rng.standard_normal((int(seconds * rate), channels))).astype(np.float32), rate)
    return path


@pytest.fixture
def noise_folder(tmp_path: Path) -> Path:
    """A MUSAN-like tree: wav and flac, nested folders, another rate, stereo, and a README."""
    folder = tmp_path / "noise"
    write_noise(folder / "hum.wav", 0.7, 16000)
    write_noise(folder / "free-sound" / "rain.flac", 1.5, 16000)
    write_noise(folder / "free-sound" / "street.FLAC", 1.0, 8000, channels=2)
    (folder / "README").write_text("noise from somewhere\n")
    (folder / "LICENSE.txt").write_text("CC BY 4.0\n")
    return folder


def check_noise(cuts: CutSet, durations: dict[str, float]) -> None:
    """Every cut is mono 16 kHz audio of the expected duration."""
    assert sorted(cut.id for cut in cuts) == sorted(durations)
    for cut in cuts:
        audio = cut.load_audio()
        assert cut.sampling_rate == 16000 and audio.shape[0] == 1
        assert audio.shape[1] == pytest.approx(durations[cut.id] * 16000, abs=2)


def test_folder_of_wav_and_flac_in_sub_folders(noise_folder: Path) -> None:
    cuts = load_noise_cuts(noise_folder, 16000)
    check_noise(cuts, {"hum.wav": 0.7, "free-sound/rain.flac": 1.5, "free-sound/street.FLAC": 1.0})


def test_lhotse_recordings_manifest_like_the_musan_recipe_writes(noise_folder: Path, tmp_path: Path) -> None:
    recordings = RecordingSet.from_recordings(
        Recording.from_file(path, recording_id=path.stem)
        for path in (noise_folder / "hum.wav", noise_folder / "free-sound" / "street.FLAC")
    )
    manifest = tmp_path / "musan_recordings_noise.jsonl.gz"
    recordings.to_file(manifest)
    check_noise(load_noise_cuts(manifest, 16000), {"hum": 0.7, "street": 1.0})


def test_lhotse_cuts_manifest(noise_folder: Path, tmp_path: Path) -> None:
    recording = Recording.from_file(noise_folder / "free-sound" / "rain.flac", recording_id="rain")
    cuts = CutSet.from_manifests(recordings=RecordingSet.from_recordings([recording]))
    manifest = tmp_path / "noise_cuts.jsonl.gz"
    cuts.to_file(manifest)
    check_noise(load_noise_cuts(manifest, 16000), {next(iter(cuts)).id: 1.5})


def test_missing_or_empty_noise_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(AsrflowError, match=r"train.data.noise_dir .*nowhere not found"):
        load_noise_cuts(tmp_path / "nowhere", 16000)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "README").write_text("no audio here\n")
    with pytest.raises(AsrflowError, match=r"train.data.noise_dir .*empty holds no noise"):
        load_noise_cuts(empty, 16000)


def test_bad_noise_file_or_manifest_is_named(noise_folder: Path, tmp_path: Path) -> None:
    (noise_folder / "broken.wav").write_bytes(b"RIFF not audio" * 10)
    with pytest.raises(AsrflowError, match=r"cannot read noise file .*broken.wav.*re-encode it or remove it"):
        load_noise_cuts(noise_folder, 16000)
    not_manifest = tmp_path / "noise.jsonl.gz"
    not_manifest.write_bytes(b"plain bytes")
    with pytest.raises(AsrflowError, match=r"noise.jsonl.gz is not a Lhotse manifest"):
        load_noise_cuts(not_manifest, 16000)
    supervisions = tmp_path / "supervisions.jsonl.gz"
    SupervisionSet.from_segments([SupervisionSegment("s", "r", 0.0, 1.0)]).to_file(supervisions)
    with pytest.raises(AsrflowError, match="holds a SupervisionSet; give a recordings or cuts manifest"):
        load_noise_cuts(supervisions, 16000)
