"""Shutting the data workers down: a worker that crashes while exiting does not fail the run."""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.util
import os
import signal

import torch

from asrflow.training.train_data import shut_down_workers


def _abort_at_exit(_worker_id: int) -> None:
    """Make this worker die by SIGABRT as it exits (as native code holding a live thread does at exit)."""
    faulthandler.disable()  # pytest's handler would catch the abort in the child
    multiprocessing.util.Finalize(None, os.abort, exitpriority=10)


def test_a_worker_that_aborts_while_exiting_does_not_raise():
    """DataLoader raises "worker killed by signal" from its SIGCHLD handler when the signal lands while it
    joins the workers (most of the time, not always): closing the loader (``TrainData.close``) must not fail
    the run either way."""
    loader = torch.utils.data.DataLoader(
        range(8), batch_size=2, num_workers=2, multiprocessing_context="fork", worker_init_fn=_abort_at_exit
    )
    before = set(multiprocessing.active_children())
    iterator = iter(loader)
    workers = [child for child in multiprocessing.active_children() if child not in before]
    assert len(workers) == 2
    assert next(iterator).tolist() == [0, 1]
    shut_down_workers(iterator)
    for worker in workers:
        worker.join(timeout=10)
        assert worker.exitcode == -signal.SIGABRT
