"""``mlflow ui`` started beside the default store shows asrflow's runs, metrics and artifacts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from asrflow.params import flatten
from asrflow.tracking.run import MlflowRun
from tests.support.processes import free_port
from tests.support.servers import api, http, stop, wait_healthy


@pytest.mark.slow
def test_mlflow_ui_shows_run_metrics_and_artifacts(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model.pt"
    model.write_bytes(b"\x00weights\x01")

    tracker = MlflowRun.start(experiment="asrflow", run_name="train")
    tracker.log_params(flatten({"train": {"lr": 0.001, "epochs": 2}, "seed": 1}))
    for step in range(1, 6):
        tracker.record(step, {"train/loss": 10.0 / step})
    tracker.flush()
    tracker.log_artifact(model, artifact_path="model")
    tracker.end()
    assert (tmp_path / "mlflow.db").is_file()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "ui.log"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    with log.open("wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "ui", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_healthy(base, server, log)

        experiment = api(base, "/api/2.0/mlflow/experiments/get-by-name", {"experiment_name": "asrflow"})
        experiment_id = experiment["experiment"]["experiment_id"]
        runs = api(base, "/api/2.0/mlflow/runs/search", body={"experiment_ids": [experiment_id]})["runs"]
        assert len(runs) == 1
        run = runs[0]
        assert run["info"]["run_id"] == tracker.run_id
        assert run["info"]["status"] == "FINISHED"
        assert run["info"]["run_name"] == "train"
        params = {p["key"]: p["value"] for p in run["data"]["params"]}
        assert params == {"train.lr": "0.001", "train.epochs": "2", "seed": "1"}
        latest = {m["key"]: m for m in run["data"]["metrics"]}
        assert latest["train/loss"]["step"] == 5
        assert latest["train/loss"]["value"] == pytest.approx(2.0)

        history = api(
            base, "/api/2.0/mlflow/metrics/get-history", {"run_id": tracker.run_id, "metric_key": "train/loss"}
        )["metrics"]
        assert sorted(int(m["step"]) for m in history) == [1, 2, 3, 4, 5]

        # The calls the UI's artifact browser makes.
        listing = api(base, "/ajax-api/2.0/mlflow/artifacts/list", {"run_id": tracker.run_id, "path": "model"})
        assert [f["path"] for f in listing["files"]] == ["model/model.pt"]
        content = http(base, "/get-artifact", {"path": "model/model.pt", "run_uuid": tracker.run_id})
        assert content == model.read_bytes()
    finally:
        stop(server)
