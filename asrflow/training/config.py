"""What a training run is told: params.yaml's ``train:`` sections, each the config of the component that reads
it, composed into one :class:`TrainConfig`; and the folders the run reads and writes."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asrflow.data.loading.config import DataConfig
from asrflow.model.conformer_ctc import ModelConfig
from asrflow.params import build_config
from asrflow.training.checkpoint_manager import CheckpointConfig
from asrflow.training.init_model import FinetuneConfig
from asrflow.training.nonfinite import NonFiniteConfig
from asrflow.training.run_config import RunConfig
from asrflow.training.step import OptimConfig

logger = logging.getLogger(__name__)

SECTION = "train"


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """The ``train:`` sections: ``train.model`` is the model's config, ``train.data`` the data loading's, and so
    on; each component receives its own section."""

    model: ModelConfig
    data: DataConfig
    optim: OptimConfig
    nonfinite: NonFiniteConfig
    finetune: FinetuneConfig
    checkpoint: CheckpointConfig

    def __post_init__(self) -> None:
        if self.checkpoint.keep_last < self.optim.average_last:
            logger.warning(
                "train.checkpoint.keep_last (%d) < train.optim.average_last (%d): at most %d checkpoints can be "
                "averaged",
                self.checkpoint.keep_last,
                self.optim.average_last,
                self.checkpoint.keep_last,
            )


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


def load_train_config(params: dict[str, Any]) -> TrainConfig:
    """The ``train:`` sections of ``params`` (a loaded params.yaml). An unknown key, a key in the wrong section,
    a missing key or a value out of range ends in one :class:`~asrflow.errors.AsrflowError` naming it."""
    return build_config(TrainConfig, params.get(SECTION), SECTION, neighbours={"run": RunConfig})


def load_run_config(params: dict[str, Any]) -> RunConfig:
    """The ``run:`` section of ``params``."""
    return build_config(RunConfig, params.get("run"), "run", neighbours={SECTION: TrainConfig})
