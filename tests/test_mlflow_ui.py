"""``mlflow ui`` started beside the default store shows asrflow's runs, metrics and artifacts."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from asrflow.params import flatten
from asrflow.testing.processes import free_port
from asrflow.tracking.run import MlflowRun

STARTUP_TIMEOUT_S = 60


def http(base: str, path: str, query: dict | None = None, body: dict | None = None) -> bytes:
    url = f"{base}{path}"
    if query:
        url += "?" + urllib.parse.urlencode(query)
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read()


def api(base: str, path: str, query: dict | None = None, body: dict | None = None) -> dict:
    return json.loads(http(base, path, query, body))


def wait_healthy(base: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"mlflow ui exited with {server.returncode}:\n{log.read_text()}")
        try:
            if http(base, "/health").strip() == b"OK":
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    pytest.fail(f"mlflow ui not healthy after {STARTUP_TIMEOUT_S} s:\n{log.read_text()}")


def stop(server: subprocess.Popen) -> None:
    """Terminate the server and everything it started (its own process group)."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=15)
    with contextlib.suppress(ProcessLookupError):  # workers left behind in the group
        os.killpg(server.pid, signal.SIGKILL)


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
