"""Launching tiny training jobs (torchrun with 2 gloo ranks, or one process) for the DDP tests.

Every job runs ``ddp_entry.py`` in its own session with a timeout; :func:`jobs` kills
whatever a test left running, so no test can hang or leave processes behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO
from train_entry import fresh_mlflow_store

from asrflow.launch.torchrun import torchrun_command
from asrflow.training.config import TrainConfig

ENTRY = Path(__file__).with_name("ddp_entry.py")
SEED = 42
JOB_TIMEOUT_S = 240.0


class Job:
    """One training job (torchrun with 2 ranks, or a single process) in its own session.

    Output goes to ``log_path``. :meth:`kill` SIGKILLs the launcher and every process
    below it (torchrun starts each rank in a session of its own, with its data workers).
    """

    def __init__(self, data: Path, exp: Path, overrides: dict, *, ranks: int = 2, env: dict | None = None):
        self.exp = Path(exp)
        self.exp.mkdir(parents=True, exist_ok=True)
        spec = self.exp / "spec.json"
        tracking = self.exp / "mlflow.db"
        uri = f"sqlite:///{tracking}" if tracking.is_file() else fresh_mlflow_store(self.exp)
        spec.write_text(
            json.dumps(
                {"data": str(data), "exp": str(self.exp), "config": overrides, "tracking_uri": uri, "seed": SEED}
            )
        )
        if ranks > 1:
            command = torchrun_command(TrainConfig(nproc_per_node=ranks), [str(ENTRY), str(spec)])
        else:
            command = [sys.executable, str(ENTRY), str(spec)]
        full_env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "GIT_PYTHON_REFRESH": "quiet",
            "PYTHONUNBUFFERED": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "MLFLOW_TRACKING_URI": uri,
            **(env or {}),
        }
        self.log_path = self.exp / f"job-{time.monotonic_ns()}.log"
        self.started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
                cwd=self.exp,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float = JOB_TIMEOUT_S) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job did not end within {timeout} s:\n{self.log()}") from None

    def wait_for(self, text: str, timeout: float = JOB_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log():
            if self.process.poll() is not None:
                raise AssertionError(f"job ended (exit {self.process.returncode}) before {text!r}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"no {text!r} within {timeout} s:\n{self.log()}")
            time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL the launcher and all its descendants (a node dying), then reap the launcher."""
        victims = [self.process.pid, *_descendants(self.process.pid)]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(timeout=60)
        for pid in victims[1:]:  # torchrun puts each rank in its own process group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def _descendants(root: int) -> list[int]:
    """Every process below ``root``, from /proc (parents before children)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [root]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


@pytest.fixture(name="jobs")
def jobs_fixture():
    """Start jobs through this; whatever is still running at the end of the test is killed."""
    started: list[Job] = []

    def start(*args, **kwargs) -> Job:
        job = Job(*args, **kwargs)
        started.append(job)
        return job

    yield start
    for job in started:
        if job.process.poll() is None:
            job.kill()
