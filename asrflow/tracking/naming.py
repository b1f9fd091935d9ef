"""What the runs table shows of a training run: a short name, the param diff as its description, tags."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

from asrflow.params import flatten

#: Run tags: the tool that ran the stage, a digest of the params, the DVC experiment; the run's description.
PIPELINE_TAG = "asrflow.pipeline"
PARAMS_DIGEST_TAG = "asrflow.params_digest"
DVC_EXP_TAG = "asrflow.dvc_experiment"
NOTE_TAG = "mlflow.note.content"
MAX_PARAM_VAL_LENGTH = 6000  # MLflow's limit (a test checks it agrees)


def param_value(value: Any) -> str:
    """One param value as MLflow stores it: strings as they are, the rest as JSON, cut at 6,000 characters."""
    try:
        text = value if isinstance(value, str) else json.dumps(value)
    except (TypeError, ValueError):
        text = str(value)
    truncated = "...[truncated]"
    return text if len(text) <= MAX_PARAM_VAL_LENGTH else text[: MAX_PARAM_VAL_LENGTH - len(truncated)] + truncated


def flat_params(params: Mapping[str, Any]) -> dict[str, str]:
    """Nested params as MLflow params: dotted keys, values rendered by :func:`param_value`."""
    return {key: param_value(value) for key, value in flatten(dict(params)).items()}


def params_digest(params: Mapping[str, Any]) -> str:
    """First 8 hex characters of the SHA-256 of the flattened params (keys sorted)."""
    return hashlib.sha256(json.dumps(flat_params(params), sort_keys=True).encode()).hexdigest()[:8]


def pipeline_tool() -> str:
    """``snakemake`` (its rules set ``ASRFLOW_PIPELINE``), ``dvc`` (it sets ``DVC_STAGE``) or ``direct``."""
    under_dvc = os.environ.get("DVC_STAGE") or os.environ.get("DVC_EXP_NAME")
    return os.environ.get("ASRFLOW_PIPELINE") or ("dvc" if under_dvc else "direct")


def params_diff(params: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """Flattened key -> (committed value, run's value) for each key that differs; ``(unset)`` if absent."""
    now, before = flat_params(params), flat_params(defaults)
    keys = sorted(key for key in set(now) | set(before) if now.get(key) != before.get(key))
    return {key: (before.get(key, "(unset)"), now.get(key, "(unset)")) for key in keys}


def run_name(params: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> str:
    """A short name that tells runs apart: the DVC experiment's under ``dvc exp run``; else the corpus and the one
    to three keys that differ from ``defaults`` (``yesno lr=0.001``); else the corpus and the params digest."""
    if os.environ.get("DVC_EXP_NAME"):
        return os.environ["DVC_EXP_NAME"]
    corpus = str((params.get("prepare") or {}).get("corpus") or "params")
    diff = params_diff(params, defaults) if defaults is not None else {}
    named = " ".join([corpus] + [f"{key.rsplit('.', 1)[-1]}={value}" for key, (_, value) in diff.items()])
    short = 0 < len(diff) <= 3 and len(named) <= 40  # a name the runs table shows whole
    return named if short else f"{corpus}-{params_digest(params)}"


def dvc_experiment_tags() -> dict[str, str]:
    """Under ``dvc exp run``: the experiment's name as a tag and as the run's (a re-queued one renames its run)."""
    name = os.environ.get("DVC_EXP_NAME")
    return {DVC_EXP_TAG: name, "mlflow.runName": name} if name else {}


def run_tags(params: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> dict[str, str]:
    """A new run's tags: pipeline tool, params digest, DVC experiment; the diff to ``defaults`` as its description."""
    tags = {PIPELINE_TAG: pipeline_tool(), PARAMS_DIGEST_TAG: params_digest(params), **dvc_experiment_tags()}
    if defaults is not None:
        lines = [f"- `{key}`: {old} -> {new}" for key, (old, new) in params_diff(params, defaults).items()]
        heading = "Params that differ from the committed params.yaml:"
        tags[NOTE_TAG] = "\n".join([heading, *lines]) if lines else "The committed params.yaml, unchanged."
    return tags
