"""Resuming at step k builds nothing before k, and dropped trailing batches are logged.

Real Lhotse cuts (the prepared yesno train split: 9 planned batches per epoch at 30 s), the
real ``AsrBatchDataset`` behind a real ``DataLoader``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from asrflow.data.features.cmvn import CMVN_FILE, load_cmvn
from asrflow.data.loading.dataset import AsrBatchDataset
from asrflow.data.loading.planner import BatchItem, TrainingBatches, plan_epoch
from asrflow.data.loading.workers import pack_batch
from asrflow.data.manifests import load_cuts
from asrflow.tokenizer import MODEL_FILE, Tokenizer
from tests.support.tiny_config import tiny_settings

SEED = 42
MAX_DURATION_S = tiny_settings().train.data.max_duration_s
NUM_BUCKETS = tiny_settings().train.data.num_buckets


class _CountingDataset(AsrBatchDataset):
    """The real dataset, noting every item it is asked to build."""

    built: list[BatchItem]

    def __getitem__(self, item: BatchItem) -> dict:
        self.built.append(item)
        return super().__getitem__(item)


@pytest.fixture(scope="module")
def train_cuts(yesno_data):
    return load_cuts(yesno_data / "fbank", "train").to_eager()


def _batches(cuts, start_epoch: int, *, start_step: int, accum_grad: int = 1, world_size: int = 1, rank: int = 0):
    return TrainingBatches(
        cuts,
        seed=SEED,
        max_duration_s=MAX_DURATION_S,
        num_buckets=NUM_BUCKETS,
        accum_grad=accum_grad,
        world_size=world_size,
        rank=rank,
        start_epoch=start_epoch,
        start_step=start_step,
        num_epochs=2,
    )


@pytest.mark.parametrize("start_step", [0, 5, 8])
def test_resuming_at_step_k_builds_no_item_before_k(yesno_data, train_cuts, start_step):
    steps_per_epoch = len(plan_epoch(train_cuts, 0, seed=SEED, max_duration_s=MAX_DURATION_S, num_buckets=NUM_BUCKETS))
    assert steps_per_epoch == 9
    dataset = _CountingDataset(
        train_cuts, Tokenizer(yesno_data / "lang" / MODEL_FILE), load_cmvn(yesno_data / "fbank" / CMVN_FILE), seed=SEED
    )
    dataset.built = []
    batches = _batches(train_cuts, 0, start_step=start_step)
    loader = torch.utils.data.DataLoader(dataset, sampler=batches, batch_size=None, collate_fn=pack_batch)

    first = next(iter(loader))
    assert (first["item"].epoch, first["item"].step_in_epoch) == (0, start_step)
    assert dataset.built == [first["item"]], "the loader built an item before the resumed step"

    dataset.built = []
    served = [batch["item"] for batch in loader]
    assert dataset.built == served
    assert [(item.epoch, item.step_in_epoch) for item in served] == (
        [(0, step) for step in range(start_step, 9)] + [(1, step) for step in range(9)]
    )
    # The same batches an uninterrupted run trains from step k on (same plan positions).
    uninterrupted = [
        item for item in _batches(train_cuts, 0, start_step=0) if (item.epoch, item.step_in_epoch) >= (0, start_step)
    ]
    assert served == uninterrupted


def test_dropped_trailing_batches_are_logged_once_per_epoch_by_rank_0(train_cuts, caplog):
    """9 planned batches, 2 per step: 4 steps and 1 dropped batch per epoch."""
    with caplog.at_level(logging.INFO, logger="asrflow.data.loading.planner"):
        items = list(_batches(train_cuts, 0, start_step=0, accum_grad=2))
    assert len(items) == 2 * 4 * 2
    messages = [record.getMessage() for record in caplog.records if record.name == "asrflow.data.loading.planner"]
    assert messages == [
        f"epoch {epoch}: 1 of 9 planned batches dropped (they cannot fill a whole step of accum_grad 2 x 1 processes)"
        for epoch in (0, 1)
    ]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="asrflow.data.loading.planner"):
        list(_batches(train_cuts, 0, start_step=0, world_size=2, rank=1))
        assert not [record for record in caplog.records if record.name == "asrflow.data.loading.planner"]
        list(_batches(train_cuts, 1, start_step=0, world_size=2, rank=0))
    messages = [record.getMessage() for record in caplog.records if record.name == "asrflow.data.loading.planner"]
    assert messages == [
        "epoch 1: 1 of 9 planned batches dropped (they cannot fill a whole step of accum_grad 1 x 2 processes)"
    ]


def test_no_message_when_nothing_is_dropped(train_cuts, caplog):
    with caplog.at_level(logging.INFO, logger="asrflow.data.loading.planner"):
        assert len(list(_batches(train_cuts, 0, start_step=0))) == 18
    assert not [record for record in caplog.records if record.name == "asrflow.data.loading.planner"]
