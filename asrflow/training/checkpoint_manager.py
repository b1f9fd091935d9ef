"""Checkpoint policy: when to save, which is best, what is kept, what a rollback returns to,
whether a run resumes, and how every rank comes to the same answer.

Components register under a name and implement ``state_dict()`` / ``load_state_dict()``;
a checkpoint is the dict of their states plus the run's facts (resume fingerprint, train
params, precision, finished or not). Files, atomic writes and digests are
:mod:`asrflow.training.checkpoint`'s business.

Every decision that leads to a collective (the barrier after a save) is the same on every
rank by construction: a save is due from the step count (every rank runs the same steps),
the stop flag and the non-finite streak (both agreed by the step's all-reduce) and
``improved``, which rank 0 decides and broadcasts. Only rank 0 reads or writes the folder;
the other ranks load the file rank 0 names.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from asrflow.errors import AsrflowError
from asrflow.params import check_at_least
from asrflow.training import checkpoint as ckpt
from asrflow.training.distributed import DistInfo, barrier, broadcast_from_main
from asrflow.training.resume import FRESH, RESUME, decide

logger = logging.getLogger(__name__)

SECTION = "train.checkpoint"


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """params.yaml's ``train.checkpoint`` section (each key is documented there): bookkeeping, which never
    changes what the steps compute."""

    checkpoint_every_steps: int
    keep_last: int
    validate_every_steps: int

    def __post_init__(self) -> None:
        check_at_least(self, SECTION, 1, "checkpoint_every_steps", "keep_last")
        check_at_least(self, SECTION, 0, "validate_every_steps")


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class CheckpointManager:
    """Owns ``directory``: interval, best, keep-last, the rollback target and the resume decision.

    Args:
        directory: the checkpoint folder (kept across runs).
        every_steps: a periodic checkpoint every this many optimizer steps.
        keep_last: step checkpoints kept (plus ``best.pt`` and the rollback target).
        dist: this process's place in the job.
        facts: values written into every checkpoint as they are (fingerprint, train params, precision).
    """

    def __init__(self, directory: Path, *, every_steps: int, keep_last: int, dist: DistInfo, facts: dict):
        self.directory = Path(directory)
        self.every_steps = every_steps
        self.keep_last = keep_last
        self.dist = dist
        self.facts = facts
        self.components: dict[str, Stateful] = {"checkpointing": self}
        #: Lowest dev loss among saved checkpoints (identical on every rank).
        self.best_dev_loss = math.inf
        #: Step of the newest checkpoint taken outside a streak of non-finite steps: the rollback target.
        self.good_step = 0

    @classmethod
    def for_run(cls, config: CheckpointConfig, directory: Path, *, dist: DistInfo, facts: dict) -> CheckpointManager:
        """The manager ``config`` asks for."""
        return cls(
            directory, every_steps=config.checkpoint_every_steps, keep_last=config.keep_last, dist=dist, facts=facts
        )

    def register(self, **components: Stateful) -> None:
        """Components whose states make up every checkpoint from now on."""
        self.components.update(components)

    # ------------------------------------------------------------ its own state
    def state_dict(self) -> dict:
        return {"best_dev_loss": self.best_dev_loss, "good_step": self.good_step}

    def load_state_dict(self, state: dict) -> None:
        self.best_dev_loss = float(state["best_dev_loss"])
        self.good_step = int(state["good_step"])

    # ------------------------------------------------------------ decisions
    def improved(self, dev_loss: float) -> bool:
        """Whether ``dev_loss`` beats the best checkpoint's: rank 0 decides, every rank gets its answer."""
        return bool(broadcast_from_main(self.dist, dev_loss < self.best_dev_loss))

    def save(
        self,
        step: int,
        *,
        dev_loss: float | None = None,
        in_streak: bool = False,
        stop: bool = False,
        final: bool = False,
    ) -> bool:
        """Checkpoint step ``step`` when one is due (rank 0 writes, every rank waits at a barrier); returns
        whether it saved.

        Due at step 0 (a rollback target), on a ``stop`` and at the end (``final``, marked complete);
        otherwise for a new best ``dev_loss`` (this step's, when it improved on the best: ``best.pt``
        follows) or at the interval, never inside a non-finite streak, so the newest checkpoint stays a
        good rollback target.
        """
        periodic = dev_loss is not None or step % self.every_steps == 0
        if not (step == 0 or stop or final or (periodic and not in_streak)):
            return False
        if not in_streak:
            self.good_step = step
        if dev_loss is not None:
            self.best_dev_loss = dev_loss
        if self.dist.is_main:
            state = {name: component.state_dict() for name, component in self.components.items()}
            path = ckpt.save_checkpoint(
                {**state, **self.facts, "complete": final},
                self.directory,
                step,
                keep_last=self.keep_last,
                is_best=dev_loss is not None,
                protect=self.good_step,
            )
            logger.info("saved checkpoint %s", path)
        barrier(self.dist)
        return True

    # ------------------------------------------------------------ reading
    def restore(self, state: dict) -> None:
        """Put every registered component back as ``state`` recorded it."""
        for name, component in self.components.items():
            component.load_state_dict(state[name])

    def resume(self, fingerprint: dict, train_params: dict) -> tuple[str, dict | None, Path | None]:
        """Rank 0 reads the newest checkpoint and decides (see :mod:`asrflow.training.resume`); every rank
        gets ``(decision, state, path)``. A fresh start deletes a finished run's checkpoints first."""
        found, verdict = None, None
        if self.dist.is_main:
            found = ckpt.load_latest(self.directory)
            try:
                verdict = (decide(found[0] if found else None, fingerprint, train_params, self.directory), None)
            except AsrflowError as error:
                verdict = (None, str(error))
        decision, error = broadcast_from_main(self.dist, verdict)
        if error:
            raise AsrflowError(error)
        if decision == RESUME:
            return (decision, *self._shared(found))
        if found is not None and self.dist.is_main:
            ckpt.remove_checkpoints(self.directory)
        barrier(self.dist)
        return FRESH, None, None

    def rollback_target(self) -> tuple[dict, Path]:
        """The newest readable checkpoint taken outside a non-finite streak, on every rank."""
        found = self._shared(self._good_checkpoint() if self.dist.is_main else None)
        if found[0] is None:
            raise AsrflowError("non-finite steps and no checkpoint to roll back to")
        return found

    def late_checkpoints(self, global_step: int, count: int) -> list[Path]:
        """The newest ``count`` checkpoints from the second half of training (early weights would hurt an average)."""
        late = [path for path in ckpt.list_checkpoints(self.directory) if ckpt.step_of(path) * 2 >= global_step]
        return late[: max(count, 1)]

    def _good_checkpoint(self) -> tuple[dict, Path] | None:
        target = ckpt.checkpoint_path(self.directory, self.good_step)
        for path in [target, *(path for path in ckpt.list_checkpoints(self.directory) if path != target)]:
            try:
                state = ckpt.load_checkpoint(path)
            except Exception as error:  # missing, truncated or corrupt: try the next one
                logger.warning("cannot roll back to %s (%s); trying an older checkpoint", path, error)
                continue
            if int(state["guard"].get("consecutive", 0)) == 0:
                return state, path
        return None

    def _shared(self, found: tuple[dict, Path] | None) -> tuple[dict | None, Path | None]:
        """Rank 0's checkpoint on every rank: the others load the file rank 0 named (a broadcast)."""
        path = broadcast_from_main(self.dist, str(found[1]) if found else None)
        if path is None:
            return None, None
        if self.dist.is_main:
            return found
        return ckpt.load_checkpoint(path), Path(path)
