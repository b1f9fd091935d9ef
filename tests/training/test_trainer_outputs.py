"""What the Trainer writes besides the steps: best.pt, the final model choice, MLflow params and tags,
and what it checks when it resumes (the batch plan, the precision) or starts (option combinations).

Every run is the real ``Trainer`` on the prepared yesno data (tiny model, 9 steps per epoch)
with a real SQLite MLflow store in the test's folder.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from asrflow.errors import AsrflowError
from asrflow.training import checkpoint as ckpt
from asrflow.training.monitoring import LOSS_SCALE_FLOOR
from asrflow.training.observers import TrainObserver
from tests.support.mlflow_store import fresh_mlflow_store
from tests.support.tiny_config import tiny_params, tiny_trainer

SEED = 42
EXPERIMENT = "outputs-test"


def _overrides(overrides: dict) -> dict:
    return {"run.experiment": EXPERIMENT, **overrides}


def _trainer(data: Path, exp: Path, overrides: dict, observers=()):
    """The tiny Trainer with ``overrides`` (dotted keys); MLflow in ``exp/mlflow.db`` (kept if present)."""
    uri = f"sqlite:///{(exp / 'mlflow.db').resolve()}" if (exp / "mlflow.db").exists() else fresh_mlflow_store(exp)
    return tiny_trainer(data, exp, _overrides(overrides), seed=SEED, tracking_uri=uri, observers=observers)


def _run(exp: Path) -> tuple[MlflowClient, object]:
    client = MlflowClient(tracking_uri=f"sqlite:///{(exp / 'mlflow.db').resolve()}")
    (run,) = client.search_runs(client.get_experiment_by_name(EXPERIMENT).experiment_id)
    return client, run


def _bundle_info(exp: Path) -> dict:
    return torch.load(exp / "model.pt", map_location="cpu", weights_only=True)["info"]


# ---------------------------------------------------------------------- best.pt and the final model


FIRST_RUN = {
    "train.optim.epochs": 1,
    "train.checkpoint.validate_every_steps": 3,
    "train.checkpoint.checkpoint_every_steps": 4,
    "train.optim.average_last": 25,
    "train.checkpoint.keep_last": 20,
}


def test_an_improving_validation_writes_best_pt_off_the_checkpoint_schedule(yesno_data, tmp_path, caplog):
    """Validation every 3 steps, checkpoints every 4: each improving validation still gives best.pt."""
    with caplog.at_level(logging.INFO):
        _trainer(yesno_data, tmp_path, FIRST_RUN).run()
    client, run = _run(tmp_path)
    dev = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "dev/loss")}
    assert sorted(dev) == [3, 6, 9]
    best_step = min(dev, key=dev.get)
    best = ckpt.load_checkpoint(tmp_path / "checkpoints" / ckpt.BEST)
    assert best["step"] == best_step
    assert best["checkpointing"]["best_dev_loss"] == dev[best_step]
    # Step 3's validation is the first (so it improved): it made a checkpoint, off the every-4 schedule.
    steps = sorted(ckpt.step_of(path) for path in ckpt.list_checkpoints(tmp_path / "checkpoints"))
    improved_at_6 = {6} if dev[6] < dev[3] else set()
    assert steps == sorted({0, 3, 4, 8, 9} | improved_at_6)
    step_3 = ckpt.load_checkpoint(ckpt.checkpoint_path(tmp_path / "checkpoints", 3))
    assert step_3["checkpointing"]["best_dev_loss"] == dev[3]
    # keep_last (20) < average_last (25): said at the start.
    assert "train.checkpoint.keep_last (20) < train.optim.average_last (25)" in caplog.text

    # The final model: average or last weights, whichever has the lower dev loss; both logged.
    info = _bundle_info(tmp_path)
    averaged, last = info["dev_loss_average"], info["dev_loss_last"]
    assert math.isfinite(averaged) and math.isfinite(last) and averaged != last
    assert info["final_weights"] == ("average" if averaged <= last else "last")
    assert info["averaged"] == [f"step-{step:08d}.pt" for step in sorted(steps, reverse=True) if 2 * step >= 9]
    metrics = run.data.metrics
    assert metrics["final/dev_loss_average"] == averaged and metrics["final/dev_loss_last"] == last
    assert f"final model: {info['final_weights']} weights" in caplog.text
    bundle = torch.load(tmp_path / "model.pt", map_location="cpu", weights_only=True)["model"]
    final = ckpt.load_checkpoint(ckpt.list_checkpoints(tmp_path / "checkpoints")[0])
    assert final["complete"]
    same_as_last = all(torch.equal(bundle[name], final["model"][name]) for name in bundle)
    assert same_as_last == (info["final_weights"] == "last")

    # The params artifact is the params the run was given, wherever the process runs.
    folder = client.download_artifacts(run.info.run_id, "params", str(tmp_path / "downloaded"))
    logged = yaml.safe_load((Path(folder) / "params.yaml").read_text())
    assert logged == tiny_params(yesno_data, _overrides(FIRST_RUN), seed=SEED)
    assert logged["train"]["checkpoint"]["validate_every_steps"] == 3 and logged["seed"] == SEED


# ---------------------------------------------------------------------- fp16 loss scale


def _one_epoch(precision: str) -> dict:
    """One epoch (9 steps) in ``precision``, no validation."""
    return {"train.optim.epochs": 1, "train.optim.precision": precision, "train.checkpoint.validate_every_steps": 0}


class _LowScale(TrainObserver):
    """Starts the run's (real) fp16 gradient scaler below the warning floor, through its public state."""

    def on_start(self, run) -> None:
        state = run.scaler.state_dict()
        run.scaler.load_state_dict({**state, "scale": LOSS_SCALE_FLOOR / 4})


