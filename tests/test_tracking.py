"""The MLflow writer (asrflow.tracking.run) against a real SQLite MLflow store in a temporary folder: store URIs,
params and tags, flushes that die half-way, crash and resume, reopened runs, artifacts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from asrflow.errors import AsrflowError
from asrflow.params import flatten
from asrflow.tracking.metric_log import MetricLog
from asrflow.tracking.naming import param_value
from asrflow.tracking.run import LOGGED_THROUGH_TAG, REOPENED_END_STATUS_TAG, MlflowRun
from asrflow.tracking.store import (
    build_store_in_background,
    create_whole_sqlite_store,
    default_artifact_location,
    default_tracking_uri,
    resolve_tracking_uri,
)
from tests.support.mlflow_store import fresh_mlflow_store

REPO = Path(__file__).resolve().parents[1]
KEYS = ("train/loss", "train/lr")


def child_env() -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH``, for a child Python script."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))


@pytest.fixture
def client(uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri=uri)


def point(step: int) -> dict[str, float]:
    """What the training loop would record at ``step`` (deterministic, as after a resume)."""
    return {"train/loss": 10.0 / step, "train/lr": 1e-3 * step}


def record_steps(tracker: MlflowRun, first: int, last: int) -> None:
    for step in range(first, last + 1):
        tracker.record(step, point(step))


def assert_history(client: MlflowClient, run_id: str, last: int, keys=KEYS) -> None:
    """Every key has exactly one point per step 1..last, with the deterministic value."""
    for key in keys:
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        assert [m.step for m in history] == list(range(1, last + 1)), key
        assert [m.value for m in history] == pytest.approx([point(m.step)[key] for m in history])


def only_run(client: MlflowClient, experiment: str = "asrflow"):
    experiment_id = client.get_experiment_by_name(experiment).experiment_id
    runs = client.search_runs([experiment_id])
    assert len(runs) == 1
    return runs[0]


class Crash(BaseException):
    """Stands for the process dying (SIGKILL) at the point where it is raised."""


class CrashingLog(MetricLog):
    """A real metric log whose tracker 'dies' in a flush: after ``chunks_before_crash`` chunks were handed to
    MLflow (as the flush takes the next one), or before it claims the watermark (``crash_before_tag``)."""

    chunks_before_crash: int | None = None
    crash_before_tag = False

    def unsent(self, limit: int, through: int | None = None) -> list:
        chunk = super().unsent(limit, through)
        if chunk and self.chunks_before_crash is not None:
            if self.chunks_before_crash == 0:
                raise Crash
            self.chunks_before_crash -= 1
        return chunk

    def stored_through(self) -> int:
        if self.crash_before_tag:
            raise Crash
        return super().stored_through()


def crashing_tracker(uri: str, **options) -> tuple[MlflowRun, CrashingLog]:
    """A new run whose points wait in a :class:`CrashingLog`."""
    tracker = MlflowRun.start(tracking_uri=uri, **options)
    tracker.metrics = log = CrashingLog()
    return tracker, log


def land_async_writes(tracking_uri: str) -> None:
    """What was handed to MLflow's async queue before the death reaches the store (MLflow's own flush of the
    store that ``MLFLOW_TRACKING_URI`` names)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
        mlflow.flush_async_logging()


# --------------------------------------------------------------------------- store and URIs
def test_default_tracking_uri_and_env_override(monkeypatch, tmp_path):
    other = fresh_mlflow_store(tmp_path / "other")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert default_tracking_uri() == "sqlite:///mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", other)
    assert default_tracking_uri() == other
    tracker = MlflowRun.start(run_name="train")
    tracker.end()
    assert tracker.tracking_uri == other
    client = MlflowClient(tracking_uri=other)
    assert client.get_run(tracker.run_id).info.status == "FINISHED"


