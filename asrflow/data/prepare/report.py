"""What the ``prepare`` stage reports: the rejected items (``rejected.jsonl``), the summary
(``summary.json``), the log lines, and the check on the share of rejected items."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asrflow.data.prepare.config import PrepareConfig
from asrflow.data.prepare.rejections import Rejection
from asrflow.errors import AsrflowError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SplitSummary:
    """What one split holds after preparation.

    Attributes:
        utterances: number of utterances (= cuts).
        recordings: number of recordings they come from.
        hours: total speech in hours (sum of utterance durations).
        sampling_rates: the recordings' native sampling rates, in Hz.
        multichannel_recordings: recordings with more than one channel.
        rejected: items of this split that were rejected.
        carved_from_train: whether the split was carved from train.
    """

    utterances: int
    recordings: int
    hours: float
    sampling_rates: list[int]
    multichannel_recordings: int
    rejected: int
    carved_from_train: bool


@dataclass(frozen=True, kw_only=True)
class PrepareSummary:
    """The outcome of :func:`prepare_corpus` (also written as ``summary.json``).

    Attributes:
        output_dir: where the manifests were written.
        corpus: the corpus kind (recipe name, folder or kaldi).
        channel: the channel setting used for multi-channel audio.
        splits: per-split counts.
        total_hours: hours of speech over all splits.
        rejected_by_reason: rejected item counts by reason code.
        rejected_total: number of rejected items.
        items_total: kept utterances + rejected items.
    """

    output_dir: Path
    corpus: str
    channel: str | int
    splits: dict[str, SplitSummary]
    total_hours: float
    rejected_by_reason: dict[str, int]
    rejected_total: int
    items_total: int

    @property
    def rejected_fraction(self) -> float:
        """rejected / (kept + rejected), 0 for an empty corpus."""
        return self.rejected_total / self.items_total if self.items_total else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The JSON form written to ``summary.json`` (no paths, no time stamps)."""
        return {
            "corpus": self.corpus,
            "channel": self.channel,
            "splits": {name: dataclasses.asdict(split) for name, split in self.splits.items()},
            "total_hours": self.total_hours,
            "rejected": {
                "total": self.rejected_total,
                "fraction": round(self.rejected_fraction, 6),
                "by_reason": dict(sorted(self.rejected_by_reason.items())),
            },
            "items_total": self.items_total,
        }


class RejectionLog:
    """Rejected items, written to ``rejected.jsonl`` as they come (split order, then corpus order)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.handle = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.by_reason: Counter = Counter()
        self.by_split: Counter = Counter()
        self.first: list[Rejection] = []

    def add(self, rejection: Rejection) -> None:
        self.handle.write(json.dumps(rejection.to_dict(), ensure_ascii=False, sort_keys=True) + "\n")
        self.by_reason[rejection.reason] += 1
        self.by_split[rejection.split] += 1
        if len(self.first) < 10:
            self.first.append(rejection)

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    def close(self) -> None:
        self.handle.close()


def log_summary(summary: PrepareSummary, rejections: RejectionLog) -> None:
    for name, split in summary.splits.items():
        carved = " (carved from train)" if split.carved_from_train else ""
        logger.info(
            "prepare: %-5s %6d utterances, %6d recordings, %8.3f h, rates %s Hz, %d rejected%s",
            name,
            split.utterances,
            split.recordings,
            split.hours,
            split.sampling_rates,
            split.rejected,
            carved,
        )
    logger.info(
        "prepare: %.3f h in all; rejected %d of %d items (%.1f%%)%s",
        summary.total_hours,
        summary.rejected_total,
        summary.items_total,
        100 * summary.rejected_fraction,
        "".join(f", {reason}: {count}" for reason, count in Counter(summary.rejected_by_reason).most_common()),
    )
    for rejection in rejections.first:
        logger.warning("rejected %s/%s (%s): %s", rejection.split, rejection.id, rejection.reason, rejection.detail)
    if rejections.total > len(rejections.first):
        logger.warning("... and %d more rejected items, see rejected.jsonl", rejections.total - len(rejections.first))


def check_rejected(rejections: RejectionLog, *, kept: int, rejected: int, config: PrepareConfig, report: Path) -> None:
    """Fail when ``rejected`` of a corpus' items exceed its ``max_rejected_fraction``, leaving the full report
    at ``report``."""
    items = kept + rejected
    fraction = rejected / items if items else 0.0
    if fraction <= config.max_rejected_fraction:
        return
    rejections.close()
    os.replace(rejections.path, report)
    top = ", ".join(f"{reason}: {count}" for reason, count in rejections.by_reason.most_common(3))
    examples = "; ".join(f"{r.split}/{r.id}: {r.detail}" for r in rejections.first[:2])
    raise AsrflowError(
        f"{rejected} of {items} items rejected "
        f"({100 * fraction:.1f}% > max_rejected_fraction "
        f"{100 * config.max_rejected_fraction:.1f}%); top reasons: {top}; e.g. {examples}. "
        f"Every rejected item is listed in {report}: fix the corpus, or raise "
        "prepare.max_rejected_fraction in params.yaml"
    )
