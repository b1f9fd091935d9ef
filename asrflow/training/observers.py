"""The one public way to watch or steer a training run from outside the trainer.

Pass observers to :class:`~asrflow.training.trainer.Trainer` (``observers=[...]``); each
method below is called, in list order, at the point named. Observers read the trainer's
public attributes (``counters``, ``position``, ``dist``, ``model``, ``data``, ...) and may
call ``trainer.request_stop()``; they must not change what a step computes (the exactness
of resume depends on it). Tests use them to pause, fail or stall a rank; benchmarks to time
steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asrflow.training.step import StepResult
    from asrflow.training.trainer import Trainer


class TrainObserver:
    """Does nothing at every point; subclass it and override the points you need."""

    def on_start(self, trainer: Trainer) -> None:
        """Set-up and the resume decision are done (components restored); the data loader and MLflow
        start next, then the first step."""

    def in_step(self, trainer: Trainer, step: int) -> None:
        """Inside optimizer step ``step``, after its backward passes, right before the stop flag is read
        and the step's all-reduce (a stop requested here makes this step the last)."""

    def after_step(self, trainer: Trainer, result: StepResult) -> None:
        """Step ``trainer.counters.global_step`` is recorded (metrics, guard); validation and checkpoint follow."""
