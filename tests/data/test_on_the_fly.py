"""On-the-fly features: the features stage writes cuts without features and CMVN statistics,
and training computes fbank (with speed perturbation and noise) in the data loader."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import soundfile as sf
import torch
from lhotse.dataset import GlobalMVN

from asrflow.data.features.cmvn import CMVN_FILE, load_cmvn
from asrflow.data.features.extract import compute_features
from asrflow.data.manifests import SPLITS, cuts_path, load_cuts
from asrflow.errors import AsrflowError
from asrflow.serving.bundle import load_bundle
from tests.support.corpora import feature_config
from tests.support.tiny_config import tiny_train_data, tiny_trainer

SUBSET = {"train": 12, "dev": 2, "test": 2}
OTF = feature_config(on_the_fly=True, num_jobs=1)


@pytest.fixture(scope="module")
def otf_data(yesno_data, tmp_path_factory):
    """A small part of yesno: ``manifests/``, ``fbank/`` (on-the-fly) and ``lang/``."""
    root = tmp_path_factory.mktemp("otf")
    (root / "manifests").mkdir()
    for split, count in SUBSET.items():
        load_cuts(yesno_data / "manifests", split).subset(first=count).to_file(cuts_path(root / "manifests", split))
    counts = compute_features(root / "manifests", root / "fbank", OTF)
    assert counts == SUBSET
    shutil.copytree(yesno_data / "lang", root / "lang")
    return root


@pytest.fixture(scope="module")
def noise_dir(tmp_path_factory):
    """Noise at 8 kHz (resampled by the trainer) and at 16 kHz."""
    folder = tmp_path_factory.mktemp("noise")
    rng = np.random.default_rng(1)
    for name, rate, seconds in (("fan.wav", 8000, 3.0), ("hiss.wav", 16000, 1.0)):
        sf.write(folder / name, rng.normal(0.0, 0.1, int(rate * seconds)).astype(np.float32), rate)
    return folder


def test_on_the_fly_cuts_have_no_features(otf_data, yesno_data):
    fbank = otf_data / "fbank"
    for split in SPLITS:
        cuts = load_cuts(fbank, split).to_eager()
        assert len(cuts) == SUBSET[split]
        for cut in cuts:
            assert not cut.has_features
            assert cut.has_recording and cut.sampling_rate == 16000  # yesno is 8 kHz: resampled
    assert not [p for p in fbank.iterdir() if p.name.endswith(("_feats", ".lca"))], "no feature storage"
    assert json.loads((fbank / "config.json").read_text())["on_the_fly"] is True
    # The statistics match those of the stored features of the same cuts (lilcom is lossy).
    mvn = load_cmvn(fbank / CMVN_FILE)
    train_ids = list(load_cuts(fbank, "train").ids)
    stored = GlobalMVN.from_cuts(load_cuts(yesno_data / "fbank", "train").to_eager().subset(cut_ids=train_ids))
    assert mvn.norm_means.shape == (OTF.num_mel_bins,)
    assert torch.isfinite(mvn.norm_stds).all() and (mvn.norm_stds > 0).all()
    torch.testing.assert_close(mvn.norm_means, stored.norm_means, atol=0.05, rtol=0.0)
    torch.testing.assert_close(mvn.norm_stds, stored.norm_stds, atol=0.0, rtol=0.05)


@pytest.mark.slow
def test_training_with_on_the_fly_features_speed_and_noise(otf_data, noise_dir, tmp_path):
    overrides = {
        "train.optim.epochs": 1,
        "train.data.speed_perturb": True,
        "train.data.noise_dir": str(noise_dir),
        "features.num_jobs": OTF.num_jobs,  # the rest of features: as otf_data was computed
    }
    trainer = tiny_trainer(otf_data, tmp_path / "exp", overrides, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert trainer.features == OTF
    paths = trainer.paths
    summary = trainer.run().summary
    assert summary
    bundle = load_bundle(paths.model_path)
    assert bundle.features == OTF
    assert torch.equal(bundle.mvn.norm_means, load_cmvn(otf_data / "fbank" / CMVN_FILE).norm_means)
    losses = paths.loss_csv.read_text().splitlines()[1:]
    assert losses and all(np.isfinite(float(line.split(",")[1])) for line in losses)


def test_noise_needs_on_the_fly_features_and_audio(otf_data, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(AsrflowError, match="on_the_fly"):
        tiny_train_data(otf_data, {"train.data.noise_dir": str(tmp_path), "features.on_the_fly": False})
    with pytest.raises(AsrflowError, match="empty holds no noise"):
        tiny_train_data(otf_data, {"train.data.noise_dir": str(tmp_path / "empty")})
