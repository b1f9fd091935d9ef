"""A training run's settings, read and checked from params.yaml: the ``train:`` sections, ``run:``,
``features:`` and ``seed``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from asrflow.data.features.config import FeatureConfig
from asrflow.params import build_config, read_seed
from asrflow.training.config import TrainConfig, load_run_config, load_train_config
from asrflow.training.run_config import RunConfig


@dataclass(frozen=True, kw_only=True)
class TrainingSettings:
    """Everything params.yaml tells a training run: the ``train:`` sections, ``run:``, ``features:``, ``seed``,
    and the whole params (logged to MLflow as the run's params)."""

    train: TrainConfig
    run: RunConfig
    features: FeatureConfig
    seed: int
    params: dict[str, Any]

    @classmethod
    def from_params(cls, params: dict[str, Any], **run_overrides: Any) -> TrainingSettings:
        """Read and check ``params`` (a loaded params.yaml); ``run_overrides`` replace ``run:`` keys for this
        process only (a cluster job's node count and rendezvous, a machine's ``--node-rank``)."""
        return cls(
            train=load_train_config(params),
            run=replace(load_run_config(params), **run_overrides),
            features=build_config(FeatureConfig, params.get("features"), "features"),
            seed=read_seed(params),
            params=params,
        )
