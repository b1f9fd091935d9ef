"""Fbank extraction with Lhotse: every split, one rate, CMVN statistics, whole-folder output."""

from __future__ import annotations

import json

import pytest
import torch

from asrflow.data.features import CMVN_FILE, FeatureConfig, compute_features, load_cmvn
from asrflow.data.manifests import load_cuts
from asrflow.errors import AsrflowError


def test_yesno_features_are_80_dim_at_the_target_rate(yesno_data):
    fbank = yesno_data / "fbank"
    for split, count in (("train", 27), ("dev", 3), ("test", 30)):
        cuts = load_cuts(fbank, split)
        assert len(cuts) == count
        cut = next(iter(cuts))
        assert cut.has_features and cut.num_features == 80
        assert cut.sampling_rate == 16000
        assert cut.load_features().shape == (cut.num_frames, 80)
    stats = json.loads((fbank / CMVN_FILE).read_text())
    assert len(stats["norm_means"]) == len(stats["norm_stds"]) == 80
    train_feats = torch.cat([torch.from_numpy(c.load_features()) for c in load_cuts(fbank, "train")])
    normalised = load_cmvn(fbank / CMVN_FILE)(train_feats)
    assert normalised.mean(0).abs().max() < 1e-2
    assert (normalised.std(0) - 1).abs().max() < 1e-2


def test_missing_manifests_are_a_user_error_and_leave_no_output(tmp_path):
    with pytest.raises(AsrflowError, match="train_cuts.jsonl.gz not found"):
        compute_features(tmp_path / "nowhere", tmp_path / "fbank", FeatureConfig(num_jobs=1))
    assert not (tmp_path / "fbank").exists()
    assert list(tmp_path.iterdir()) == []


def test_two_processes_extract_the_same_features_as_one(yesno_data, tmp_path):
    import numpy as np

    compute_features(yesno_data / "manifests", tmp_path / "fbank2", FeatureConfig(num_jobs=2))
    for split in ("dev", "test"):
        one = {cut.id: cut.load_features() for cut in load_cuts(yesno_data / "fbank", split)}
        two = {cut.id: cut.load_features() for cut in load_cuts(tmp_path / "fbank2", split)}
        assert one.keys() == two.keys()
        assert all(np.array_equal(one[key], two[key]) for key in one)


def test_automatic_job_count_follows_the_amount_of_audio(yesno_data):
    from asrflow.data.features import AUDIO_S_PER_JOB, jobs_for

    cuts = load_cuts(yesno_data / "manifests", "test")  # about 3 minutes
    assert jobs_for(cuts, 8) == 1
    long = cuts.repeat(times=int(4 * AUDIO_S_PER_JOB // sum(c.duration for c in cuts)) + 1)
    assert jobs_for(long, 8) == 4
    assert jobs_for(long, 2) == 2
