"""Shared fixtures: an MLflow store, the prepared yesno data, a trained yesno model; helpers live in tests.support."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.support.corpora import prepare_yesno
from tests.support.mlflow_store import fresh_mlflow_store
from tests.support.repo import REPO
from tests.support.trained_model import NoYesnoModel, train_yesno_model

os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")


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


@pytest.fixture(autouse=True)
def _restore_signal_actions():
    """The train stage's ``main()`` called in a test leaves SIGTERM and SIGINT ignored when it returns (as the
    stage's process ends that way, see ``stages.train.run_trainer``); put back what the test found. A process
    started later inherits ignored signals, so a pool of them could never be terminated."""
    actions = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, action in actions.items():
        if action is not None and signal.getsignal(sig) is not action:
            signal.signal(sig, action)


@pytest.fixture(autouse=True)
def _restore_import_path():
    """Loading an MLflow pyfunc model puts its logged code folder (a copy of asrflow) first on ``sys.path`` and
    drops the asrflow modules already imported, so that they load from the copy. Put both back: later tests,
    and the processes they spawn (which inherit ``sys.path``), must run this checkout's asrflow."""
    path = sys.path[:]
    ours = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "asrflow"}
    yield
    if sys.path == path:  # nothing put another copy of asrflow in front
        return
    sys.path[:] = path
    here = Path(__file__).resolve().parents[1] / "asrflow"
    for name, module in list(sys.modules.items()):
        source = getattr(module, "__file__", None)
        copied = source is not None and not Path(source).resolve().is_relative_to(here)
        if name.split(".")[0] == "asrflow" and name not in ours and copied:
            del sys.modules[name]  # loaded from the model's copy
    sys.modules.update(ours)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def yesno_data(tmp_path_factory) -> Path:
    """The shipped yesno corpus prepared once per session: ``manifests/``, ``fbank/`` and ``lang/``."""
    return prepare_yesno(tmp_path_factory.mktemp("yesno"))


@pytest.fixture(scope="session")
def yesno_model(yesno_data: Path, tmp_path_factory) -> Path:
    """Path of a model bundle trained on the yesno train split that transcribes its dev split, trained once
    per session (:func:`tests.support.trained_model.train_yesno_model`)."""
    try:
        return train_yesno_model(yesno_data, tmp_path_factory.mktemp("yesno_model"))
    except NoYesnoModel as error:
        pytest.fail(str(error), pytrace=False)
