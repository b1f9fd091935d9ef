"""Where cut manifests live and how to read them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from lhotse import CutSet

from asrflow.errors import AsrflowError

SPLITS = ("train", "dev", "test")

T = TypeVar("T")


def cuts_path(directory: str | Path, split: str) -> Path:
    """Where a split's cuts live, in ``data/manifests`` and ``data/fbank`` alike."""
    return Path(directory) / f"{split}_cuts.jsonl.gz"


def load_cuts(directory: str | Path, split: str) -> CutSet:
    """Read one split's cuts, with a clear error when the stage before has not run.

    The CutSet is lazy: it reads the ``jsonl.gz`` file as it is iterated (constant memory,
    no random access, each iteration reads again). Call ``.to_eager()`` for random access.
    """
    path = cuts_path(directory, split)
    if not path.is_file():
        raise AsrflowError(f"{path} not found: run the stage that writes it first")
    return CutSet.from_jsonl_lazy(path)


def cut_text(cut) -> str:
    """The transcript of a cut (its supervisions' texts joined by spaces)."""
    return " ".join(s.text for s in cut.supervisions if s.text)


def pack_by_duration(items: Iterable[T], duration_s: Callable[[T], float], max_seconds: float) -> list[list[T]]:
    """Consecutive ``items`` grouped into batches of at most ``max_seconds`` of audio, in order.

    Sort the items by duration first to keep padding small. An item longer than
    ``max_seconds`` forms a batch of its own.
    """
    batches: list[list[T]] = []
    current: list[T] = []
    total = 0.0
    for item in items:
        seconds = duration_s(item)
        if current and total + seconds > max_seconds:
            batches.append(current)
            current, total = [], 0.0
        current.append(item)
        total += seconds
    if current:
        batches.append(current)
    return batches
