"""Exact resume: a run killed (SIGKILL) or stopped (SIGTERM) and resumed ends bit-identical.

Every run is a real training process (``tests.support.train_entry``) on the prepared yesno data, with
two data workers forked from a forkserver (the default), SpecAugment and dropout on. The reference run trains 3 epochs
(9 steps each) without interruption; the others are interrupted and resumed by running the
same command again, and must end with every tensor ``torch.equal`` to the reference and
the same per-step loss series, float for float.
"""

from __future__ import annotations

import signal

import pytest

from asrflow.training.checkpoint import list_checkpoints, load_checkpoint, step_of
from asrflow.training.outcome import Outcome, exit_code
from tests.support.exact_resume import OVERRIDES, assert_identical, final_state, resumed_from
from tests.support.mlflow_store import fresh_mlflow_store
from tests.support.train_entry import TrainingProcess, run_training


@pytest.fixture(scope="module")
def reference(yesno_data, tmp_path_factory) -> dict:
    """The uninterrupted run."""
    exp = tmp_path_factory.mktemp("reference") / "exp"
    uri = fresh_mlflow_store(exp.parent)
    run_training(yesno_data, exp, OVERRIDES, log_path=exp.parent / "train.log", tracking_uri=uri)
    state = final_state(exp)
    progress, position = state["checkpoint"]["counters"], state["checkpoint"]["position"]
    assert progress["global_step"] == 27 and position["epoch"] == 2, "expected 3 epochs of 9 steps"
    return state


@pytest.mark.slow
def test_sigkill_twice_then_resume_is_bit_identical(yesno_data, tmp_path, reference):
    exp = tmp_path / "exp"
    uri = fresh_mlflow_store(tmp_path)
    checkpoints = exp / "checkpoints"
    # Step 5: the middle of epoch 0 (last checkpoint: step 4). Step 19: the first step of
    # epoch 2 (last checkpoint: step 18, the end of epoch 1, with its data workers'
    # prefetched batches in flight).
    resumed_at = []
    for attempt, kill_after in enumerate((5, 19)):
        process = TrainingProcess(
            yesno_data,
            exp,
            OVERRIDES,
            log_path=tmp_path / f"attempt{attempt}.log",
            pause_after_step=kill_after,
            tracking_uri=uri,
        )
        process.wait_paused()
        process.kill()
        assert process.process.returncode == -signal.SIGKILL
        done = [step for step, *_ in process.steps()]
        assert done[-1] == kill_after
        assert step_of(list_checkpoints(checkpoints)[0]) == kill_after - 1, "the killed step must be lost"
        if attempt:
            resumed_at.append(resumed_from(process.log()))
    log = run_training(yesno_data, exp, OVERRIDES, log_path=tmp_path / "final.log", tracking_uri=uri)
    resumed_at.append(resumed_from(log))
    assert resumed_at == [4, 18]
    assert_identical(final_state(exp), reference)
    assert not list(checkpoints.glob(".*tmp")), "temporary checkpoint files left behind"


@pytest.mark.slow
def test_sigterm_finishes_the_step_saves_and_resumes_identically(yesno_data, tmp_path, reference):
    exp = tmp_path / "exp"
    uri = fresh_mlflow_store(tmp_path)
    process = TrainingProcess(
        yesno_data, exp, OVERRIDES, log_path=tmp_path / "first.log", pause_in_step=13, tracking_uri=uri
    )
    process.wait_paused()
    process.signal(signal.SIGTERM)  # to the trainer and its data workers, as a scheduler would
    assert process.wait() == exit_code(Outcome.STOPPED), process.log()
    log = process.log()
    assert "received SIGTERM" in log
    # The signal came during step 13 (held just before the step's stop decision): that step
    # is the last one. It is finished, saved and the trainer exits; step 14 never starts.
    # 13 is off the every-2-steps schedule: the signal made this checkpoint.
    assert [step for step, *_ in process.steps()][-1] == 13
    newest = list_checkpoints(exp / "checkpoints")[0]
    assert step_of(newest) == 13
    state = load_checkpoint(newest)
    assert state["counters"]["global_step"] == 13 and not state["complete"]
    assert state["history"]["step"] == list(range(1, 14))
    assert state["history"]["loss"] == reference["checkpoint"]["history"]["loss"][:13]
    assert not (exp / "model.pt").exists()

    log = run_training(yesno_data, exp, OVERRIDES, log_path=tmp_path / "resume.log", tracking_uri=uri)
    assert resumed_from(log) == 13
    assert_identical(final_state(exp), reference)


@pytest.mark.slow
def test_a_relative_position_model_resumes_bit_identical(yesno_data, tmp_path):
    """``train.model.attention: rel_pos`` (its own attention parameters, biases and position projection):
    killed mid-epoch and resumed, it ends as the uninterrupted run does."""
    overrides = {**OVERRIDES, "train.model.attention": "rel_pos", "train.optim.epochs": 1}
    uri = fresh_mlflow_store(tmp_path)
    run_training(yesno_data, tmp_path / "reference", overrides, log_path=tmp_path / "ref.log", tracking_uri=uri)
    exp = tmp_path / "exp"
    process = TrainingProcess(
        yesno_data, exp, overrides, log_path=tmp_path / "killed.log", pause_after_step=5, tracking_uri=uri
    )
    process.wait_paused()
    process.kill()
    log = run_training(yesno_data, exp, overrides, log_path=tmp_path / "final.log", tracking_uri=uri)
    assert resumed_from(log) == 4
    assert_identical(final_state(exp), final_state(tmp_path / "reference"))