def test_default_store_in_cwd_with_artifacts_beside(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    work = tmp_path / "work"
    fresh_mlflow_store(work)
    monkeypatch.chdir(work)
    (work / "notes.txt").write_text("hello")
    tracker = MlflowRun.start(experiment="my exp", run_name="train")
    tracker.log_artifact("notes.txt", artifact_path="docs")
    tracker.end()

    assert tracker.tracking_uri == f"sqlite:///{work}/mlflow.db"
    assert (
        MlflowClient(tracking_uri=tracker.tracking_uri)
        .get_run(tracker.run_id)
        .info.artifact_uri.startswith((work / "mlartifacts").resolve().as_uri() + "/")
    )
    stored = work / "mlartifacts" / "my_exp" / tracker.run_id / "artifacts" / "docs" / "notes.txt"
    assert stored.read_text() == "hello"

    # Relative store URI opened from another directory still finds the artifacts.
    monkeypatch.chdir(tmp_path)
    client = MlflowClient(tracking_uri=f"sqlite:///{work}/mlflow.db")
    local = client.download_artifacts(tracker.run_id, "docs/notes.txt", str(tmp_path))
    assert Path(local).read_text() == "hello"


def test_relative_store_follows_cwd(monkeypatch, tmp_path):
    """MLflow caches stores by URI: a relative sqlite URI must not stick to the first cwd."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for name in ("a", "b"):
        fresh_mlflow_store(tmp_path / name)
        monkeypatch.chdir(tmp_path / name)
        tracker = MlflowRun.start(tracking_uri="sqlite:///mlflow.db")
        tracker.end()
        assert tracker.tracking_uri == f"sqlite:///{tmp_path / name / 'mlflow.db'}"
        client = MlflowClient(tracking_uri=tracker.tracking_uri)
        assert len(client.search_runs([tracker.experiment_id])) == 1


def test_artifact_location_for_uris(tmp_path):
    assert default_artifact_location(f"sqlite:///{tmp_path}/a/m.db", "asrflow") == (
        (tmp_path / "a" / "mlartifacts" / "asrflow").as_uri()
    )
    assert default_artifact_location("sqlite:///m.db", "x").startswith("file:///")
    assert default_artifact_location("http://127.0.0.1:5000", "x") is None
    assert default_artifact_location("sqlite:///:memory:", "x") is None
    assert resolve_tracking_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert resolve_tracking_uri(f"sqlite:///{tmp_path}/m.db") == f"sqlite:///{tmp_path}/m.db"


@pytest.mark.slow
def test_fresh_store_in_new_folder_quietly(tmp_path, capfd):
    """Creating a store (and its folder), truncating a param and flushing print nothing."""
    tracker = MlflowRun.start(tracking_uri=f"sqlite:///{tmp_path}/deep/er/mlflow.db", run_name="train")
    tracker.log_params({"long": "x" * 7000})
    record_steps(tracker, 1, 3)
    tracker.flush()
    tracker.end()
    captured = capfd.readouterr()
    assert captured.out == ""
    assert captured.err == ""
    assert (tmp_path / "deep" / "er" / "mlflow.db").is_file()


KILLED_WHILE_CREATING = """
import os, signal, sys
from sqlalchemy import event
from sqlalchemy.engine import Engine

uri, creator = sys.argv[1], sys.argv[2]
tables = 0

@event.listens_for(Engine, "after_cursor_execute")
def die_half_way(connection, cursor, statement, *rest):  # a kill (Slurm's time limit) in the middle of migrations
    global tables
    tables += statement.lstrip().upper().startswith("CREATE TABLE")
    if tables == 50:
        os.kill(os.getpid(), signal.SIGKILL)

if creator == "mlflow":
    from mlflow.tracking import MlflowClient
    MlflowClient(tracking_uri=uri).search_experiments()
else:
    from asrflow.tracking.store import create_whole_sqlite_store
    create_whole_sqlite_store(uri)
"""


@pytest.mark.slow
@pytest.mark.parametrize("creator", ["mlflow", "asrflow"])
def test_a_process_killed_while_creating_the_store_leaves_none_half_made(tmp_path, creator):
    """A new store's tables are made by about a hundred statements. Killed after half of them, MLflow (in place)
    leaves a store no later run can open, and asrflow says which file and what to do; asrflow's own creation
    leaves no store at all, and the next run creates it whole."""
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    child = subprocess.run(
        [sys.executable, "-c", KILLED_WHILE_CREATING, uri, creator],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    if creator == "mlflow":
        assert db.stat().st_size > 0
        with pytest.raises(AsrflowError, match=rf"cannot open the store {db} .*move {db} aside and run again"):
            MlflowRun.start(tracking_uri=uri)
        return
    assert not db.exists()
    tracker = MlflowRun.start(tracking_uri=uri, run_name="train")
    tracker.end()
    umask = os.umask(0)
    os.umask(umask)
    assert db.stat().st_mode & 0o777 == 0o666 & ~umask  # readable by others as MLflow's own store is (a shared UI)
    assert only_run(MlflowClient(tracking_uri=uri)).info.status == "FINISHED"
    assert [path.name for path in tmp_path.glob(".mlflow.db.*.building")] != []  # the killed one's, left as it was


def test_a_store_is_made_whole_on_a_filesystem_without_hard_links(tmp_path, monkeypatch):
    def no_hard_links(source, target):
        raise PermissionError(1, "Operation not permitted", str(source))

    monkeypatch.setattr(os, "link", no_hard_links)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    create_whole_sqlite_store(uri)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mlflow.db"]
    tracker = MlflowRun.start(tracking_uri=uri, run_name="train")
    tracker.end()
    assert only_run(MlflowClient(tracking_uri=uri)).info.status == "FINISHED"


@pytest.mark.slow
def test_a_new_store_is_made_in_a_child_process_that_the_run_waits_for(tmp_path):
    """The training starts a missing store's migrations in a child process (they would hold its GIL beside the
    training loop); the run's opening waits for that child and opens the store it made."""
    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    builder = build_store_in_background(uri)
    assert builder is not None and builder.pid != os.getpid()
    assert build_store_in_background(uri) is None  # already being made
    tracker = MlflowRun.start(tracking_uri=uri, run_name="train")
    assert builder.returncode == 0  # waited for, and it made the store
    tracker.end()
    assert only_run(MlflowClient(tracking_uri=uri)).info.status == "FINISHED"
    assert list(tmp_path.glob(".mlflow.db.*.building")) == []


