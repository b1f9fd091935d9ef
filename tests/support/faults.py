"""Non-finite steps on demand, for tests: the loss of chosen optimizer steps is made NaN on chosen ranks.

The library has no test hook of its own for this; :class:`NonFiniteSteps` is an observer that, before
the data loader starts, wraps the run's train dataset so that the batches of those steps carry NaN
features (the forward pass, the CTC loss and every gradient are then NaN), as corrupt audio would.
"""

from __future__ import annotations

from collections.abc import Iterable

from asrflow.training.observers import ObservedRun, TrainObserver


class NaNBatches:
    """The real dataset; the batches of the steps ``targets`` (``(epoch, step in epoch)`` pairs) are NaN."""

    def __init__(self, dataset, targets: frozenset[tuple[int, int]]):
        self.dataset, self.targets = dataset, targets

    def __getitem__(self, item):
        batch = self.dataset[item]
        if (item.epoch, item.step_in_epoch) in self.targets:
            batch = {**batch, "features": batch["features"] * float("nan")}
        return batch

    def __len__(self) -> int:
        return len(self.dataset)


class NonFiniteSteps(TrainObserver):
    """Makes optimizer steps ``steps`` (counted from 1 over the whole run) non-finite on ``ranks`` (all ranks
    when empty): every time they are trained, after a rollback too."""

    def __init__(self, steps: Iterable[int], ranks: Iterable[int] = ()):
        self.steps, self.ranks = sorted(set(steps)), set(ranks)
        if any(step < 1 for step in self.steps):
            raise ValueError(f"non-finite steps must be >= 1: {self.steps}")

    def on_start(self, run: ObservedRun) -> None:
        if not self.steps or (self.ranks and run.dist.rank not in self.ranks):
            return
        targets = set()
        for step in self.steps:
            epoch, step_in_epoch = 0, step - 1
            while step_in_epoch >= run.data.steps_per_epoch(epoch):
                step_in_epoch -= run.data.steps_per_epoch(epoch)
                epoch += 1
            targets.add((epoch, step_in_epoch))
        run.data.dataset = NaNBatches(run.data.dataset, frozenset(targets))
