"""A training run assembled from params.yaml: its settings read and checked, the process tuned for them
(threads, glibc's malloc, oneDNN's caches), the process group and the tracking store started, a start model
loaded, the parts built (:mod:`asrflow.training.parts`) and checked the same on every rank, then the Trainer.
The train stage, every benchmark and the test harness call :func:`build_trainer`, so what they train is what
users run; the tuner takes the same process settings (:func:`configure_process`) and parts."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch

from asrflow.allocator import glibc_malloc, limit_onednn_cache, malloc_in_use, training_mmap_threshold, tune_malloc
from asrflow.tracking.store import build_store_in_background
from asrflow.training.checkpoint import content_digest
from asrflow.training.config import TrainPaths
from asrflow.training.distributed import check_same_everywhere, init_distributed
from asrflow.training.init_model import load_init_model
from asrflow.training.observers import TrainObserver
from asrflow.training.parts import RunPlace, build_run_parts, default_device
from asrflow.training.precision import precision_for
from asrflow.training.settings import TrainingSettings
from asrflow.training.step import OptimConfig
from asrflow.training.trainer import Trainer

logger = logging.getLogger(__name__)


def configure_process(optim: OptimConfig) -> dict[str, Any]:
    """Set what this process needs to train as ``optim`` asks, before any model runs: its torch threads, caps on
    oneDNN's and PyTorch's primitive caches (batches of ever-new shapes would fill them), glibc's malloc
    thresholds for the precision this machine resolves (fp32's larger activations take a higher mmap
    threshold), and on a GPU the attention kernels (:func:`use_shape_free_attention`). Returns
    :func:`process_report`."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = precision_for(optim.precision, device).name
    limit_onednn_cache()
    tune_malloc(training_mmap_threshold(precision))
    torch.set_num_threads(optim.num_threads)
    if device.type == "cuda":
        use_shape_free_attention()
    return process_report(precision)


def process_report(precision: str) -> dict[str, Any]:
    """What this process trains under, in ``precision``: its malloc (and glibc's mmap threshold when glibc's
    serves it), its torch threads and the primitive caches' caps. The train stage logs it; the tuner's
    measuring processes report the same."""
    return {
        "precision": precision,
        "malloc": malloc_in_use(),
        "mmap_threshold": training_mmap_threshold(precision) if glibc_malloc() else None,
        "torch_threads": torch.get_num_threads(),
        "onednn_cache": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"),
        "pytorch_cache": os.environ.get("LRU_CACHE_CAPACITY"),
    }


def use_shape_free_attention() -> None:
    """Keep ``scaled_dot_product_attention`` off cuDNN's kernel. cuDNN builds an execution plan for every new
    (utterances, frames) shape of a batch, host time that every step of a first pass over length-bucketed
    batches pays (bench/RESULTS.md#gpu-first-pass); the flash and memory-efficient kernels
    need none. PyTorch picks among those left as before."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def start_place(settings: TrainingSettings, *, tracking_uri: str | None = None) -> RunPlace:
    """Join the job's process group (one process when there is none) and, on rank 0, make the MLflow store at
    ``tracking_uri`` in the background while the parts are built; this rank's place."""
    dist = init_distributed(settings.run.dist_timeout_s)
    if dist.is_main:
        build_store_in_background(tracking_uri)
    return RunPlace(dist=dist, device=default_device(dist))


def build_trainer(
    settings: TrainingSettings,
    paths: TrainPaths,
    *,
    tracking_uri: str | None = None,
    observers: Sequence[TrainObserver] = (),
) -> Trainer:
    """The process configured for ``settings`` and its Trainer, reading and writing ``paths``; MLflow goes to
    ``tracking_uri`` (default: ``$MLFLOW_TRACKING_URI`` or ``sqlite:///mlflow.db``). A start model
    (``train.finetune.init_from``: a file or an MLflow model URI) is loaded here, before any data is read."""
    logger.info("process settings: %s", json.dumps(configure_process(settings.train.optim)))
    place = start_place(settings, tracking_uri=tracking_uri)
    init_from = settings.train.finetune.init_from
    init_model = load_init_model(init_from, tracking_uri=tracking_uri) if init_from else None
    parts = build_run_parts(settings, paths, place, init_model=init_model)
    agreed = content_digest([parts.fingerprint, parts.train_params])
    check_same_everywhere(place.dist, agreed, "params, code or data")
    return Trainer(settings, parts, place, paths=paths, tracking_uri=tracking_uri, observers=observers)
