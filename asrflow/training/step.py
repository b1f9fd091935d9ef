"""One optimizer step: forward/backward over the accumulated micro-batches, then the update.

Loss normalisation: the step's loss is the sum of per-utterance CTC losses (nats) over
every micro-batch on every rank, divided by the number of target tokens in all of them
(``step_tokens``, known to every rank from the plan, so no collective is needed). Each
rank backpropagates ``local_sum / step_tokens * world_size``; DDP's gradient averaging
divides by ``world_size`` again, so ``accum_grad`` micro-batches on ``w`` ranks give the
update of one process holding the ``accum_grad * w``-fold batch. DDP synchronises
gradients only on the last micro-batch (``no_sync`` on the others).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from asrflow.tokenizer import BLANK_ID
from asrflow.training.distributed import DistInfo, agree_on_step
from asrflow.training.precision import PrecisionPolicy


@dataclass
class StepResult:
    """What one optimizer step did. ``loss`` is per token (global), ``grad_norm`` before clipping."""

    loss: float
    grad_norm: float
    finite: bool
    stop: bool
    num_utterances: int
    audio_seconds: float
    padding_ratio: float


def ctc_loss_sum(log_probs: torch.Tensor, out_lens: torch.Tensor, batch: dict) -> torch.Tensor:
    """Sum over utterances of the CTC loss (nats); ``log_probs`` is (N, T', V)."""
    return F.ctc_loss(
        log_probs.transpose(0, 1).float(),  # (T', N, V)
        batch["targets"],
        out_lens,
        batch["target_lens"],
        blank=BLANK_ID,
        reduction="sum",
        zero_infinity=True,
    )


def train_step(
    model: nn.Module,
    micro_batches: list[dict],
    step_tokens: int,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    precision: PrecisionPolicy,
    max_grad_norm: float,
    dist: DistInfo,
    device: torch.device,
    inject_nonfinite: bool = False,
    stop_requested: bool = False,
) -> StepResult:
    """Accumulate gradients over ``micro_batches``, clip, and step unless anything is non-finite.

    Every rank reaches the same decisions (apply the step? stop after it?) through one
    all-reduce, which also sums the loss for logging.
    """
    optimizer.zero_grad(set_to_none=True)
    local_loss = 0.0
    scale = dist.world_size / max(step_tokens, 1)
    for index, batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        sync = contextlib.nullcontext() if last or not dist.enabled else model.no_sync()
        with sync:
            with precision.autocast():
                log_probs, out_lens = model(batch["features"].to(device), batch["feature_lens"].to(device))
            targets = {key: batch[key].to(device) for key in ("targets", "target_lens")}
            loss_sum = ctc_loss_sum(log_probs, out_lens, targets)
            if inject_nonfinite:
                loss_sum = loss_sum * float("nan")
            scaler.scale(loss_sum * scale).backward()
        local_loss += float(loss_sum.detach())
    scaler.unscale_(optimizer)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    finite, global_loss, stop = agree_on_step(dist, local_loss, grad_norm, stop_requested)
    if finite:
        scaler.step(optimizer)
    scaler.update()
    if not finite:
        optimizer.zero_grad(set_to_none=True)
    num_frames = sum(float(b["feature_lens"].sum()) for b in micro_batches)
    padded = sum(b["features"].shape[0] * b["features"].shape[1] for b in micro_batches)
    return StepResult(
        loss=global_loss / max(step_tokens, 1),
        grad_norm=grad_norm,
        finite=finite,
        stop=stop,
        num_utterances=sum(len(b["cut_ids"]) for b in micro_batches),
        audio_seconds=sum(float(b["durations"].sum()) for b in micro_batches),
        padding_ratio=1.0 - num_frames / max(padded, 1),
    )
