"""Non-finite guard: skip bad steps, roll back after too many, stop with a clear message."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from asrflow.errors import AsrflowError
from asrflow.params import check_at_least, param_error

logger = logging.getLogger(__name__)

SECTION = "train.nonfinite"


@dataclass(frozen=True, kw_only=True)
class NonFiniteConfig:
    """params.yaml's ``train.nonfinite`` section (each key is documented there)."""

    max_consecutive_nonfinite: int
    rollback_lr_factor: float
    max_rollbacks: int

    def __post_init__(self) -> None:
        check_at_least(self, SECTION, 1, "max_consecutive_nonfinite")
        check_at_least(self, SECTION, 0, "max_rollbacks")
        if not 0.0 < self.rollback_lr_factor <= 1.0:
            raise param_error(SECTION, "rollback_lr_factor", self.rollback_lr_factor, "must be in (0, 1]")


class RollbackNeeded(Exception):
    """Raised when ``max_consecutive_nonfinite`` steps in a row were skipped."""


@dataclass(kw_only=True)
class NonFiniteGuard:
    """Counts skipped steps and decides when to roll back or stop.

    ``observe`` is called once per optimizer step with values already agreed by every
    rank (one all-reduce), so every rank skips, rolls back and stops alike.
    """

    max_consecutive: int
    max_rollbacks: int
    bad_batches_path: Path
    #: Only one process writes ``bad_batches_path`` (rank 0 under DDP; it gets the step's full cut ids).
    writes_records: bool = True
    consecutive: int = 0
    total_skipped: int = 0
    rollbacks: int = 0
    recent_bad: list[list[str]] = field(default_factory=list)

    @classmethod
    def for_run(cls, config: NonFiniteConfig, bad_batches_path: Path, *, writes_records: bool) -> NonFiniteGuard:
        """The guard ``config`` asks for."""
        return cls(
            max_consecutive=config.max_consecutive_nonfinite,
            max_rollbacks=config.max_rollbacks,
            bad_batches_path=bad_batches_path,
            writes_records=writes_records,
        )

    def observe(self, step: int, *, finite: bool, loss: float, grad_norm: float, cut_ids: list[str]) -> bool:
        """Record one step; returns True when the step may be applied.

        ``cut_ids`` are every cut of the optimizer step (all micro-batches, all ranks).
        """
        if finite:
            self.consecutive = 0
            self.recent_bad.clear()
            return True
        self.consecutive += 1
        self.total_skipped += 1
        self.recent_bad.append(cut_ids)
        logger.warning(
            "step %d: non-finite loss %s or grad norm %s; step skipped (%d in a row)",
            step,
            loss,
            grad_norm,
            self.consecutive,
        )
        if self.writes_records:
            self._write_record(step, loss, grad_norm, cut_ids)
        if self.consecutive >= self.max_consecutive:
            if self.rollbacks >= self.max_rollbacks:
                batches = "; ".join(",".join(ids[:5]) for ids in self.recent_bad[-3:])
                raise AsrflowError(
                    f"training stopped: {self.consecutive} non-finite steps in a row after "
                    f"{self.rollbacks} rollbacks (train.nonfinite.max_rollbacks). "
                    f"Last bad batches (cut ids): {batches}. "
                    f"All are listed in {self.bad_batches_path}; inspect that audio, lower train.optim.lr "
                    "or use train.optim.precision: fp32"
                )
            raise RollbackNeeded()
        return False

    def _write_record(self, step: int, loss: float, grad_norm: float, cut_ids: list[str]) -> None:
        """Append one line to ``bad_batches_path``."""
        self.bad_batches_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.bad_batches_path, "a") as handle:
            record = {
                "step": step,
                "loss": _json_number(loss),
                "grad_norm": _json_number(grad_norm),
                "cut_ids": cut_ids,
            }
            handle.write(json.dumps(record) + "\n")

    def rolled_back(self, *, skipped_before: int, rollbacks_before: int) -> None:
        """After a rollback restored an older state of this guard: keep the run's totals as they were
        before it (``bad_batches.jsonl`` lists every skipped step), count this rollback, and start
        counting skips in a row afresh."""
        self.total_skipped = skipped_before
        self.rollbacks = rollbacks_before + 1
        self.consecutive = 0
        self.recent_bad.clear()

    def state_dict(self) -> dict:
        """Counts, and the current streak of skips (a checkpoint with ``consecutive > 0`` is no rollback target)."""
        return {
            "total_skipped": self.total_skipped,
            "rollbacks": self.rollbacks,
            "consecutive": self.consecutive,
            "recent_bad": [list(ids) for ids in self.recent_bad],
        }

    def load_state_dict(self, state: dict) -> None:
        self.total_skipped = int(state["total_skipped"])
        self.rollbacks = int(state["rollbacks"])
        self.consecutive = int(state.get("consecutive", 0))
        self.recent_bad = [list(ids) for ids in state.get("recent_bad", [])]


def _json_number(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)
