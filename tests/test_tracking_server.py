"""A tracking server that goes away mid-run: training goes on, the points are kept (in the
buffer and the checkpoint state) and sent once the same server is back. A real ``mlflow
server``, stopped and restarted on the same port and store (marked ``serve``: slow)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from asrflow.tracking.run import LOGGED_THROUGH_TAG, MlflowRun
from tests.support.processes import free_port
from tests.support.servers import stop, wait_healthy

pytestmark = pytest.mark.serve


def start_server(folder: Path, port: int, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    with log.open("ab") as out:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{folder / 'mlflow.db'}",
            ],
            cwd=folder,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    wait_healthy(f"http://127.0.0.1:{port}", server, log)
    return server


def record(tracker: MlflowRun, first: int, last: int) -> None:
    for step in range(first, last + 1):
        tracker.record(step, {"train/loss": 10.0 / step, "train/lr": 1e-3 * step})


def test_points_logged_while_the_server_is_down_are_sent_when_it_is_back(tmp_path, caplog):
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    server = start_server(tmp_path, port, log)
    try:
        tracker = MlflowRun.start(tracking_uri=uri, run_name="train")
        record(tracker, 1, 5)
        assert tracker.flush()

        stop(server)
        record(tracker, 6, 10)
        assert tracker.flush() is False  # no exception: training would go on
        assert len(tracker.metrics.pending) == 10
        assert len(tracker.state_dict()["pending"]) == 10  # what the next checkpoint keeps
        record(tracker, 11, 12)
        assert tracker.flush() is False
        assert any("cannot be reached" in r.getMessage() for r in caplog.records)

        server = start_server(tmp_path, port, log)
        record(tracker, 13, 14)
        assert tracker.flush()
        assert len(tracker.metrics.pending) == 0
        tracker.end()

        client = MlflowClient(tracking_uri=uri)
        for key in ("train/loss", "train/lr"):
            steps = sorted(metric.step for metric in client.get_metric_history(tracker.run_id, key))
            assert steps == list(range(1, 15)), key
        run = client.get_run(tracker.run_id)
        assert run.data.tags[LOGGED_THROUGH_TAG] == "14"
        assert run.info.status == "FINISHED"
    finally:
        stop(server)
