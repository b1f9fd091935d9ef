"""The one place a training run is assembled: its settings read from params.yaml, the process tuned for them
(threads, glibc's malloc, oneDNN's cache), then the Trainer that builds the data, the model and the tracker.
The train stage, every benchmark and the test harness call :func:`build_trainer`, so what they train is what
users run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from asrflow.allocator import limit_onednn_cache, training_mmap_threshold, tune_malloc
from asrflow.data.features.config import FeatureConfig
from asrflow.params import build_config, read_seed
from asrflow.training.config import TrainConfig, TrainPaths, load_run_config, load_train_config
from asrflow.training.observers import TrainObserver
from asrflow.training.precision import precision_for
from asrflow.training.run_config import RunConfig
from asrflow.training.step import OptimConfig
from asrflow.training.trainer import Trainer


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


def configure_process(optim: OptimConfig) -> None:
    """Set what this process needs to train as ``optim`` asks, before any model runs: its torch threads, a
    cap on oneDNN's primitive cache (batches of ever-new shapes would fill it), glibc's malloc thresholds
    for the precision this machine resolves (fp32's larger activations take a higher mmap threshold), and on
    a GPU the attention kernels (:func:`use_shape_free_attention`)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    limit_onednn_cache()
    tune_malloc(training_mmap_threshold(precision_for(optim.precision, device).name))
    torch.set_num_threads(optim.num_threads)
    if device.type == "cuda":
        use_shape_free_attention()


def use_shape_free_attention() -> None:
    """Keep ``scaled_dot_product_attention`` off cuDNN's kernel. cuDNN builds an execution plan for every new
    (utterances, frames) shape of a batch, host time that every step of a first pass over length-bucketed
    batches pays (bench/RESULTS.md, "GPU, third run"); the flash and memory-efficient kernels
    need none. PyTorch picks among those left as before."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def build_trainer(
    settings: TrainingSettings,
    paths: TrainPaths,
    *,
    tracking_uri: str | None = None,
    observers: Sequence[TrainObserver] = (),
) -> Trainer:
    """The process configured for ``settings`` and its Trainer, reading and writing ``paths``; MLflow goes to
    ``tracking_uri`` (default: ``$MLFLOW_TRACKING_URI`` or ``sqlite:///mlflow.db``)."""
    configure_process(settings.train.optim)
    return Trainer(
        settings.train,
        settings.run,
        settings.features,
        seed=settings.seed,
        all_params=settings.params,
        paths=paths,
        tracking_uri=tracking_uri,
        observers=observers,
    )
