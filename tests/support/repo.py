"""The repository checkout that tests and benchmarks run in: its root, its params, copies of it."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
YESNO_DIR = REPO / "data" / "corpora" / "yesno"

#: What :func:`copy_repo` leaves out: environments, outputs, caches, tool state and ``bench/.peer``
#: (the peer toolkit's install), so a copy runs the pipeline from scratch.
COPY_IGNORE = (
    ".venv",
    ".git",
    "__pycache__",
    ".snakemake",
    "exp",
    "logs",
    "mlflow.db",
    "mlartifacts",
    "mlruns",
    "manifests",
    "fbank",
    "lang",
    ".pytest_cache",
    ".ruff_cache",
    "*.egg-info",
    ".dvc",
    ".peer",
)


def repo_params() -> dict:
    """The repository's params.yaml."""
    from asrflow.params import load_params

    return load_params(REPO / "params.yaml")


def write_shipped_params(folder: Path, changes: dict[str, object]) -> Path:
    """``folder/params.yaml``: the shipped params with ``changes`` applied.

    A dotted key (``train.optim.lr``) sets one value; a bare ``section`` replaces the whole section.
    """
    from asrflow.params import set_param

    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for dotted, value in changes.items():
        set_param(params, dotted, value)
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def tool_env(copy: Path) -> dict[str, str]:
    """The environment for a tool run (Snakemake, DVC) in ``copy``, a copy of the repository: this
    interpreter's tools first on PATH, the copy's own MLflow store, no bytecode written into it."""
    env = os.environ.copy()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["GIT_PYTHON_REFRESH"] = "quiet"
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{copy}/mlflow.db"
    env["DVC_NO_ANALYTICS"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("VIRTUAL_ENV", None)
    return env


def copy_repo(destination: Path) -> Path:
    """A copy of the repository's own files (no venv, outputs or caches) for tool runs."""
    shutil.copytree(REPO, destination, ignore=shutil.ignore_patterns(*COPY_IGNORE))
    return destination


def repo_config(cls, section: str, **changes):
    """Dataclass ``cls`` built from params.yaml's ``section`` (dotted, e.g. ``train.data``: what users get),
    with ``changes``."""
    from asrflow.params import build_config

    node = repo_params()
    for part in section.split("."):
        node = node[part]
    return build_config(cls, {**node, **changes}, section)