def test_no_child_for_a_store_that_exists_or_a_server(tmp_path):
    assert build_store_in_background(fresh_mlflow_store(tmp_path)) is None
    assert build_store_in_background("http://127.0.0.1:9") is None


def test_a_child_that_fails_leaves_the_store_to_the_run(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setattr(sys, "executable", "false")  # a child that exits 1 before making anything
    builder = build_store_in_background(uri)
    monkeypatch.undo()
    tracker = MlflowRun.start(tracking_uri=uri, run_name="train")
    assert builder.returncode == 1
    tracker.end()
    assert only_run(MlflowClient(tracking_uri=uri)).info.status == "FINISHED"


# --------------------------------------------------------------------------- params and tags
def test_params_flattened_many_long_and_null(uri, client):
    params = {
        "seed": 7,
        "train": {"lr": 1e-3, "optim": {"betas": [0.9, 0.98]}, "resume": None, "amp": True},
        "tokenizer": {"vocab": "x" * 7000},
        "many": {f"k{i:03d}": i for i in range(150)},
    }
    tracker = MlflowRun.start(tracking_uri=uri, run_name="train")
    tracker.log_params(flatten(params))
    tracker.end()

    logged = client.get_run(tracker.run_id).data.params
    assert len(logged) == 156
    assert logged["seed"] == "7"
    assert logged["train.lr"] == "0.001"
    assert logged["train.optim.betas"] == "[0.9, 0.98]"
    assert logged["train.resume"] == "null"
    assert logged["train.amp"] == "true"
    assert logged["many.k149"] == "149"
    assert len(logged["tokenizer.vocab"]) == 6000
    assert logged["tokenizer.vocab"].endswith("[truncated]")
    assert client.get_run(tracker.run_id).data.tags["mlflow.runName"] == "train"


def test_log_params_again_same_ok_changed_is_clear_error(uri, client):
    tracker = MlflowRun.start(tracking_uri=uri)
    tracker.log_params({"a": 1, "b": "x"})
    tracker.log_params({"a": 1, "c": None})  # same value again + a new one: fine
    with pytest.raises(AsrflowError, match=r"'a'.*'1'.*'2'.*params cannot change"):
        tracker.log_params({"a": 2})
    tracker.end()
    assert client.get_run(tracker.run_id).data.params == {"a": "1", "b": "x", "c": "null"}


def test_param_value_rendering():
    assert param_value(None) == "null"
    assert param_value(False) == "false"
    assert param_value("text") == "text"
    assert param_value(Path("a/b")) == "a/b"
    assert len(param_value("y" * 10_000)) == 6000


def test_set_tags(uri, client):
    tracker = MlflowRun.start(tracking_uri=uri, tags={"stage": "train"})
    tracker.set_tags({f"t{i}": i for i in range(120)})
    tracker.end()
    tags = client.get_run(tracker.run_id).data.tags
    assert tags["stage"] == "train"
    assert tags["t119"] == "119"


# --------------------------------------------------------------------------- metrics
def test_record_is_buffered_until_flush(uri, client):
    tracker = MlflowRun.start(tracking_uri=uri)
    record_steps(tracker, 1, 5)
    assert len(tracker.metrics.pending) == 10
    assert client.get_metric_history(tracker.run_id, "train/loss") == []
    tracker.flush()
    assert len(tracker.metrics.pending) == 0
    assert tracker.metrics.logged_through == 5
    assert client.get_run(tracker.run_id).data.tags[LOGGED_THROUGH_TAG] == "5"
    tracker.end()
    assert_history(client, tracker.run_id, 5)


def test_flush_more_than_one_batch(uri, client):
    tracker = MlflowRun.start(tracking_uri=uri)
    record_steps(tracker, 1, 700)  # 1,400 points: two log_batch calls
    tracker.record(700, {"valid/wer": None})  # None values are skipped
    tracker.flush()
    tracker.end()
    assert_history(client, tracker.run_id, 700)
    assert client.get_metric_history(tracker.run_id, "valid/wer") == []


def test_flush_failed_half_way_can_be_called_again(uri, client):
    tracker, log = crashing_tracker(uri)
    tracker.max_metrics_per_batch = 4
    record_steps(tracker, 1, 10)
    log.chunks_before_crash = 2
    with pytest.raises(Crash):
        tracker.flush()
    log.chunks_before_crash = None
    assert len(log.pending) == 20 and len(log.unsent(100)) == 12  # 2 chunks of 4 sent, not yet confirmed
    log.crash_before_tag = True
    with pytest.raises(Crash):
        tracker.flush()
    assert len(log.pending) == 0
    log.crash_before_tag = False
    tracker.flush()  # nothing left to write, but the tag is still due
    assert client.get_run(tracker.run_id).data.tags[LOGGED_THROUGH_TAG] == "10"
    tracker.end()
    assert_history(client, tracker.run_id, 10)


def test_state_dict_is_plain_json(uri):
    tracker = MlflowRun.start(tracking_uri=uri)
    record_steps(tracker, 1, 3)
    state = tracker.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert state["run_id"] == tracker.run_id
    assert len(state["pending"]) == 6
    tracker.flush()
    assert len(state["pending"]) == 6  # the saved state is not changed by a later flush
    tracker.end()


def test_steps_must_not_be_negative(uri):
    tracker = MlflowRun.start(tracking_uri=uri)
    with pytest.raises(ValueError):
        tracker.record(-1, {"a": 1.0})
    tracker.end()


# --------------------------------------------------------------------------- crash and resume
def test_killed_after_checkpoint_flush_resumes_same_run(uri, client):
    """Steps 1..10, checkpoint, flush; 11..13 recorded, never flushed; resume from 10."""
    tracker = MlflowRun.start(tracking_uri=uri, run_name="train")
    tracker.log_params({"train.lr": 0.001})
    record_steps(tracker, 1, 10)
    checkpoint = json.loads(json.dumps(tracker.state_dict()))  # saved with the checkpoint
    tracker.flush()
    record_steps(tracker, 11, 13)
    del tracker  # SIGKILL: no flush, no end

    resumed = MlflowRun.start(tracking_uri=uri, run_id=checkpoint["run_id"], run_name="train")
    resumed.load_state_dict(checkpoint)
    record_steps(resumed, 11, 25)
    resumed.flush()
    resumed.end()

    run = only_run(client)
    assert run.info.run_id == checkpoint["run_id"]
    assert run.info.status == "FINISHED"
    assert run.data.params == {"train.lr": "0.001"}
    assert run.data.tags[LOGGED_THROUGH_TAG] == "25"
    assert_history(client, run.info.run_id, 25)


@pytest.mark.parametrize("crash", ["before_any_write", "after_some_chunks", "before_tag", "after_flush"])
def test_killed_during_flush_does_not_duplicate(uri, client, crash):
    """Checkpoint 20 saved (pending 11..20), then the process dies during/after the flush."""
    tracker, log = crashing_tracker(uri, run_name="train")
    tracker.max_metrics_per_batch = 3
    record_steps(tracker, 1, 10)
    tracker.state_dict()
    tracker.flush()
    record_steps(tracker, 11, 20)
    checkpoint = json.loads(json.dumps(tracker.state_dict()))
    if crash == "before_any_write":
        log.chunks_before_crash = 0
    elif crash == "after_some_chunks":
        log.chunks_before_crash = 4  # 12 of the 20 points are committed
    elif crash == "before_tag":
        log.crash_before_tag = True
    if crash == "after_flush":
        tracker.flush()
    else:
        with pytest.raises(Crash):
            tracker.flush()
        land_async_writes(tracker.tracking_uri)
    del tracker, log

    resumed = MlflowRun.start(tracking_uri=uri, run_id=checkpoint["run_id"])
    resumed.load_state_dict(checkpoint)
    assert resumed.metrics.logged_through == 20
    record_steps(resumed, 21, 30)
    resumed.end()

    run = only_run(client)
    assert run.data.tags[LOGGED_THROUGH_TAG] == "30"
    assert_history(client, run.info.run_id, 30)


def test_flushed_past_checkpoint_then_killed(uri, client):
    """The last attempt flushed beyond its last checkpoint; re-recorded points are dropped."""
    tracker = MlflowRun.start(tracking_uri=uri)
    record_steps(tracker, 1, 10)
    checkpoint = tracker.state_dict()
    tracker.flush()
    record_steps(tracker, 11, 15)
    tracker.flush()  # e.g. the end-of-training flush, then death before the final checkpoint
    tracker.record(15, {"valid/wer": 40.0})  # recorded after that flush: never stored
    del tracker

    resumed = MlflowRun.start(tracking_uri=uri, run_id=checkpoint["run_id"])
    resumed.load_state_dict(checkpoint)
    record_steps(resumed, 11, 20)
    resumed.record(15, {"valid/wer": 40.0})
    resumed.end()

    assert_history(client, checkpoint["run_id"], 20)
    assert [(m.step, m.value) for m in client.get_metric_history(checkpoint["run_id"], "valid/wer")] == [(15, 40.0)]


@pytest.mark.slow
@pytest.mark.parametrize("flushed_past_checkpoint", [False, True])
def test_rollback_in_the_same_process_logs_every_step_once(uri, client, flushed_past_checkpoint):
    """A rollback to checkpoint 10: the abandoned steps 11..13 are trained and recorded again."""
    tracker = MlflowRun.start(tracking_uri=uri)
    record_steps(tracker, 1, 10)
    checkpoint = tracker.state_dict()
    tracker.flush()
    record_steps(tracker, 11, 13)
    if flushed_past_checkpoint:  # e.g. a later checkpoint that is not the rollback target
        tracker.flush()
    assert tracker.discard_after(10) == (0 if flushed_past_checkpoint else 3 * len(point(1)))
    assert len(tracker.metrics.pending) == 0
    tracker.load_state_dict(checkpoint)
    record_steps(tracker, 11, 16)
    tracker.end()

    assert_history(client, checkpoint["run_id"], 16)


def test_resume_twice_from_same_checkpoint(uri, client):
    tracker = MlflowRun.start(tracking_uri=uri)
    record_steps(tracker, 1, 10)
    checkpoint = tracker.state_dict()
    del tracker  # died before the first flush
    for _ in range(2):
        resumed = MlflowRun.start(tracking_uri=uri, run_id=checkpoint["run_id"])
        resumed.load_state_dict(checkpoint)
        record_steps(resumed, 11, 12)
        del resumed  # died again before the next checkpoint
    resumed = MlflowRun.start(tracking_uri=uri, run_id=checkpoint["run_id"])
    resumed.load_state_dict(checkpoint)
    record_steps(resumed, 11, 14)
    resumed.end()
    only_run(client)
    assert_history(client, checkpoint["run_id"], 14)


CHILD = r"""
import json, os, signal, sys
import mlflow
from asrflow.tracking.metric_log import MetricLog
from asrflow.tracking.run import MlflowRun

uri, mode, ckpt = sys.argv[1:4]
mlflow.set_tracking_uri(uri)

class DyingLog(MetricLog):
    chunks_left = None
    def unsent(self, limit, through=None):
        chunk = super().unsent(limit, through)
        if chunk and self.chunks_left is not None:
            if self.chunks_left == 0:  # the chunks sent so far reach the store, then the process dies
                mlflow.flush_async_logging()
                os.kill(os.getpid(), signal.SIGKILL)
            self.chunks_left -= 1
        return chunk

def save(state):
    tmp = ckpt + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt)

def rec(t, a, b):
    for s in range(a, b + 1):
        t.record(s, {"train/loss": 10.0 / s, "train/lr": 1e-3 * s})

t = MlflowRun.start(tracking_uri=uri, run_name="train")
t.metrics = DyingLog()
t.log_params({"train.lr": 0.001})
rec(t, 1, 10); save(t.state_dict()); t.flush()
rec(t, 11, 20); save(t.state_dict())
if mode == "during_flush":
    t.max_metrics_per_batch = 4
    t.metrics.chunks_left = 2
t.flush()
rec(t, 21, 23)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["after_flush", "during_flush"])
def test_real_sigkill_then_resume(tmp_path, uri, client, mode):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    ckpt = tmp_path / "ckpt.json"
    child = subprocess.run(
        [sys.executable, str(script), uri, mode, str(ckpt)],
        env=child_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    checkpoint = json.loads(ckpt.read_text())
    assert checkpoint["recorded_through"] == 20
    stored = client.get_metric_history(checkpoint["run_id"], "train/loss")
    if mode == "during_flush":
        assert client.get_run(checkpoint["run_id"]).data.tags[LOGGED_THROUGH_TAG] == "10"
        assert 10 < len(stored) < 20  # killed half-way through writing 11..20

    resumed = MlflowRun.start(tracking_uri=uri, run_id=checkpoint["run_id"], run_name="train")
    resumed.load_state_dict(checkpoint)
    record_steps(resumed, 21, 30)
    resumed.end()

    run = only_run(client)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"train.lr": "0.001"}
    assert_history(client, run.info.run_id, 30)


def test_load_state_dict_from_other_run_is_refused(uri):
    first = MlflowRun.start(tracking_uri=uri)
    state = first.state_dict()
    first.end()
    second = MlflowRun.start(tracking_uri=uri)
    with pytest.raises(AsrflowError, match="belongs to MLflow run"):
        second.load_state_dict(state)
    with pytest.raises(AsrflowError, match="version"):
        second.load_state_dict({**state, "version": 99})
    second.end()


# --------------------------------------------------------------------------- status and reopening
def test_resumed_killed_run_is_running_again_and_can_fail(uri, client):
    tracker = MlflowRun.start(tracking_uri=uri)
    tracker.end("KILLED")
    assert client.get_run(tracker.run_id).info.status == "KILLED"
    resumed = MlflowRun.start(tracking_uri=uri, run_id=tracker.run_id)
    assert client.get_run(tracker.run_id).info.status == "RUNNING"
    resumed.end("FAILED")
    assert client.get_run(tracker.run_id).info.status == "FAILED"


def test_evaluate_reopens_finished_run_and_leaves_it_finished(tmp_path, uri, client):
    train = MlflowRun.start(tracking_uri=uri, run_name="train")
    record_steps(train, 1, 3)
    train.end()
    info = client.get_run(train.run_id).info
    assert info.status == "FINISHED"

    results = tmp_path / "eval"
    results.mkdir()
    (results / "metrics.json").write_text('{"wer": 12.5}')
    (results / "per_utt.txt").write_text("utt1 ok\n")
    evaluate = MlflowRun.start(tracking_uri=uri, run_id=train.run_id)
    assert client.get_run(train.run_id).info.status == "FINISHED"
    evaluate.log_metrics({"test/wer": 12.5, "test/cer": 4.0})
    evaluate.record(3, {"test/loss": 0.5})
    evaluate.log_artifact(results, artifact_path="eval")
    evaluate.set_tags({"asrflow.evaluated": "yes"})
    evaluate.end("FINISHED")

    run = only_run(client)
    assert run.info.status == "FINISHED"
    assert run.info.end_time == info.end_time
    assert run.data.metrics["test/wer"] == 12.5
    assert run.data.metrics["test/loss"] == 0.5
    assert_history(client, run.info.run_id, 3)
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id, "eval")) == [
        "eval/metrics.json",
        "eval/per_utt.txt",
    ]
    local = client.download_artifacts(run.info.run_id, "eval/metrics.json", str(tmp_path))
    assert json.loads(Path(local).read_text()) == {"wer": 12.5}

    failed = MlflowRun.start(tracking_uri=uri, run_id=train.run_id)
    failed.end("FAILED")
    run = client.get_run(train.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags[REOPENED_END_STATUS_TAG] == "FAILED"


def test_end_is_idempotent_and_checks_status(uri, client):
    tracker = MlflowRun.start(tracking_uri=uri)
    with pytest.raises(ValueError):
        tracker.end("DONE")
    record_steps(tracker, 1, 2)
    tracker.end("FINISHED")
    tracker.end("FAILED")
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert_history(client, tracker.run_id, 2)


# --------------------------------------------------------------------------- bad input
def test_missing_run_is_clear_error_or_replaced(uri, client):
    ghost = "0" * 32
    with pytest.raises(AsrflowError, match="not in the tracking store"):
        MlflowRun.start(tracking_uri=uri, run_id=ghost)
    tracker = MlflowRun.start(tracking_uri=uri, run_id=ghost, create_if_missing=True)
    assert tracker.run_id != ghost
    tracker.load_state_dict(
        {
            "version": 1,
            "run_id": ghost,
            "recorded_through": 1,
            "pending": [["train/loss", 1, 10.0, 1_700_000_000_000], ["train/lr", 1, 1e-3, 1_700_000_000_000]],
        }
    )
    tracker.end()
    assert client.get_run(tracker.run_id).data.tags["asrflow.replaces_run_id"] == ghost
    assert_history(client, tracker.run_id, 1)


def test_deleted_run_and_experiment_are_clear_errors(uri, client):
    tracker = MlflowRun.start(tracking_uri=uri, experiment="gone")
    tracker.end()
    client.delete_run(tracker.run_id)
    with pytest.raises(AsrflowError, match="is deleted"):
        MlflowRun.start(tracking_uri=uri, run_id=tracker.run_id)
    client.delete_experiment(tracker.experiment_id)
    with pytest.raises(AsrflowError, match="experiment 'gone' is deleted"):
        MlflowRun.start(tracking_uri=uri, experiment="gone")


def test_missing_artifact_is_clear_error(tmp_path, uri):
    tracker = MlflowRun.start(tracking_uri=uri)
    with pytest.raises(AsrflowError, match="no such file"):
        tracker.log_artifact(tmp_path / "nope.pt")
    tracker.end()


def test_artifact_store_unreachable_is_clear_error(tmp_path, uri, client):
    """An experiment made by `mlflow server` stores artifacts through it, not through SQLite."""
    client.create_experiment("served", artifact_location="mlflow-artifacts:/served")
    tracker = MlflowRun.start(tracking_uri=uri, experiment="served")
    (tmp_path / "model.pt").write_bytes(b"x")
    with pytest.raises(AsrflowError, match="MLFLOW_TRACKING_URI"):
        tracker.log_artifact(tmp_path / "model.pt")
    tracker.end()
