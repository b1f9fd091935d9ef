"""What a running training reports about itself: each step's metrics and log line, and the stall
watchdog, which dumps every thread's stack and ends the process when no step finishes in time.

Under torchrun every rank writes to the same stderr, and two ranks that stall together
would interleave their dumps mid-line. So the dump goes to a temporary file first and is
then written to stderr one line per ``write``, each line prefixed with the rank's label.
"""

from __future__ import annotations

import faulthandler
import logging
import math
import os
import sys
import tempfile
import threading
import time

from asrflow.training.outcome import Stalled, exit_code
from asrflow.training.run_state import LossHistory
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
    tracker, history: LossHistory, result: StepResult, *, loss_scale: float | None, **context: float
) -> dict[str, float]:
    """The step's metrics (:func:`step_metrics` of ``result`` and ``context``: lr, epoch, world_size,
    skipped_total) buffered in ``tracker`` when finite, ``history`` extended, a log line every few steps;
    returns the metrics."""
    step, metrics = result.step, step_metrics(result, **context)
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
    return metrics


class StallWatchdog:
    """A daemon thread; call :meth:`beat` after each step. Ends the process with the exit code of
    :class:`~asrflow.training.outcome.Stalled` (it cannot raise into a main thread stuck in a collective)."""

    def __init__(self, timeout_s: float, label: str = ""):
        self.timeout_s = timeout_s
        self.label = label
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="asrflow-watchdog", daemon=True)

    def __enter__(self) -> StallWatchdog:
        if self.timeout_s > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def beat(self) -> None:
        self._last = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(min(self.timeout_s / 4, 5.0)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                logger.error(
                    "%sno training step finished for %.0f s (run.stall_timeout_s = %.0f); "
                    "stacks of every thread follow, then exit %d",
                    self.label,
                    idle,
                    self.timeout_s,
                    exit_code(Stalled),
                )
                write_stacks(sys.stderr, self.label)
                os._exit(exit_code(Stalled))


def write_stacks(stream, prefix: str) -> None:
    """Every thread's stack (faulthandler's format) to ``stream``, each line starting with ``prefix``."""
    with tempfile.TemporaryFile("w+") as dump:
        faulthandler.dump_traceback(file=dump, all_threads=True)
        dump.seek(0)
        lines = dump.read().splitlines()
    stream.flush()
    for line in lines:  # one write per line: lines from different processes never mix
        os.write(stream.fileno(), f"{prefix}{line}\n".encode())
