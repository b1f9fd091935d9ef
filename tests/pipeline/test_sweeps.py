"""A sweep: experiments queued with ``dvc exp run --queue -S`` and run by ``dvc queue start`` train in DVC's
temporary workspaces, each into its own run of the project's MLflow store (named and tagged with the
experiment, its differing params in the description), and ``dvc exp show`` lists their WER. One killed
half-way (``dvc queue kill``) and queued again resumes from its checkpoint, in the same MLflow run."""

from __future__ import annotations

import csv
import io
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from asrflow.params import set_param
from asrflow.tracking.naming import DVC_EXP_TAG, NOTE_TAG
from asrflow.training.sweep import SWEEP_DIR, sweep_key
from tests.support.pipeline_tools import IDENTITY, run
from tests.support.processes import running
from tests.support.repo import tool_env

pytestmark = pytest.mark.pipeline

QUEUED = re.compile(r"Queued experiment '([^']+)'")
SAVED = re.compile(r"step-(\d+)\.pt$")
QUEUE_TIMEOUT_S = 900
# Few epochs keep the sweep short; the killed experiment's are enough to stop it half-way.
SWEEP_EPOCHS = 2
KILLED_EPOCHS = 25
KILL_AFTER_STEP = 50


def _env(copy: Path) -> dict[str, str]:
    """A user's environment: no MLFLOW_TRACKING_URI, so the stages use the relative default store."""
    env = tool_env(copy)
    env.pop("MLFLOW_TRACKING_URI")
    return env


def _queue(copy: Path, *overrides: str, **kwargs) -> list[str]:
    args = [item for override in overrides for item in ("-S", override)]
    output = run(copy, "dvc", "exp", "run", "--queue", *args, env=_env(copy), **kwargs).stdout
    return QUEUED.findall(output)


def _statuses(copy: Path) -> dict[str, str]:
    """Experiment name -> its newest task's status (Queued, Running, Success, Failed)."""
    lines = run(copy, "dvc", "queue", "status", env=_env(copy)).stdout.splitlines()
    rows = [line.split() for line in lines[1:] if line.strip() and not line.startswith("Worker")]
    return {row[1]: row[-1] for row in reversed(rows) if len(row) >= 4}


def _start(copy: Path, jobs: int) -> None:
    # The worker outlives the command and keeps its output streams: none are handed to it.
    subprocess.run(
        ["dvc", "queue", "start", "-j", str(jobs)],
        cwd=copy,
        env=_env(copy),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        check=True,
        timeout=120,
    )


def _wait(copy: Path, names: list[str], done=("Success", "Failed")) -> dict[str, str]:
    deadline = time.monotonic() + QUEUE_TIMEOUT_S
    while time.monotonic() < deadline:
        statuses = _statuses(copy)
        if all(statuses.get(name) in done for name in names):
            return statuses
        time.sleep(2)
    raise AssertionError(f"the queue did not finish {names} in {QUEUE_TIMEOUT_S} s: {_statuses(copy)}")


def _params_with(copy: Path, overrides: dict[str, object]) -> dict:
    params = yaml.safe_load((copy / "params.yaml").read_text())
    for dotted, value in overrides.items():
        set_param(params, dotted, value)
    return params


def _runs(copy: Path) -> dict[str, object]:
    client = MlflowClient(tracking_uri=f"sqlite:///{copy}/mlflow.db")
    experiments = [experiment.experiment_id for experiment in client.search_experiments()]
    return {run.data.tags[DVC_EXP_TAG]: run for run in client.search_runs(experiments) if DVC_EXP_TAG in run.data.tags}


def _exp_show(copy: Path) -> dict[str, dict]:
    table = run(copy, "dvc", "exp", "show", "--csv", "--no-pager", env=_env(copy)).stdout
    return {row["Experiment"]: row for row in csv.DictReader(io.StringIO(table[table.index("Experiment") :]))}