def test_fp16_loss_scale_is_logged_and_a_collapse_warned(yesno_data, tmp_path, caplog):
    _trainer(yesno_data, tmp_path, _one_epoch("fp16"), [_LowScale()]).run()
    assert f"fp16 loss scale collapsed to {LOSS_SCALE_FLOOR / 4:g}" in caplog.text
    client, run = _run(tmp_path)
    history = client.get_metric_history(run.info.run_id, "train/loss_scale")
    assert sorted(m.step for m in history) == list(range(1, 10))
    assert all(0 < m.value < LOSS_SCALE_FLOOR for m in history)


def test_fp32_logs_no_loss_scale(yesno_data, tmp_path, caplog):
    _trainer(yesno_data, tmp_path, _one_epoch("fp32")).run()
    client, run = _run(tmp_path)
    assert client.get_metric_history(run.info.run_id, "train/loss_scale") == []
    assert "loss scale collapsed" not in caplog.text


# ---------------------------------------------------------------------- checks on resume


@pytest.fixture(scope="module")
def finished_run(yesno_data, tmp_path_factory) -> Path:
    """One epoch (9 steps) in fp32, checkpoints every 4 steps."""
    exp = tmp_path_factory.mktemp("finished") / "exp"
    exp.mkdir()
    _trainer(yesno_data, exp, _one_epoch("fp32")).run()
    return exp


def _unfinished_copy(finished: Path, exp: Path, step: int = 4) -> Path:
    """A copy of ``finished`` whose newest checkpoint is ``step`` (as if the process died after it)."""
    shutil.copytree(finished, exp)
    for path in ckpt.list_checkpoints(exp / "checkpoints"):
        if ckpt.step_of(path) > step:
            path.unlink()
    return ckpt.checkpoint_path(exp / "checkpoints", step)


def test_a_changed_batch_plan_restarts_the_epoch_from_its_first_batch(yesno_data, finished_run, tmp_path, caplog):
    path = _unfinished_copy(finished_run, tmp_path / "exp")
    state = ckpt.load_checkpoint(path)
    assert state["position"]["plan_digest"] and state["position"]["step_in_epoch"] == 4
    # What a resume sees when the sampler (or the train cuts) now plan other batches for epoch 0.
    other_plan = {**state, "position": {**state["position"], "plan_digest": "0" * 16}}
    ckpt.save_checkpoint(other_plan, path.parent, 4, keep_last=20, is_best=False)

    summary = _trainer(yesno_data, tmp_path / "exp", _one_epoch("fp32")).run().summary
    assert "the batch plan of epoch 0 differs from the checkpoint's" in caplog.text
    assert "epoch 0 restarts from its first batch" in caplog.text
    assert summary["steps"] == 4 + 9  # the whole of epoch 0 again, after the 4 steps already taken


def test_an_unchanged_plan_resumes_mid_epoch(yesno_data, finished_run, tmp_path, caplog):
    _unfinished_copy(finished_run, tmp_path / "exp")
    summary = _trainer(yesno_data, tmp_path / "exp", _one_epoch("fp32")).run().summary
    assert "restarts from its first batch" not in caplog.text
    assert summary["steps"] == 9


def test_a_resume_in_another_precision_warns_and_retags_the_run(yesno_data, finished_run, tmp_path, caplog):
    path = _unfinished_copy(finished_run, tmp_path / "exp")
    assert ckpt.load_checkpoint(path)["precision"] == "fp32"
    _, run = _run(tmp_path / "exp")
    assert run.data.tags["precision"] == "fp32"

    _trainer(yesno_data, tmp_path / "exp", _one_epoch("bf16")).run()
    assert "the checkpoint was trained in fp32, this run trains in bf16" in caplog.text
    _, run = _run(tmp_path / "exp")
    assert run.data.tags["precision"] == "bf16"
    assert run.data.tags["precision_reason"] == "train.optim.precision = bf16"
    assert run.data.tags["precision_changed"] == "fp32 -> bf16 at step 4"
    assert ckpt.load_checkpoint(ckpt.list_checkpoints(tmp_path / "exp" / "checkpoints")[0])["precision"] == "bf16"


# ---------------------------------------------------------------------- option checks at start


def test_speed_perturb_without_on_the_fly_features_is_refused(yesno_data, tmp_path):
    with pytest.raises(AsrflowError) as error:
        _trainer(yesno_data, tmp_path, {"train.data.speed_perturb": True, "features.on_the_fly": False}).run()
    assert "train.data.speed_perturb needs features.on_the_fly: true" in str(error.value)
    assert not os.path.exists(tmp_path / "checkpoints")
