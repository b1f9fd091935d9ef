"""Process-group set-up for torchrun / DDP, and the few collectives the loop needs."""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from asrflow.errors import AsrflowError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: ``world_size`` processes, this one is ``rank``."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(timeout_s: float) -> DistInfo:
    """Join the process group torchrun set up (env ``WORLD_SIZE``/``RANK``), or run alone.

    The backend is NCCL on GPUs and gloo on the CPU; ``timeout_s`` bounds every collective.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    logger.info("rank %d of %d joined the %s process group", rank, world_size, backend)
    return DistInfo(world_size, rank, local_rank)


def data_parallel(model: torch.nn.Module, info: DistInfo, device: torch.device) -> torch.nn.Module:
    """``model`` in DistributedDataParallel when the job has several processes, else ``model`` itself."""
    if not info.enabled:
        return model
    return DistributedDataParallel(model, device_ids=[info.local_rank] if device.type == "cuda" else None)


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def agree_on_step(
    info: DistInfo, local_loss: float, grad_norm: float, stop_requested: bool
) -> tuple[bool, float, bool]:
    """One all-reduce per step: (finite on every rank, loss summed over ranks, any rank asked to stop)."""
    local_bad = 0.0 if bool(torch.isfinite(torch.tensor([local_loss, grad_norm])).all()) else 1.0
    if not info.enabled:
        return local_bad == 0.0, local_loss, stop_requested
    tensor = torch.tensor([local_bad, local_loss, float(stop_requested)], dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor[0].item() == 0.0, tensor[1].item(), tensor[2].item() > 0


def all_reduce_sum(info: DistInfo, values: list[float]) -> list[float]:
    """Sum a few floats over ranks (for logging and dev loss)."""
    if not info.enabled:
        return values
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor)
    return tensor.tolist()


def broadcast_from_main(info: DistInfo, value):
    """Rank 0's ``value`` on every rank (any picklable object); alone, ``value`` itself."""
    if not info.enabled:
        return value
    holder = [value if info.is_main else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def check_same_everywhere(info: DistInfo, value: str, what: str) -> None:
    """Raise the same :class:`AsrflowError` on every rank when ranks hold different ``value``s (e.g. the
    digest of their params: nodes started with other params.yaml files or data)."""
    if not info.enabled:
        return
    values: list[str | None] = [None] * info.world_size
    dist.all_gather_object(values, value)
    others = [rank for rank, seen in enumerate(values) if seen != values[0]]
    if others:
        raise AsrflowError(
            f"rank(s) {others} run with other {what} than rank 0: every node must use the same params.yaml, "
            "code and data (a shared checkout, or the same commit and `dvc pull`)"
        )
