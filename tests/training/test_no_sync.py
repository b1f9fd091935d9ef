"""DDP with ``accum_grad`` 2 all-reduces gradients once per optimizer step, not once per micro-batch.

Two real processes (gloo on the CPU, a file rendezvous in the test's folder) wrap the tiny
Conformer in ``DistributedDataParallel`` and register a communication hook that counts the
gradient buckets it all-reduces, then forwards each to DDP's default all-reduce. After a
warm-up step (DDP may rebuild its buckets after the first backward), every optimizer step
of ``train_step`` must all-reduce exactly one set of buckets: as many as a step with a
single micro-batch. Without ``no_sync`` on the first micro-batch it would be twice as many.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from asrflow.training.distributed import DistInfo
from asrflow.training.precision import resolve_precision
from asrflow.training.step import StepContext, train_step
from tests.support.step_batches import NUM_UTTERANCES, TOKENS, small_model, split_batch, utterances

WORLD_SIZE = 2
STEPS = 3


def _count_allreduces(rank: int, folder: str) -> None:
    """One rank: bucket all-reduces per optimizer step with 1 and with 2 micro-batches, to ``rank<r>.json``."""
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=WORLD_SIZE)
    torch.set_num_threads(1)
    model = DistributedDataParallel(small_model())
    calls = []

    def counting_hook(state, bucket):
        calls.append(1)
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)
    precision = resolve_precision("fp32", "cpu", None)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    info = DistInfo(world_size=WORLD_SIZE, rank=rank)
    batch = utterances()

    def per_step(accum_grad: int) -> list[int]:
        counts = []
        for _ in range(STEPS):
            before = len(calls)
            train_step(
                model,
                split_batch(batch, accum_grad),
                StepContext(
                    optimizer=optimizer,
                    scaler=precision.grad_scaler(),
                    precision=precision,
                    max_grad_norm=1e9,
                    dist=info,
                    device=torch.device("cpu"),
                ),
                step_tokens=NUM_UTTERANCES * TOKENS * WORLD_SIZE,
            )
            counts.append(len(calls) - before)
        return counts

    per_step(1)  # warm-up: DDP rebuilds its buckets after the first backward
    result = {"one_micro_batch": per_step(1), "two_micro_batches": per_step(2)}
    Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.slow
def test_accumulation_all_reduces_once_per_optimizer_step(tmp_path):
    mp.spawn(_count_allreduces, args=(str(tmp_path),), nprocs=WORLD_SIZE, join=True)
    for rank in range(WORLD_SIZE):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        buckets = result["one_micro_batch"][0]
        assert buckets >= 1
        assert result["one_micro_batch"] == [buckets] * STEPS
        assert result["two_micro_batches"] == [buckets] * STEPS, (
            f"rank {rank}: {result['two_micro_batches']} bucket all-reduces per step with 2 micro-batches, "
            f"expected {buckets} (one set of buckets: no_sync on the first micro-batch)"
        )
