"""Deciding whether training resumes, starts fresh, or must stop, from the newest checkpoint.

Two things are compared with what the checkpoint recorded:

* the **fingerprint**: what a resume cannot change without making the checkpoint
  meaningless (model shape, features, tokenizer, train data, seed, batch plan settings, and the
  model a fine-tuning run started from: its source and content);
* the **training params**: every ``train:`` key outside :data:`OPERATIONAL_KEYS`, the number of
  processes (``run.nproc_per_node``, ``run.nnodes``), and ``code_digest``, the digest of
  the training code (:func:`asrflow.code_digest.source_digest` of the trainer). So a finished
  run that DVC or Snakemake re-runs because its code changed trains again, while an
  unfinished one resumes under the new code with a warning.

========================  ==========================  =====================================
newest checkpoint         fingerprint / train params  decision
========================  ==========================  =====================================
none                      -                           fresh
finished run              both equal                  resume (more epochs if raised)
finished run              any differs                 fresh (the old checkpoints are removed)
unfinished run            fingerprint differs         stop with a message (restore or rm)
unfinished run            train params differ         resume, warning per changed key
========================  ==========================  =====================================
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from asrflow.errors import AsrflowError
from asrflow.params import flatten

if TYPE_CHECKING:  # the config is built from sections whose components import this module
    from asrflow.training.config import TrainConfig
    from asrflow.training.run_config import RunConfig

logger = logging.getLogger(__name__)

FRESH, RESUME = "fresh", "resume"

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


def _differences(old: dict, new: dict) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in keys if old.get(key) != new.get(key)]


def decide(checkpoint: dict | None, fingerprint: dict, params: dict, checkpoint_dir: Path) -> str:
    """Return :data:`FRESH` or :data:`RESUME`, or raise when an unfinished run would be broken."""
    if checkpoint is None:
        return FRESH
    fingerprint_changes = _differences(checkpoint["fingerprint"], fingerprint)
    param_changes = _differences(checkpoint["train_params"], params)
    if checkpoint["complete"]:
        if fingerprint_changes or param_changes:
            logger.info(
                "the finished run in %s used other settings (%s): starting a fresh run",
                checkpoint_dir,
                "; ".join((fingerprint_changes + param_changes)[:5]),
            )
            return FRESH
        return RESUME
    if fingerprint_changes:
        raise AsrflowError(
            f"{checkpoint_dir} holds an unfinished run (step {checkpoint['step']}) made with other settings: "
            f"{'; '.join(fingerprint_changes)}. Restore those params to resume it, or delete it to start "
            f"fresh: rm -r {checkpoint_dir}"
        )
    for change in param_changes:
        logger.warning("train param changed since the checkpoint: %s; resuming with the new value", change)
    return RESUME
