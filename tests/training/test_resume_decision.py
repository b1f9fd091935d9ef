"""The resume decision: fresh, resume, or stop with a message, from the newest checkpoint."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from asrflow.errors import AsrflowError
from asrflow.model.conformer_ctc import shape_record
from asrflow.training import checkpoint as ckpt
from asrflow.training.fingerprint import build_fingerprint, training_params
from asrflow.training.resume import FRESH, RESUME, decide
from tests.support.mlflow_store import fresh_mlflow_store
from tests.support.repo import copy_repo
from tests.support.tiny_config import tiny_settings
from tests.support.train_entry import train_in_process

CKPT_DIR = Path("exp/checkpoints")


def _model(settings, d_model: int = 32) -> dict:
    """The shape record of the tiny model of width ``d_model`` (80 bins in, 5 classes out)."""
    return shape_record(replace(settings.train.model, d_model=d_model), input_dim=80, vocab_size=5)


def _settings(
    overrides: dict | None = None, d_model: int = 32, *, seed: int = 42, data_digest: str = "abc123", code: str = "c0de"
):
    """The fingerprint and training params of the tiny run with ``overrides`` (dotted params.yaml keys)."""
    settings = tiny_settings(overrides=overrides)
    features = asdict(settings.features)
    config = settings.train
    fingerprint = build_fingerprint(
        _model(settings, d_model), features, data_digest=data_digest, seed=seed, config=config
    )
    return fingerprint, training_params(config, settings.run, code)


def _checkpoint(complete: bool, **settings) -> dict:
    fingerprint, params = _settings(**settings)
    return {"fingerprint": fingerprint, "train_params": params, "complete": complete, "step": 120}


def test_no_checkpoint_means_a_fresh_run():
    assert decide(None, *_settings(), CKPT_DIR) == FRESH


@pytest.mark.parametrize("complete", [False, True])
def test_same_settings_resume(complete):
    assert decide(_checkpoint(complete), *_settings(), CKPT_DIR) == RESUME


def test_finished_run_resumes_when_only_epochs_were_raised():
    # epochs is operational: a finished run continues with the extra epochs
    fingerprint, params = _settings({"train.optim.epochs": 10})
    assert decide(_checkpoint(True), fingerprint, params, CKPT_DIR) == RESUME


@pytest.mark.parametrize(
    "changed",
    [
        {"overrides": {"train.optim.lr": 0.01}},  # a train param
        {"overrides": {"run.nproc_per_node": 2}},  # the number of processes
        {"d_model": 64},  # the model shape
        {"data_digest": "other"},  # the training data
        {"seed": 7},
        {"code": "edited"},  # the training code
    ],
    ids=["lr", "ranks", "d_model", "data", "seed", "code"],
)
def test_finished_run_with_changed_settings_starts_fresh(changed, caplog):
    with caplog.at_level(logging.INFO, logger="asrflow.training.resume"):
        assert decide(_checkpoint(True), *_settings(**changed), CKPT_DIR) == FRESH
    assert "used other settings" in caplog.text and "starting a fresh run" in caplog.text


def test_unfinished_run_with_a_changed_train_param_resumes_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="asrflow.training.resume"):
        decision = decide(_checkpoint(False), *_settings({"train.optim.lr": 0.01}), CKPT_DIR)
    assert decision == RESUME
    assert "train param changed since the checkpoint: train.optim.lr: 0.003 -> 0.01" in caplog.text


def test_unfinished_run_under_edited_code_resumes_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="asrflow.training.resume"):
        assert decide(_checkpoint(False), *_settings(code="edited"), CKPT_DIR) == RESUME
    assert "train param changed since the checkpoint: code_digest: 'c0de' -> 'edited'" in caplog.text


def test_unfinished_run_with_operational_changes_resumes_silently(caplog):
    changed = {
        "run.num_workers": 4,
        "train.checkpoint.checkpoint_every_steps": 100,
        "train.checkpoint.keep_last": 1,
        "train.optim.epochs": 9,
    }
    with caplog.at_level(logging.WARNING, logger="asrflow.training.resume"):
        assert decide(_checkpoint(False), *_settings(changed), CKPT_DIR) == RESUME
    assert caplog.text == ""


def test_feature_extraction_parallelism_does_not_block_a_resume(caplog):
    """features.num_jobs only sets how many processes extract features: not part of the fingerprint."""
    settings = tiny_settings()
    config, model = settings.train, _model(settings)
    same = {"data_digest": "abc123", "seed": 42, "config": config}
    one_job = build_fingerprint(model, asdict(replace(settings.features, num_jobs=1)), **same)
    many_jobs = build_fingerprint(model, asdict(replace(settings.features, num_jobs=8)), **same)
    assert one_job == many_jobs
    assert "features.num_mel_bins" in one_job and "features.num_jobs" not in one_job
    checkpoint = {
        "fingerprint": one_job,
        "train_params": training_params(config, settings.run, "c0de"),
        "complete": False,
        "step": 120,
    }
    with caplog.at_level(logging.WARNING, logger="asrflow.training.resume"):
        assert decide(checkpoint, many_jobs, training_params(config, settings.run, "c0de"), CKPT_DIR) == RESUME
    assert caplog.text == ""


@pytest.mark.parametrize(
    "changed, key",
    [
        ({"d_model": 64}, "model.d_model: 32 -> 64"),
        ({"overrides": {"train.data.max_duration_s": 60.0}}, "train.data.max_duration_s: 30.0 -> 60.0"),
        ({"data_digest": "other"}, "data_digest: 'abc123' -> 'other'"),
    ],
    ids=["model_shape", "batch_plan", "data"],
)
def test_unfinished_run_with_a_changed_fingerprint_stops_with_a_message(changed, key):
    with pytest.raises(AsrflowError) as error:
        decide(_checkpoint(False), *_settings(**changed), CKPT_DIR)
    message = str(error.value)
    assert key in message
    assert "unfinished run (step 120)" in message
    assert f"rm -r {CKPT_DIR}" in message
    assert "Restore those params to resume it" in message


# ---------------------------------------------------------------------- with the real Trainer


def test_trainer_refuses_an_unfinished_run_with_another_model_shape(yesno_data, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    exp = tmp_path / "exp"
    uri = fresh_mlflow_store(tmp_path)
    overrides = {
        "train.optim.epochs": 1,
        "train.checkpoint.checkpoint_every_steps": 4,
        "train.checkpoint.validate_every_steps": 0,
    }
    summary = train_in_process(yesno_data, exp, overrides, uri)
    directory = exp / "checkpoints"
    # Make it an unfinished run: drop the final checkpoint, as if the process died after step 8.
    (directory / f"step-{summary['steps']:08d}.pt").unlink()
    newest = ckpt.list_checkpoints(directory)[0]
    before = {path.name: path.read_bytes() for path in directory.iterdir()}

    with pytest.raises(AsrflowError) as error:
        train_in_process(yesno_data, exp, {**overrides, "train.model.d_model": 48}, uri)
    message = str(error.value)
    assert f"{directory} holds an unfinished run (step {ckpt.step_of(newest)})" in message
    assert "model.d_model: 32 -> 48" in message
    assert f"rm -r {directory}" in message
    # nothing was lost: the checkpoints are as they were
    assert {path.name: path.read_bytes() for path in directory.iterdir()} == before

    # with the shape restored, the same run resumes and finishes
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="asrflow.training.trainer"):
        assert train_in_process(yesno_data, exp, overrides, uri)["steps"] == summary["steps"]
    assert f"resuming from {newest}" in caplog.text


def test_trainer_starts_fresh_after_a_finished_run_with_changed_params(yesno_data, tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    exp = tmp_path / "exp"
    uri = fresh_mlflow_store(tmp_path)
    overrides = {
        "train.optim.epochs": 1,
        "train.checkpoint.checkpoint_every_steps": 4,
        "train.checkpoint.validate_every_steps": 0,
    }
    first = train_in_process(yesno_data, exp, overrides, uri)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        second = train_in_process(yesno_data, exp, {**overrides, "train.optim.lr": 0.001}, uri)
    assert "starting a fresh run" in caplog.text
    assert second["steps"] == first["steps"]  # trained again from step 0
    newest = ckpt.load_checkpoint(ckpt.list_checkpoints(exp / "checkpoints")[0])
    assert newest["train_params"]["train.optim.lr"] == 0.001
    assert newest["history"]["step"] == list(range(1, first["steps"] + 1))


@pytest.mark.slow
def test_a_finished_run_trains_again_after_its_training_code_is_edited(yesno_data, tmp_path):
    """What DVC and Snakemake rely on when they re-run the train stage because its code changed.

    The trainer runs from a copy of the repository, in its own process: the same finished
    run resumes (nothing left to do) under unchanged code, and trains again from step 0
    after a comment is appended to one module of the training code.
    """
    repo = copy_repo(tmp_path / "repo")
    exp = tmp_path / "exp"
    overrides = json.dumps(
        {
            "train.optim.epochs": 1,
            "train.checkpoint.checkpoint_every_steps": 100,
            "train.checkpoint.validate_every_steps": 0,
        }
    )

    def train() -> str:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.support.train_entry",
                "--data",
                str(yesno_data),
                "--exp",
                str(exp),
                "--overrides",
                overrides,
            ],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(repo), "GIT_PYTHON_REFRESH": "quiet", "MLFLOW_TRACKING_URI": ""},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout + done.stderr

    assert "starting a fresh run" in train()
    unchanged = train()
    assert "resuming from" in unchanged and "starting a fresh run" not in unchanged
    with open(repo / "asrflow" / "training" / "step.py", "a") as module:
        module.write("\n# an edit\n")
    edited = train()
    assert re.search(r"used other settings \(code_digest: '[0-9a-f]{16}' -> '[0-9a-f]{16}'\)", edited), edited
    assert "starting a fresh run" in edited