def _wait_for_no_worker(copy: Path, timeout_s: float = 300) -> None:
    """Until every queue worker of ``copy`` has exited: a stopping worker still takes tasks queued meanwhile,
    and leaves them marked Running when it goes. A worker exits after 10 s idle, the first one cleaning the
    queue as it goes; in a full `make test` on 2 cores one took over 120 s."""
    deadline = time.monotonic() + timeout_s
    pid_files = (copy / ".dvc/tmp/exps/celery").glob("dvc-exp-worker-*.pid")
    for pid in {int(text) for path in pid_files if (text := path.read_text().strip()).isdigit()}:
        while running(pid):
            assert time.monotonic() < deadline, f"queue worker {pid} still running after {timeout_s} s"
            time.sleep(0.5)


@pytest.fixture
def sweep_copy(dvc_run):
    """The DVC copy with its state committed (what a user queues from); the queue is stopped afterwards."""
    copy = dvc_run.copy
    run(copy, "git", *IDENTITY, "add", "-A")
    run(copy, "git", *IDENTITY, "commit", "-q", "--allow-empty", "-m", "sweep baseline")
    yield copy
    run(copy, "dvc", "queue", "stop", "--kill", env=_env(copy), check=False)
    _wait_for_no_worker(copy)


def test_sweep_runs_each_experiment_into_its_own_mlflow_run(sweep_copy):
    copy = sweep_copy
    names = _queue(copy, f"train.optim.epochs={SWEEP_EPOCHS}", "train.optim.lr=0.001,0.002")
    assert len(names) == 2, names
    _start(copy, jobs=2)
    statuses = _wait(copy, names)
    assert statuses[names[0]] == statuses[names[1]] == "Success", statuses

    runs = _runs(copy)  # the project's store: DVC's temporary copies, where the stages ran, are gone
    for name, lr in zip(names, ("0.001", "0.002"), strict=True):
        found = runs[name]
        assert found.info.run_name == name and found.info.status == "FINISHED"
        assert found.data.params["train.optim.lr"] == lr
        assert f"- `train.optim.lr`: 0.003 -> {lr}" in found.data.tags[NOTE_TAG]
        assert "test/wer" in found.data.metrics
        assert (
            copy
            / SWEEP_DIR
            / sweep_key(_params_with(copy, {"train.optim.epochs": SWEEP_EPOCHS, "train.optim.lr": float(lr)}))
        ).is_dir()
    shown = _exp_show(copy)
    for name in names:
        assert shown[name]["wer"] not in ("", "!"), shown[name]
    assert {shown[name]["train.optim.lr"] for name in names} == {"0.001", "0.002"}


def test_a_killed_experiment_queued_again_resumes_from_its_checkpoint(sweep_copy):
    copy = sweep_copy
    overrides = {"train.optim.epochs": KILLED_EPOCHS, "train.optim.lr": 0.0025}
    folder = copy / SWEEP_DIR / sweep_key(_params_with(copy, overrides))
    (killed,) = _queue(copy, *(f"{key}={value}" for key, value in overrides.items()))
    _start(copy, jobs=1)
    deadline = time.monotonic() + QUEUE_TIMEOUT_S
    while not any(int(SAVED.search(path.name)[1]) >= KILL_AFTER_STEP for path in folder.glob("step-*.pt")):
        assert time.monotonic() < deadline, f"no checkpoint in {folder} after {QUEUE_TIMEOUT_S} s: {_statuses(copy)}"
        time.sleep(0.2)
    run(copy, "dvc", "queue", "kill", killed, env=_env(copy))  # SIGINT: the step in flight, a checkpoint, exit
    assert _wait(copy, [killed])[killed] == "Failed"
    stopped = max(int(SAVED.search(p.name)[1]) for p in folder.glob("step-*.pt"))
    assert KILL_AFTER_STEP <= stopped < KILLED_EPOCHS * 11, stopped  # yesno: 11 steps an epoch
    first_run = _runs(copy)[killed].info.run_id

    (again,) = _queue(copy, *(f"{key}={value}" for key, value in overrides.items()))
    _start(copy, jobs=1)
    assert _wait(copy, [again])[again] == "Success"
    log = run(copy, "dvc", "queue", "logs", again, env=_env(copy)).stdout
    assert f"resuming from {folder}/step-{stopped:08d}.pt: step {stopped}" in log, log[-3000:]
    resumed = _runs(copy)[again]  # the same run, now named after the experiment dvc exp show lists
    assert resumed.info.run_id == first_run and resumed.info.run_name == again
    assert _exp_show(copy)[again]["wer"] not in ("", "!")
