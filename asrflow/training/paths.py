"""Where the train stage reads and writes: one place builds the paths for every caller."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class TrainPaths:
    """Inputs (features, tokenizer) and outputs (model bundle, checkpoints, plots) of the train stage."""

    fbank_dir: Path = Path("data/fbank")
    lang_dir: Path = Path("data/lang")
    model_path: Path = Path("exp/model.pt")
    checkpoint_dir: Path = Path("exp/checkpoints")
    loss_csv: Path = Path("exp/plots/train_loss.csv")
    bad_batches: Path = Path("exp/bad_batches.jsonl")

    @classmethod
    def under(cls, exp_dir: str | Path, *, fbank_dir: str | Path, lang_dir: str | Path) -> TrainPaths:
        """Paths that read ``fbank_dir`` and ``lang_dir`` and write everything under ``exp_dir``."""
        exp = Path(exp_dir)
        return cls(
            fbank_dir=Path(fbank_dir),
            lang_dir=Path(lang_dir),
            model_path=exp / "model.pt",
            checkpoint_dir=exp / "checkpoints",
            loss_csv=exp / "plots" / "train_loss.csv",
            bad_batches=exp / "bad_batches.jsonl",
        )
