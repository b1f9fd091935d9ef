"""MLflow through a crash: a training process SIGKILLed mid-run and resumed logs one clean run.

Real training processes (``tests.support.train_entry``) write to a real SQLite MLflow store given by
``MLFLOW_TRACKING_URI``. After the kill, the points of the steps after the last checkpoint
were never flushed; the resumed process re-runs those steps and must log each exactly once.
"""

from __future__ import annotations

import collections
import signal
from pathlib import Path

import mlflow
import pytest
import yaml
from mlflow.tracking import MlflowClient

from asrflow.tracking.run import LOGGED_THROUGH_TAG
from asrflow.training.checkpoint import list_checkpoints, load_checkpoint, step_of
from tests.support.mlflow_store import fresh_mlflow_store
from tests.support.train_entry import TrainingProcess, run_training

OVERRIDES = {
    "train.optim.epochs": 2,
    "train.checkpoint.checkpoint_every_steps": 4,
    "train.checkpoint.validate_every_steps": 4,
    "run.num_workers": 0,
    "run.experiment": "resume-test",
}
KILL_AFTER = 11  # last checkpoint: step 8, so steps 9-11 are logged only in memory when the kill comes


@pytest.mark.slow
def test_killed_and_resumed_run_is_one_mlflow_run_with_every_step_once(yesno_data, tmp_path, monkeypatch):
    uri = fresh_mlflow_store(tmp_path / "store")
    exp = tmp_path / "exp"
    process = TrainingProcess(
        yesno_data, exp, OVERRIDES, log_path=tmp_path / "killed.log", pause_after_step=KILL_AFTER, tracking_uri=uri
    )
    process.wait_paused()
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs(client.get_experiment_by_name("resume-test").experiment_id)
    # what the store holds at the kill: steps up to the last checkpoint, nothing later
    assert run.data.tags[LOGGED_THROUGH_TAG] == "8"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(range(1, 9))
    process.kill()
    assert process.process.returncode == -signal.SIGKILL
    assert step_of(list_checkpoints(exp / "checkpoints")[0]) == 8

    log = run_training(yesno_data, exp, OVERRIDES, log_path=tmp_path / "resumed.log", tracking_uri=uri)
    assert f"continuing MLflow run {run.info.run_id}" in log

    experiment = client.get_experiment_by_name("resume-test")
    runs = client.search_runs(experiment.experiment_id)
    assert [r.info.run_id for r in runs] == [run.info.run_id], "exactly one run in the experiment"
    run = runs[0]
    assert run.info.status == "FINISHED"
    final = load_checkpoint(list_checkpoints(exp / "checkpoints")[0])
    steps = final["counters"]["global_step"]
    assert final["complete"] and steps == 18
    assert run.data.tags[LOGGED_THROUGH_TAG] == str(steps)

    # every per-step metric: each step 1..N exactly once, no gaps
    per_step = [key for key in run.data.metrics if key.startswith("train/") and key != "train/final_best_dev_loss"]
    assert {"train/loss", "train/lr", "train/grad_norm", "train/epoch"} <= set(per_step)
    for key in per_step:
        history = client.get_metric_history(run.info.run_id, key)
        counts = collections.Counter(m.step for m in history)
        assert sorted(counts) == list(range(1, steps + 1)), key
        assert set(counts.values()) == {1}, f"{key}: duplicated steps {[s for s, n in counts.items() if n > 1]}"
    loss = sorted(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    assert [m.value for m in loss] == final["history"]["loss"]  # the redone steps' values
    dev = collections.Counter(m.step for m in client.get_metric_history(run.info.run_id, "dev/loss"))
    assert dev == {step: 1 for step in range(4, steps + 1, 4)}

    # params: the whole config, flattened, logged once at the start
    params = run.data.params
    assert params["seed"] == "42"
    assert params["train.optim.lr"] == "0.003"
    assert params["train.model.d_model"] == "32"
    assert params["train.optim.epochs"] == "2"
    assert params["features.num_mel_bins"] == "80"
    assert params["train.data.noise_snr_db"] == "[10, 20]"  # as params.yaml writes it

    # artifacts: the model bundle, the tokenizer, the params the run was given, the loss plot data
    assert {a.path for a in client.list_artifacts(run.info.run_id, "params")} == {"params/params.yaml"}
    folder = client.download_artifacts(run.info.run_id, "params", str(tmp_path / "downloaded"))
    logged = yaml.safe_load((Path(folder) / "params.yaml").read_text())
    assert (
        logged["seed"] == 42 and logged["train"]["model"]["d_model"] == 32 and logged["train"]["optim"]["epochs"] == 2
    )
    # the model: a logged model of the run, in its experiment, carrying the bundle
    [output] = run.outputs.model_outputs
    model = client.get_logged_model(output.model_id)
    assert model.source_run_id == run.info.run_id and model.experiment_id == run.info.experiment_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{output.model_id}", dst_path=str(tmp_path / "m")))
    assert list(local.rglob("model.pt")), sorted(p.name for p in local.rglob("*"))
    assert {a.path for a in client.list_artifacts(run.info.run_id, "tokenizer")} == {"tokenizer/tokenizer.model"}
    assert {a.path for a in client.list_artifacts(run.info.run_id, "plots")} == {"plots/train_loss.csv"}
