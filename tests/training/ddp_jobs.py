"""Launching tiny training jobs (torchrun with 2 gloo ranks, or one process) for the DDP tests.

Every job is an :class:`asrflow.testing.train_entry.TrainingProcess` in its own session; :func:`jobs`
kills whatever a test left running, so no test can hang or leave processes behind.
"""

from __future__ import annotations

import functools

import pytest

from asrflow.testing.train_entry import TrainingProcess

SEED = 42
JOB_TIMEOUT_S = 240.0

#: One training job of 2 ranks unless ``ranks=`` says otherwise; ``env`` adds fault variables.
Job = functools.partial(TrainingProcess, ranks=2, seed=SEED)


@pytest.fixture(name="jobs")
def jobs_fixture():
    """Start jobs through this; whatever is still running at the end of the test is killed."""
    started: list[TrainingProcess] = []

    def start(*args, **kwargs) -> TrainingProcess:
        job = Job(*args, **kwargs)
        started.append(job)
        return job

    yield start
    for job in started:
        if job.process.poll() is None:
            job.kill()
