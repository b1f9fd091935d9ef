"""The exactly-once metric protocol without a store: a dict plays the store's part, the way the MLflow writer
does (chunks confirmed once committed, a watermark claimed after them, a resume that reconciles)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from asrflow.errors import AsrflowError
from asrflow.tracking.metric_log import MetricLog

REPO = Path(__file__).resolve().parents[1]
KEYS = ("train/loss", "train/lr")


class Died(BaseException):
    """The process dies where this is raised."""


class Store:
    """Committed points, counted per (metric, step), and the watermark tag."""

    def __init__(self) -> None:
        self.points: dict[tuple[str, int], int] = {}
        self.watermark = -1

    def flush(
        self,
        log: MetricLog,
        *,
        chunk: int = 3,
        chunks_before_death: int | None = None,
        die_before_tag=False,
        through: int | None = None,
    ) -> None:
        while points := log.unsent(chunk, through):
            if chunks_before_death is not None:
                if chunks_before_death == 0:
                    raise Died
                chunks_before_death -= 1
            log.mark_sent(points)
            for key, step, _, _ in points:
                self.points[(key, step)] = self.points.get((key, step), 0) + 1
            log.confirm(points)
        if (stored := log.stored_through()) > log.logged_through:
            if die_before_tag:
                raise Died
            self.watermark = log.logged_through = stored

    def resume(self, state: dict) -> MetricLog:
        """A new process: the checkpoint's state back, what the store holds dropped, the rest written."""
        log = MetricLog()
        log.load_state_dict(json.loads(json.dumps(state)))
        log.logged_through = self.watermark
        window = log.check_window()
        stored = {pair for pair in self.points if window and window[0] < pair[1] <= window[1]}
        log.reconcile(stored)
        self.flush(log, through=log.recorded_through)
        if log.logged_through < log.recorded_through:
            self.watermark = log.logged_through = log.recorded_through
        return log

    def assert_every_step_once(self, last: int) -> None:
        assert self.points == {(key, step): 1 for key in KEYS for step in range(1, last + 1)}


def record_steps(log: MetricLog, first: int, last: int) -> None:
    for step in range(first, last + 1):
        log.record(step, {"train/loss": 10.0 / step, "train/lr": 1e-3 * step})


def test_record_keeps_points_with_their_time_and_skips_none():
    log = MetricLog()
    log.record(1, {"train/loss": 2.0, "valid/wer": None}, timestamp_ms=1234)
    assert log.pending == [("train/loss", 1, 2.0, 1234)]
    with pytest.raises(ValueError):
        log.record(-1, {"a": 1.0})


def test_state_dict_is_plain_json_and_not_changed_by_a_later_flush():
    log = MetricLog()
    record_steps(log, 1, 3)
    state = log.state_dict()
    assert json.loads(json.dumps(state)) == state and len(state["pending"]) == 6
    Store().flush(log)
    assert len(state["pending"]) == 6 and log.pending == []
    with pytest.raises(AsrflowError, match="version"):
        MetricLog().load_state_dict({**state, "version": 99})


def test_killed_after_the_checkpoint_flush():
    store, log = Store(), MetricLog()
    record_steps(log, 1, 10)
    checkpoint = log.state_dict()
    store.flush(log)
    record_steps(log, 11, 13)  # then SIGKILL: never flushed
    resumed = store.resume(checkpoint)
    record_steps(resumed, 11, 25)
    store.flush(resumed)
    assert store.watermark == 25
    store.assert_every_step_once(25)


@pytest.mark.parametrize("death", ["before_any_write", "after_some_chunks", "before_tag", "after_flush"])
def test_killed_during_the_flush(death):
    store, log = Store(), MetricLog()
    record_steps(log, 1, 10)
    store.flush(log)
    record_steps(log, 11, 20)
    checkpoint = log.state_dict()
    options = {
        "before_any_write": {"chunks_before_death": 0},
        "after_some_chunks": {"chunks_before_death": 4},
        "before_tag": {"die_before_tag": True},
        "after_flush": {},
    }[death]
    with contextlib.suppress(Died):
        store.flush(log, **options)
    resumed = store.resume(checkpoint)
    assert resumed.logged_through == 20 and resumed.pending == []
    record_steps(resumed, 21, 30)
    store.flush(resumed)
    store.assert_every_step_once(30)


def test_flushed_past_the_checkpoint_then_killed():
    """A later checkpoint's flush went through, then the process died: the resume's copies are skipped."""
    store, log = Store(), MetricLog()
    record_steps(log, 1, 10)
    checkpoint = log.state_dict()
    store.flush(log)
    record_steps(log, 11, 14)
    store.flush(log)  # the checkpoint of step 14 is lost or corrupt
    resumed = store.resume(checkpoint)
    record_steps(resumed, 11, 14)
    assert resumed.pending == []
    store.flush(resumed)
    store.assert_every_step_once(14)


@pytest.mark.parametrize("flushed_past_checkpoint", [False, True])
def test_rollback_keeps_every_step_once(flushed_past_checkpoint):
    store, log = Store(), MetricLog()
    record_steps(log, 1, 5)
    checkpoint = log.state_dict()
    store.flush(log)
    record_steps(log, 6, 8)
    if flushed_past_checkpoint:
        store.flush(log)
    record_steps(log, 9, 9)  # non-finite: back to the checkpoint of step 5
    log.discard_after(5)
    log.load_state_dict(checkpoint)
    log.logged_through = store.watermark
    window = log.check_window()
    log.reconcile({pair for pair in store.points if window and window[0] < pair[1] <= window[1]})
    record_steps(log, 6, 12)
    store.flush(log)
    store.assert_every_step_once(12)


def test_resume_twice_from_the_same_checkpoint():
    store, log = Store(), MetricLog()
    record_steps(log, 1, 4)
    checkpoint = log.state_dict()
    for _ in range(2):
        resumed = store.resume(checkpoint)
        record_steps(resumed, 5, 6)
        store.flush(resumed)
    store.assert_every_step_once(6)


def test_failed_write_is_sent_again_and_the_watermark_never_claims_a_gap():
    log = MetricLog()
    record_steps(log, 1, 3)
    first, second = log.unsent(2), log.unsent(10)[2:]
    log.mark_sent(log.unsent(10))
    assert log.unsent(10) == []
    log.confirm(second)  # a later chunk committed, an earlier one failed
    log.unsend(first)
    assert log.stored_through() == 0
    assert log.unsent(10) == first
    log.confirm(first)
    assert log.stored_through() == 3 and log.pending == []


def test_final_metrics_at_the_watermark_step_are_written():
    store, log = Store(), MetricLog()
    record_steps(log, 1, 4)
    store.flush(log)
    log.record(4, {"train/final_best_dev_loss": 0.5})
    assert log.pending and log.check_window() is None
    store.flush(log)
    assert store.points[("train/final_best_dev_loss", 4)] == 1


def test_the_protocol_and_the_train_stage_import_no_mlflow():
    code = (
        "import sys, asrflow.tracking.metric_log, stages.train; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlflow'))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
