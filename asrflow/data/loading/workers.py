"""What DataLoader workers run besides the dataset: kept in a light module, because a
spawned worker imports the module of each function it is given (not the trainer, MLflow...)."""

from __future__ import annotations

import signal

import torch

from asrflow.allocator import tune_malloc
from asrflow.process_lifetime import die_with_parent

#: Small per-utterance tensors of a batch, sent from a data worker as Python lists. Each
#: tensor crosses the process boundary through its own shared-memory handle (a file descriptor
#: passed and mapped on each side), a fixed cost that dwarfs a few bytes of data, while a short
#: list travels inside the batch's pickle (bench/RESULTS.md#data-wait).
#: ``features`` stays a tensor: it is large, so shared memory saves the copy.
SMALL_TENSORS = ("feature_lens", "targets", "target_lens", "durations")


def pack_batch(batch: dict) -> dict:
    """The collate function, run in the worker: the dataset already returns whole batches;
    its small tensors become ``(values, dtype)`` pairs for a cheap hand-over (exact values)."""
    packed = dict(batch)
    for key in SMALL_TENSORS:
        if isinstance(packed.get(key), torch.Tensor):
            packed[key] = (packed[key].tolist(), packed[key].dtype)
    return packed


def unpack_batch(batch: dict) -> dict:
    """Undo :func:`pack_batch` in the training process: the same tensors, dtypes and values."""
    unpacked = dict(batch)
    for key in SMALL_TENSORS:
        if isinstance(unpacked.get(key), tuple):
            values, dtype = unpacked[key]
            unpacked[key] = torch.tensor(values, dtype=dtype)
    return unpacked


def init_worker(_worker_id: int) -> None:
    """Leave interruption to the main process (it finishes the step and saves); one thread each.

    A worker ignores SIGINT and SIGTERM (sent to the whole process group by Ctrl-C or a
    scheduler, they must not kill it under a step that is finishing), so it is also told to
    die with its parent: a training process that ends in any way, ``SIGKILL`` included,
    leaves no worker behind.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()
    tune_malloc()
    torch.set_num_threads(1)
