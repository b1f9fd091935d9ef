"""Validation: the per-token CTC loss on the dev split, without augmentation, and when to measure it."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from lhotse import CutSet
from torch import nn

from asrflow.data.loading.dataset import AsrBatchDataset
from asrflow.data.loading.planner import FRAME_SHIFT_S, BatchItem, padded_seconds
from asrflow.data.manifests import pack_by_duration
from asrflow.training.distributed import DistInfo, all_reduce_sum
from asrflow.training.precision import PrecisionPolicy
from asrflow.training.step import ctc_loss_sum

logger = logging.getLogger(__name__)


def dev_batches(
    cuts: CutSet, max_duration_s: float, pad_frames_to: int = 1, frame_shift_s: float = FRAME_SHIFT_S
) -> list[tuple[str, ...]]:
    """Dev cut ids sorted by duration, grouped into batches of at most ``max_duration_s`` seconds, each cut
    counted at its length once the frame axis is padded to ``pad_frames_to`` frames (:func:`padded_seconds`)."""
    ordered = sorted(cuts, key=lambda c: (c.duration, c.id))

    def seconds(cut) -> float:
        return float(padded_seconds(cut.duration, pad_frames_to=pad_frames_to, frame_shift_s=frame_shift_s))

    return [tuple(cut.id for cut in batch) for batch in pack_by_duration(ordered, seconds, max_duration_s)]


@torch.no_grad()
def dev_loss(
    model: nn.Module,
    dataset: AsrBatchDataset,
    batches: list[tuple[str, ...]],
    *,
    precision: PrecisionPolicy,
    dist: DistInfo,
    device: torch.device,
    beat: Callable[[], None] = lambda: None,
) -> float:
    """Per-token dev loss (nats per target token); ranks share the batches and sum their totals (one all-reduce).

    ``beat`` is called after every dev batch (the stall watchdog's heartbeat), so a long
    dev pass is not taken for a hang.
    """
    was_training = model.training
    model.eval()
    loss, tokens = 0.0, 0.0
    for index in range(dist.rank, len(batches), dist.world_size):
        batch = dataset[
            BatchItem(
                epoch=0,
                step_in_epoch=0,
                micro_index=0,
                batch_index=index,
                cut_ids=batches[index],
                step_cut_ids=batches[index],
            )
        ]
        with precision.autocast():
            log_probs, out_lens = model(batch["features"].to(device), batch["feature_lens"].to(device))
        targets = {key: batch[key].to(device) for key in ("targets", "target_lens")}
        loss += float(ctc_loss_sum(log_probs, out_lens, targets))
        tokens += float(batch["target_lens"].sum())
        beat()
    loss, tokens = all_reduce_sum(dist, [loss, tokens])
    model.train(was_training)
    return loss / max(tokens, 1.0)


class Validator:
    """Measures the dev loss every ``every_steps`` optimizer steps (0: never; never without dev data).

    ``measure(model, beat)`` is the dev loss of ``model`` on every rank (one all-reduce); ``beat`` is
    the stall watchdog's heartbeat, called after every dev batch.
    """

    def __init__(self, every_steps: int, measure: Callable[..., float] | None):
        self.every_steps = every_steps
        self.measure = measure

    def due(self, step: int) -> bool:
        return self.measure is not None and bool(self.every_steps) and step % self.every_steps == 0

    def maybe_validate(self, step: int, model: nn.Module, beat: Callable[[], None]) -> float | None:
        """The dev loss of ``model`` after optimizer step ``step`` when a validation is due, else None."""
        if not self.due(step):
            return None
        loss = self.measure(model, beat=beat)
        beat()
        logger.info("step %d: dev loss %.4f", step, loss)
        return loss
