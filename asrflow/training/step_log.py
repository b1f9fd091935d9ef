"""What each optimizer step reports: MLflow points, the loss history and a log line now and then."""

from __future__ import annotations

import logging
import math

from asrflow.training.progress import LossHistory
from asrflow.training.step import StepResult

logger = logging.getLogger(__name__)

#: With fp16, a warning is logged when the gradient scaler's scale falls below this.
LOSS_SCALE_FLOOR = 1.0
#: A log line every this many steps (and after the first).
LOG_EVERY_STEPS = 10


def step_metrics(result: StepResult, *, lr: float, epoch: int, world_size: int, skipped_total: int) -> dict[str, float]:
    """The per-step metrics (``train/...``): loss per token, lr, grad norm, throughput in audio seconds per
    wall second (all ranks), padding and the share of the step spent waiting for data."""
    return {
        "train/loss": result.loss,
        "train/lr": lr,
        "train/grad_norm": result.grad_norm,
        "train/audio_s_per_s": result.audio_seconds * world_size / max(result.elapsed_s, 1e-9),
        "train/padding_ratio": result.padding_ratio,
        "train/data_wait_fraction": result.data_wait_s / max(result.elapsed_s, 1e-9),
        "train/nonfinite_skipped": skipped_total,
        "train/epoch": epoch,
    }


def report_step(
    tracker, history: LossHistory, *, step: int, metrics: dict[str, float], loss_scale: float | None
) -> None:
    """Buffer the step's finite metrics in ``tracker``, extend ``history``, log a line every few steps."""
    if loss_scale is not None:
        metrics = {**metrics, "train/loss_scale": loss_scale}
        if loss_scale < LOSS_SCALE_FLOOR:
            logger.warning(
                "fp16 loss scale collapsed to %g (< %g): consider bf16 or fp32", loss_scale, LOSS_SCALE_FLOOR
            )
    history.append(step, metrics["train/loss"], metrics["train/grad_norm"])
    tracker.record(step, {key: value for key, value in metrics.items() if math.isfinite(value)})
    if step % LOG_EVERY_STEPS == 0 or step == 1:
        logger.info(
            "step %d epoch %d: loss %.4f lr %.2e grad norm %.3f, %.1f audio s/s, padding %.1f%%, data wait %.1f%%",
            step,
            metrics["train/epoch"],
            metrics["train/loss"],
            metrics["train/lr"],
            metrics["train/grad_norm"],
            metrics["train/audio_s_per_s"],
            100 * metrics["train/padding_ratio"],
            100 * metrics["train/data_wait_fraction"],
        )
