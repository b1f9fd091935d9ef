"""What the runs table shows of a training run: a short name, the param diff as its description, tags."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Run tags: the tool that ran the stage, a digest of the params, the DVC experiment.
PIPELINE_TAG = "asrflow.pipeline"
PARAMS_DIGEST_TAG = "asrflow.params_digest"
DVC_EXP_TAG = "asrflow.dvc_experiment"
#: The run's description in MLflow's UI.
NOTE_TAG = "mlflow.note.content"
#: Environment variable the Snakemake rules set to ``snakemake`` (see :func:`pipeline_tool`).
PIPELINE_ENV = "ASRFLOW_PIPELINE"
MAX_PARAM_VAL_LENGTH = 6000
#: A run is named by the keys that differ when at most this many do and the name stays short.
MAX_NAMED_KEYS = 3
MAX_RUN_NAME_CHARS = 40
_TRUNCATED = "...[truncated]"


def param_value(value: Any) -> str:
    """One param value as MLflow stores it: strings as they are, the rest as JSON, at most 6,000 characters."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value)
        except (TypeError, ValueError):
            text = str(value)
    if len(text) > MAX_PARAM_VAL_LENGTH:
        text = text[: MAX_PARAM_VAL_LENGTH - len(_TRUNCATED)] + _TRUNCATED
    return text


def params_digest(params: Mapping[str, Any]) -> str:
    """First 8 hex characters of the SHA-256 of the flattened params (keys sorted)."""
    from asrflow.params import flatten

    flat = {key: param_value(value) for key, value in flatten(dict(params)).items()}
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()[:8]


def pipeline_tool() -> str:
    """``snakemake`` (its rules set ``ASRFLOW_PIPELINE``), ``dvc`` (it sets ``DVC_STAGE``) or ``direct``."""
    if os.environ.get(PIPELINE_ENV):
        return os.environ[PIPELINE_ENV]
    return "dvc" if os.environ.get("DVC_STAGE") or os.environ.get("DVC_EXP_NAME") else "direct"


def committed_params(path: str | os.PathLike = "params.yaml") -> dict | None:
    """``path`` as committed in git's HEAD (what a run is compared with), or None."""
    import yaml

    try:
        shown = subprocess.run(
            ["git", "show", f"HEAD:./{Path(path).name}"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
            cwd=Path(path).resolve().parent,
        )
        loaded = yaml.safe_load(shown.stdout) if shown.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, yaml.YAMLError):
        return None
    return loaded if isinstance(loaded, dict) else None


def params_diff(params: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, tuple[str, str]]:
    """Flattened key -> (committed value, run's value) for each key that differs; ``(unset)`` if absent."""
    from asrflow.params import flatten

    now, before = flatten(dict(params)), flatten(dict(defaults))
    shown = {key: (param_value(before[key]) if key in before else "(unset)") for key in set(now) | set(before)}
    return {
        key: (shown[key], param_value(now[key]) if key in now else "(unset)")
        for key in sorted(shown)
        if (key in now) != (key in before) or param_value(now.get(key)) != shown[key]
    }


def run_name(params: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> str:
    """A short name that tells runs apart: the DVC experiment's under ``dvc exp run``; else the corpus and the
    (at most :data:`MAX_NAMED_KEYS`) keys that differ from ``defaults``, as ``yesno lr=0.001``; else the corpus
    and the params digest, as ``yesno-3f2a9c01``."""
    if os.environ.get("DVC_EXP_NAME"):
        return os.environ["DVC_EXP_NAME"]
    corpus = str((params.get("prepare") or {}).get("corpus") or "params")
    fallback = f"{corpus}-{params_digest(params)}"
    diff = params_diff(params, defaults) if defaults is not None else {}
    named = " ".join([corpus] + [f"{key.rsplit('.', 1)[-1]}={value}" for key, (_, value) in diff.items()])
    return named if 0 < len(diff) <= MAX_NAMED_KEYS and len(named) <= MAX_RUN_NAME_CHARS else fallback


def run_tags(params: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> dict[str, str]:
    """A new run's tags: the pipeline tool, the params digest, the DVC experiment, and as its description
    the params that differ from ``defaults`` (the committed params.yaml)."""
    tags = {PIPELINE_TAG: pipeline_tool(), PARAMS_DIGEST_TAG: params_digest(params)}
    if os.environ.get("DVC_EXP_NAME"):
        tags[DVC_EXP_TAG] = os.environ["DVC_EXP_NAME"]
    if defaults is not None:
        diff = params_diff(params, defaults)
        lines = [f"- `{key}`: {old} -> {new}" for key, (old, new) in diff.items()]
        heading = "Params that differ from the committed params.yaml:"
        tags[NOTE_TAG] = "\n".join([heading, *lines]) if lines else "The committed params.yaml, unchanged."
    return tags
