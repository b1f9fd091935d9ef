"""Where cut manifests live and how to read them."""

from __future__ import annotations

from pathlib import Path

from lhotse import CutSet

from asrflow.errors import AsrflowError

SPLITS = ("train", "dev", "test")


def cuts_path(directory: str | Path, split: str) -> Path:
    """Where a split's cuts live, in ``data/manifests`` and ``data/fbank`` alike."""
    return Path(directory) / f"{split}_cuts.jsonl.gz"


def load_cuts(directory: str | Path, split: str) -> CutSet:
    """Read one split's cuts, with a clear error when the stage before has not run."""
    path = cuts_path(directory, split)
    if not path.is_file():
        raise AsrflowError(f"{path} not found: run the stage that writes it first")
    return CutSet.from_file(path)


def cut_text(cut) -> str:
    """The transcript of a cut (its supervisions' texts joined by spaces)."""
    return " ".join(s.text for s in cut.supervisions if s.text)
