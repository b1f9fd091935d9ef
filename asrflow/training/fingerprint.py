"""What a checkpoint records of the run that wrote it, for :func:`asrflow.training.resume.decide` to compare:
the fingerprint (what a resume cannot change) and the training params (what it may change, with a warning)."""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from pathlib import Path

from asrflow.params import flatten
from asrflow.training.config import TrainConfig
from asrflow.training.run_config import RunConfig

#: ``train:`` keys that may change between an interrupted run and its resume without changing what the
#: resumed steps compute (the run's length, what is averaged at the end, the guard's patience, bookkeeping).
OPERATIONAL_KEYS = frozenset(
    {"train.optim.epochs", "train.optim.average_last", "train.nonfinite.max_consecutive_nonfinite"}
    | {"train.nonfinite.max_rollbacks"}
)
#: ``train:`` sections whose every key is operational.
OPERATIONAL_SECTIONS = ("train.checkpoint.",)


def file_digest(*paths: Path) -> str:
    """SHA-256 (first 16 hex digits) of the files' bytes, in order."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


#: ``features:`` keys that only set parallelism, never what is computed: left out of the fingerprint.
PARALLELISM_FEATURE_KEYS = frozenset({"num_jobs"})


def build_fingerprint(
    model: dict, features: dict, *, data_digest: str, seed: int, config: TrainConfig, init: dict | None = None
) -> dict:
    """The settings a resume must not change, as a flat dict of JSON-able values. ``init``: the fine-tuning
    source (:meth:`~asrflow.training.init_model.InitModel.fingerprint`) with its encoder learning-rate scale,
    which shapes the optimizer's parameter groups; absent without one."""
    fingerprint = {f"model.{key}": value for key, value in model.items()}
    fingerprint.update(
        {f"features.{key}": value for key, value in features.items() if key not in PARALLELISM_FEATURE_KEYS}
    )
    fingerprint["data_digest"] = data_digest
    fingerprint["seed"] = seed
    fingerprint["train.data.max_duration_s"] = config.data.max_duration_s
    fingerprint["train.data.num_buckets"] = config.data.num_buckets
    fingerprint["train.optim.accum_grad"] = config.optim.accum_grad
    if config.data.corpus_weights:  # they change every epoch's plan; left out when none is set
        fingerprint["train.data.corpus_weights"] = dict(sorted(config.data.corpus_weights.items()))
    if init is not None:
        fingerprint.update(init)
        fingerprint["train.finetune.encoder_lr_scale"] = config.finetune.encoder_lr_scale
    return fingerprint


def training_params(config: TrainConfig, run: RunConfig, code_digest: str) -> dict:
    """The train keys that change what the steps compute (dotted, ``train.optim.lr``), the number of processes,
    and the digest of the code that computes them."""
    params = {
        key: value
        for key, value in flatten(asdict(config), "train.").items()
        if key not in OPERATIONAL_KEYS and not key.startswith(OPERATIONAL_SECTIONS)
    }
    return {**params, **{f"run.{key}": value for key, value in run.world.items()}, "code_digest": code_digest}
