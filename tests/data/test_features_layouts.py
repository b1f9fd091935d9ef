"""Every audio layout a real corpus has, in one split, through prepare and features:
mono and stereo, 8, 16, 22.05 and 44.1 kHz, WAV, FLAC and Ogg Vorbis."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
import torch

from asrflow.data.features.extract import compute_features
from asrflow.data.manifests import load_cuts
from asrflow.data.prepare.config import PrepareConfig
from asrflow.data.prepare.corpus import prepare_corpus
from asrflow.errors import AsrflowError
from tests.support.corpora import feature_config

#: (file name, sampling rate, channels, soundfile format and subtype)
LAYOUTS = [
    ("mono-8k.wav", 8000, 1, ("WAV", "PCM_16")),
    ("stereo-16k.wav", 16000, 2, ("WAV", "PCM_16")),
    ("mono-16k.flac", 16000, 1, ("FLAC", "PCM_16")),
    ("stereo-22k.ogg", 22050, 2, ("OGG", "VORBIS")),
    ("mono-44k.ogg", 44100, 1, ("OGG", "VORBIS")),
    ("stereo-44k.flac", 44100, 2, ("FLAC", "PCM_16")),
    ("stereo-8k.flac", 8000, 2, ("FLAC", "PCM_16")),
    ("mono-22k.wav", 22050, 1, ("WAV", "FLOAT")),
]
SECONDS = 1.3


def tone(rate: int, channels: int, seed: int) -> np.ndarray:
    """``SECONDS`` of two tones in noise, ``(samples, channels)``; the channels differ (a real stereo pair)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(SECONDS * rate)) / rate
    left = 0.3 * np.sin(2 * np.pi * 220 * t) + 0.01 * rng.standard_normal(t.size)
    right = 0.2 * np.sin(2 * np.pi * 330 * t) + 0.01 * rng.standard_normal(t.size)
    return np.stack([left, right][:channels], axis=1).astype(np.float32)


def write_corpus(folder, layouts=LAYOUTS) -> None:
    """A ``corpus: folder`` corpus with every layout in train, dev and test."""
    lines = {"train": [], "dev": [], "test": []}
    for seed, (name, rate, channels, (fmt, subtype)) in enumerate(layouts):
        for split in lines:
            path = folder / split / name
            path.parent.mkdir(parents=True, exist_ok=True)
            sf.write(path, tone(rate, channels, seed), rate, format=fmt, subtype=subtype)
            lines[split].append(f"{split}/{name}\tTONE NUMBER {seed}")
    for split, rows in lines.items():
        (folder / f"{split}.tsv").write_text("\n".join(rows) + "\n")


def prepared(tmp_path, **prepare):
    corpus = tmp_path / "corpus"
    write_corpus(corpus)
    section = {
        "corpus": "folder",
        "corpus_dir": str(corpus),
        "splits": {"train": "train", "dev": "dev", "test": "test"},
    }
    config = PrepareConfig.from_section({**section, **prepare})
    prepare_corpus(config, tmp_path / "manifests", seed=42)
    return tmp_path / "manifests"


def test_mixed_layouts_with_channel_mix_give_cuts_that_load_features_and_audio(tmp_path):
    manifests = prepared(tmp_path)
    counts = compute_features(manifests, tmp_path / "fbank", feature_config(num_jobs=1, num_mel_bins=40))
    assert counts == {split: len(LAYOUTS) for split in ("train", "dev", "test")}
    for split in counts:
        cuts = {cut.recording_id.split("/")[-1]: cut for cut in load_cuts(tmp_path / "fbank", split)}
        assert len(cuts) == len(LAYOUTS)
        for name, _rate, channels, _format in LAYOUTS:
            cut = cuts[name.rsplit(".", 1)[0]]
            assert cut.recording.sources[0].type == "file"  # points at the file, nothing in memory
            assert cut.num_channels == channels and cut.sampling_rate == 16000
            features = cut.load_features()
            assert features.shape == (cut.num_frames, 40) and np.isfinite(features).all()
            audio = cut.load_audio()
            assert audio.shape[0] == channels and abs(audio.shape[1] - round(SECONDS * 16000)) <= 1


@pytest.mark.slow
def test_a_stereo_cut_gets_the_features_of_its_channels_average(tmp_path):
    """The stereo WAV's features are those of a mono WAV holding the average of its two channels."""
    manifests = prepared(tmp_path)
    cut = next(c for c in load_cuts(manifests, "test") if c.recording_id.endswith("stereo-16k"))
    average = cut.load_audio().mean(axis=0)
    sf.write(tmp_path / "average.wav", average, 16000, subtype="FLOAT")
    from lhotse import Recording

    mono = Recording.from_file(tmp_path / "average.wav").to_cut()
    extractor = feature_config().extractor()
    expected = extractor.extract(mono.load_audio(), 16000)
    compute_features(manifests, tmp_path / "fbank", feature_config(num_jobs=2))
    stored = next(c for c in load_cuts(tmp_path / "fbank", "test") if c.id == cut.id)
    assert torch.allclose(torch.from_numpy(stored.load_features()), torch.from_numpy(expected), atol=0.05)
    left_only = extractor.extract(cut.load_audio()[:1], 16000)
    assert not torch.allclose(torch.from_numpy(stored.load_features()), torch.from_numpy(left_only), atol=0.05)


def test_multichannel_cuts_with_on_the_fly_features_are_refused_by_name(tmp_path):
    manifests = prepared(tmp_path)
    with pytest.raises(AsrflowError, match=r"multi-channel cuts \(train 4, dev 4, test 4\).*prepare.channel"):
        compute_features(manifests, tmp_path / "fbank", feature_config(on_the_fly=True))
    assert not (tmp_path / "fbank").exists()


def test_a_channel_index_gives_mono_cuts_of_that_channel(tmp_path):
    manifests = prepared(tmp_path, channel=1)
    compute_features(manifests, tmp_path / "fbank", feature_config(num_jobs=1, on_the_fly=True))
    cuts = list(load_cuts(tmp_path / "fbank", "train"))
    assert len(cuts) == len(LAYOUTS) and all(cut.num_channels == 1 for cut in cuts)
    assert all(cut.load_audio().shape == (1, round(SECONDS * 16000)) for cut in cuts)
