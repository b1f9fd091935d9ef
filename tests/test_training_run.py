"""The training's run (start_training_run): opened in a thread after the first point, so the first step
never waits for MLflow; against a real SQLite store."""

from __future__ import annotations

import time

import mlflow.utils.validation as limits
import pytest
from mlflow.tracking import MlflowClient

from asrflow.errors import AsrflowError
from asrflow.tracking import naming, run
from asrflow.tracking.run import LOGGED_THROUGH_TAG, MlflowRun, start_training_run

PARAMS = {"seed": 42, "train": {"lr": 0.003, "epochs": 2}}


def start(uri: str, run_id: str | None = None) -> MlflowRun:
    return start_training_run(PARAMS, {}, run_id=run_id, tracking_uri=uri, system_metrics=False)


def runs(uri: str) -> list:
    client = MlflowClient(tracking_uri=uri)
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def test_limits_agree_with_mlflow():
    assert run.MlflowRun.max_metrics_per_batch == limits.MAX_METRICS_PER_BATCH
    assert naming.MAX_PARAM_VAL_LENGTH == limits.MAX_PARAM_VAL_LENGTH
    assert run.MAX_TAG_VAL_LENGTH == limits.MAX_TAG_VAL_LENGTH


def test_nothing_opens_before_the_first_point_and_points_keep_their_time(uri):
    tracker = start(uri)
    tracker.set_tags({"precision": "fp32"})
    state = tracker.state_dict()
    assert state["run_id"] is None and state["pending"] == [] and state["run_key"]
    assert tracker.flush() is False and not tracker.wait_open(0)
    assert runs(uri) == []  # the store was not touched: the run opens after the first step
    before = int(time.time() * 1000)
    tracker.record(1, {"train/loss": 3.0})
    tracker.record(2, {"train/loss": 2.0})
    after = int(time.time() * 1000)
    state = tracker.state_dict()  # never waits: before the run is open it names the run's key
    assert state["run_id"] in (None, tracker.run_id) and state["run_key"] == tracker.run_key
    assert [(key, step) for key, step, _, _ in state["pending"]] == [("train/loss", 1), ("train/loss", 2)]
    assert all(before <= ts <= after for *_, ts in state["pending"])
    assert tracker.flush() is True
    tracker.end("FINISHED")
    (run,) = runs(uri)
    history = MlflowClient(tracking_uri=uri).get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 3.0), (2, 2.0)]
    assert [m.timestamp for m in history] == [ts for *_, ts in state["pending"]]
    assert run.data.params["train.lr"] == "0.003" and run.data.tags["precision"] == "fp32"
    assert run.data.tags[LOGGED_THROUGH_TAG] == "2" and run.info.status == "FINISHED"


def test_a_resume_from_the_step_0_checkpoint_opens_a_new_run_with_its_params(uri):
    crashed = start(uri)
    state = crashed.state_dict()  # the step-0 checkpoint, then the process dies before its first step
    resumed = start(uri, run_id=state["run_id"])
    resumed.load_state_dict(state)
    resumed.record(1, {"train/loss": 1.0})
    resumed.end("FINISHED")
    (run,) = runs(uri)
    assert run.data.params["train.epochs"] == "2"
    assert run.data.tags[LOGGED_THROUGH_TAG] == "1"


def test_a_resume_from_the_step_0_checkpoint_continues_the_run_its_process_opened(uri):
    crashed = start(uri)
    state = crashed.state_dict()  # the step-0 checkpoint: no run yet
    crashed.record(1, {"train/loss": 1.0})
    opened = crashed.run_id  # the run opened after step 1; then the process is killed
    resumed = start(uri, run_id=state["run_id"])
    resumed.load_state_dict(state)
    resumed.record(1, {"train/loss": 1.0})
    resumed.end("FINISHED")
    (run,) = runs(uri)  # one run: the resume found it by its key
    assert run.info.run_id == opened and run.info.status == "FINISHED"
    history = MlflowClient(tracking_uri=uri).get_metric_history(opened, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.0)]


def test_a_resumed_run_gets_only_the_points_it_lacks(uri):
    first = start(uri)
    for step in (1, 2, 3):
        first.record(step, {"train/loss": float(step)})
    checkpoint = first.state_dict()  # points 1..3 pending in the checkpoint
    first.flush()  # ... and written, then the process dies before its next checkpoint
    second = start(uri, run_id=checkpoint["run_id"])
    second.load_state_dict(checkpoint)
    for step in (4, 5):
        second.record(step, {"train/loss": float(step)})
    second.end("FINISHED")
    (run,) = runs(uri)
    history = MlflowClient(tracking_uri=uri).get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5]


def test_an_opening_error_is_raised_by_the_next_call_and_end_stays_quiet(uri):
    tracker = start(uri, run_id="0123456789abcdef0123456789abcdef")  # not in the store
    tracker.record(1, {"train/loss": 1.0})  # starts the opening
    assert tracker.wait_open(60)
    with pytest.raises(AsrflowError, match="is not in the tracking store"):
        tracker.state_dict()
    tracker.end("FAILED")  # the error was raised once; ending says nothing more
    assert runs(uri) == []


def test_rollback_discards_the_abandoned_points(uri):
    tracker = start(uri)
    tracker.record(1, {"train/loss": 1.0})
    checkpoint = tracker.state_dict()
    tracker.record(2, {"train/loss": float("nan")})
    assert tracker.discard_after(1) == 1
    tracker.load_state_dict(checkpoint)
    tracker.record(2, {"train/loss": 0.5})
    tracker.end("FINISHED")
    (run,) = runs(uri)
    history = MlflowClient(tracking_uri=uri).get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 1.0), (2, 0.5)]


def test_a_checkpoint_taken_before_the_run_opened_holds_its_points_and_key(uri):
    """Points recorded while the run opens travel in the checkpoint under the run's key; a resume from it
    continues that run and writes each point once."""
    first = start(uri)
    first.record(1, {"train/loss": 1.0})
    state = first.state_dict()  # maybe before the run is open: no run id, the key
    opened = first.run_id
    first.record(2, {"train/loss": 2.0})  # then killed: nothing flushed
    resumed = start(uri, run_id=state["run_id"])
    resumed.load_state_dict(state)
    resumed.record(2, {"train/loss": 2.0})
    resumed.end("FINISHED")
    (only,) = runs(uri)
    assert only.info.run_id == opened
    history = MlflowClient(tracking_uri=uri).get_metric_history(opened, "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 2.0)]
