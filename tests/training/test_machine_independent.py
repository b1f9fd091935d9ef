"""Issue 13, item 2 at the trainer level: features extracted by 1 or by 2 processes train
the same model, weight for weight, and an unfinished run resumes after ``num_jobs`` changed.

The data-level half (same manifest order, CMVN bytes, content digest, plans and feature
matrices for 1 and 2 jobs) is ``tests/test_features.py``; the plans' independence of the
manifest order is ``tests/data/test_index.py``.
"""

from __future__ import annotations

import re

import pytest
import torch

from asrflow.data.features.extract import compute_features
from tests.support.corpora import feature_config
from tests.support.mlflow_store import fresh_mlflow_store
from tests.support.train_entry import TrainingProcess, run_training

OVERRIDES = {"train.optim.epochs": 1, "run.num_workers": 0, "train.checkpoint.checkpoint_every_steps": 2}


@pytest.fixture(scope="module")
def two_job_data(yesno_data, tmp_path_factory):
    """The yesno data with its features extracted again by two processes (same manifests, tokenizer)."""
    root = tmp_path_factory.mktemp("two_jobs")
    (root / "manifests").symlink_to(yesno_data / "manifests")
    (root / "lang").symlink_to(yesno_data / "lang")
    compute_features(yesno_data / "manifests", root / "fbank", feature_config(num_jobs=2))
    assert (root / "fbank" / "train_feats").is_dir()  # two jobs really wrote two storage files
    return root


def _weights(exp):
    return torch.load(exp / "model.pt", map_location="cpu", weights_only=True)["model"]


@pytest.mark.slow
def test_one_and_two_extraction_jobs_train_the_same_weights(yesno_data, two_job_data, tmp_path):
    runs = {}
    for name, data in (("one", yesno_data), ("two", two_job_data)):
        exp = tmp_path / name / "exp"
        run_training(
            data, exp, OVERRIDES, log_path=tmp_path / f"{name}.log", tracking_uri=fresh_mlflow_store(tmp_path / name)
        )
        runs[name] = _weights(exp)
    assert runs["one"].keys() == runs["two"].keys()
    for key, tensor in runs["one"].items():
        assert torch.equal(runs["two"][key], tensor), key


@pytest.mark.slow
def test_an_unfinished_run_resumes_after_num_jobs_changed(yesno_data, two_job_data, tmp_path):
    exp = tmp_path / "exp"
    uri = fresh_mlflow_store(tmp_path)
    process = TrainingProcess(
        yesno_data,
        exp,
        {**OVERRIDES, "train.optim.epochs": 2},
        log_path=tmp_path / "first.log",
        pause_after_step=5,
        tracking_uri=uri,
    )
    process.wait_paused()
    process.kill()
    log = run_training(
        two_job_data, exp, {**OVERRIDES, "train.optim.epochs": 2}, log_path=tmp_path / "resume.log", tracking_uri=uri
    )
    assert re.search(r"resuming from \S+: step 4", log), log
