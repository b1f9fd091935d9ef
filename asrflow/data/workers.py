"""What DataLoader workers run besides the dataset: kept in a light module, because a
spawned worker imports the module of each function it is given (not the trainer, MLflow...)."""

from __future__ import annotations

import signal

import torch


def pass_through(batch):
    """The collate function: the dataset already returns whole batches."""
    return batch


def init_worker(_worker_id: int) -> None:
    """Leave interruption to the main process (it finishes the step and saves); one thread each."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(1)
