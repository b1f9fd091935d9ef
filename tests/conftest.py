"""Shared fixtures: the repository root, and a tiny prepared yesno dataset for training tests."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")


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


_TEMPLATE_DB: Path | None = None


def fresh_mlflow_store(directory: Path) -> str:
    """``sqlite:///<directory>/mlflow.db``: an empty MLflow store with its schema already made.

    Creating the schema (MLflow's migrations) costs seconds; it is done once per process
    into a template that each caller gets a copy of.
    """
    global _TEMPLATE_DB
    if _TEMPLATE_DB is None or not _TEMPLATE_DB.is_file():
        os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
        from mlflow.tracking import MlflowClient

        folder = tempfile.mkdtemp(prefix="asrflow-mlflow-template-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        template = Path(folder) / "mlflow.db"
        MlflowClient(tracking_uri=f"sqlite:///{template}").search_experiments()
        _TEMPLATE_DB = template
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_TEMPLATE_DB, directory / "mlflow.db")
    return f"sqlite:///{(directory / 'mlflow.db').resolve()}"


@pytest.fixture
def uri(tmp_path: Path) -> str:
    """An empty MLflow store in the test's folder (:func:`fresh_mlflow_store`)."""
    return fresh_mlflow_store(tmp_path)


@pytest.fixture(autouse=True)
def _restore_root_logging():
    """A stage's ``main()`` called in a test points the root logger at that test's captured
    stderr (``setup_logging``); put the handlers back, or later tests log to a closed stream."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def yesno_data(tmp_path_factory) -> Path:
    """prepare + features + tokenizer run on the shipped yesno corpus, once per session.

    Returns a folder holding ``manifests/``, ``fbank/`` and ``lang/``. The cuts point at
    features with absolute paths, so the folder can be used from any working directory.
    """
    from asrflow.data.features import FeatureConfig, compute_features
    from asrflow.data.manifests import load_cuts
    from asrflow.data.prepare import PrepareConfig, prepare_corpus
    from asrflow.tokenizer import TokenizerConfig, train_tokenizer

    root = tmp_path_factory.mktemp("yesno")
    prepare_corpus(PrepareConfig(corpus_dir=str(REPO / "data/corpora/yesno")), root / "manifests", seed=42)
    compute_features(root / "manifests", root / "fbank", FeatureConfig(num_jobs=1))
    texts = [" ".join(s.text for s in cut.supervisions) for cut in load_cuts(root / "manifests", "train")]
    train_tokenizer(texts, root / "lang", TokenizerConfig())
    return root


def tiny_train_config(**overrides):
    """A TrainConfig for a model small enough to train in seconds on the CPU."""
    from asrflow.training.config import TrainConfig

    tiny = TrainConfig(
        d_model=32,
        num_heads=2,
        ffn_dim=64,
        num_layers=1,
        conv_kernel_size=7,
        dropout=0.1,
        max_duration_s=30.0,
        num_buckets=10,
        num_workers=0,
        epochs=2,
        warmup_steps=5,
        num_threads=1,
        checkpoint_every_steps=4,
        validate_every_steps=4,
        keep_last=20,
        average_last=1,
    )
    return replace(tiny, **overrides)


def train_paths(data: Path, exp: Path):
    """TrainPaths reading ``data`` (from :func:`yesno_data`) and writing under ``exp``."""
    from asrflow.training.config import TrainPaths

    return TrainPaths.under(exp, fbank_dir=data / "fbank", lang_dir=data / "lang")


def copy_repo(destination: Path) -> Path:
    """A copy of the repository's tracked-looking files (no .venv, outputs or caches) for tool runs."""
    from bench.common import copy_repo as copy_without_outputs

    return copy_without_outputs(destination)


sys.path.insert(0, str(Path(__file__).parent))
