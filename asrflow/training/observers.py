"""The one public way to watch or steer a training run from outside the trainer.

Pass observers to :class:`~asrflow.training.trainer.Trainer` (``observers=[...]``); each
method below is called, in list order, at the point named, with the :class:`ObservedRun`:
what an observer may read, and its stop flag. Observers must not change what a step
computes (the exactness of resume depends on it); tests use them to pause, fail or stall a
rank, or to inject faults into its data, benchmarks to time steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from asrflow.training.distributed import DistInfo
    from asrflow.training.step import StepResult
    from asrflow.training.train_data import TrainData


class StopFlag:
    """Set once to make the step in flight the last; read right before each step's all-reduce."""

    def __init__(self) -> None:
        self.requested = False

    def request(self) -> None:
        self.requested = True


@dataclass(frozen=True, kw_only=True)
class ObservedRun:
    """What observers see of a run: this process's place in the job, its data (whose ``dataset`` a test may
    wrap before the loader starts), the gradient scaler and the stop flag."""

    dist: DistInfo
    data: TrainData
    scaler: torch.amp.GradScaler
    stop: StopFlag


class TrainObserver:
    """Does nothing at every point; subclass it and override the points you need."""

    def on_start(self, run: ObservedRun) -> None:
        """Set-up and the resume decision are done (components restored); the data loader and MLflow
        start next, then the first step."""

    def in_step(self, run: ObservedRun, step: int) -> None:
        """Inside optimizer step ``step``, after its backward passes, right before the stop flag is read
        and the step's all-reduce (a stop requested here makes this step the last)."""

    def after_step(self, run: ObservedRun, result: StepResult) -> None:
        """Step ``result.step`` is recorded (metrics, guard); validation and checkpoint follow."""
