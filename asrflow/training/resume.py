"""Deciding whether training resumes, starts fresh, or must stop, from the newest checkpoint.

Two things are compared with what the checkpoint recorded (both built by :mod:`asrflow.training.fingerprint`):

* the **fingerprint**: what a resume cannot change without making the checkpoint
  meaningless (model shape, features, tokenizer, train data, seed, batch plan settings, and the
  model a fine-tuning run started from: its source and content);
* the **training params**: every ``train:`` key outside
  :data:`~asrflow.training.fingerprint.OPERATIONAL_KEYS`, the number of processes
  (``run.nproc_per_node``, ``run.nnodes``), and ``code_digest``, the digest of the training code
  (:func:`asrflow.code_digest.source_digest` of the trainer). So a finished run that DVC or
  Snakemake re-runs because its code changed trains again, while an unfinished one resumes under
  the new code with a warning.

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

import logging
from pathlib import Path

from asrflow.errors import AsrflowError

logger = logging.getLogger(__name__)

FRESH, RESUME = "fresh", "resume"


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
