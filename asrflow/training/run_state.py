"""Where a training run stands, as small components that save and restore themselves.

Each class here implements ``state_dict()`` / ``load_state_dict(state)`` and is registered
with the :class:`~asrflow.training.checkpoint_manager.CheckpointManager`; a checkpoint is
the dict of their states. Random generator states are kept as tensors, lists and numbers
only, so a checkpoint holding them loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch

from asrflow.data.loading.planner import BatchItem, TrainingBatches, plan_digest

logger = logging.getLogger(__name__)


@dataclass
class RunCounters:
    """The optimizer step count, the learning-rate scale left by rollbacks and the last dev loss."""

    global_step: int = 0
    lr_scale: float = 1.0
    last_dev_loss: float = math.nan
    last_dev_step: int = -1

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for spec in fields(self):
            setattr(self, spec.name, type(getattr(self, spec.name))(state[spec.name]))


@dataclass
class LossHistory:
    """Every step's training loss and gradient norm (for the loss plot); rolled back with the rest."""

    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)

    def append(self, step: int, loss: float, grad_norm: float) -> None:
        self.steps.append(step)
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)

    def state_dict(self) -> dict:
        return {"step": list(self.steps), "loss": list(self.losses), "grad_norm": list(self.grad_norms)}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.losses, self.grad_norms = (list(state[key]) for key in ("step", "loss", "grad_norm"))


class PlanPosition:
    """Where the data stands in the batch plan: epoch and optimizer step within it.

    Its state carries the digest of the epoch's plan and the number of processes; a
    restored position whose plan now means other batches (other cuts, another sampler,
    another world size) restarts its epoch from the first batch, with a warning.
    """

    def __init__(self, batches: TrainingBatches, world_size: int):
        self.batches = batches
        self.world_size = world_size
        self.epoch = 0
        self.step_in_epoch = 0

    def advance(self, item: BatchItem) -> None:
        """The step made of ``item`` (its first micro-batch) is done."""
        self.epoch, self.step_in_epoch = item.epoch, item.step_in_epoch + 1

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "plan_digest": plan_digest(self.batches.plan(self.epoch)),
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step_in_epoch = int(state["epoch"]), int(state["step_in_epoch"])
        if int(state["world_size"]) != self.world_size:
            reason = (
                f"the checkpoint was written with {state['world_size']} processes, this run has "
                f"{self.world_size}: the batch plan differs"
            )
        elif plan_digest(self.batches.plan(self.epoch)) != state["plan_digest"]:
            reason = (
                f"the batch plan of epoch {self.epoch} differs from the checkpoint's (other train cuts or "
                "another Lhotse sampler)"
            )
        else:
            return
        logger.warning(
            "%s, so epoch %d restarts from its first batch (optimizer, schedule and step count are kept)",
            reason,
            self.epoch,
        )
        self.step_in_epoch = 0


class RandomState:
    """Every random generator of the process (Python, NumPy, torch CPU and CUDA) as a component."""

    def state_dict(self) -> dict:
        return capture_rng_state()

    def load_state_dict(self, state: dict) -> None:
        restore_rng_state(state)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng_state() -> dict:
    """All generator states, in weights-only-loadable types."""
    version, internal, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=False)
    return {
        "python": {"version": version, "state": list(internal), "gauss": gauss},
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_state(state: dict) -> None:
    """Put every generator back where :func:`capture_rng_state` found it."""
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    numpy = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": numpy["bit_generator"],
            "state": {"key": numpy["key"].numpy().astype(np.uint32), "pos": numpy["pos"]},
            "has_gauss": numpy["has_gauss"],
            "gauss": numpy["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
