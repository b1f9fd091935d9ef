"""Empty MLflow SQLite stores for tests, copied from one template made per process."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from asrflow.tracking.store import create_whole_sqlite_store

_TEMPLATE_DB: Path | None = None


def fresh_mlflow_store(directory: Path) -> str:
    """``sqlite:///<directory>/mlflow.db``: an empty MLflow store with its schema already made.

    Creating the schema (MLflow's migrations) takes seconds, so it is done once per process.
    """
    global _TEMPLATE_DB
    if _TEMPLATE_DB is None or not _TEMPLATE_DB.is_file():
        os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
        folder = tempfile.mkdtemp(prefix="asrflow-mlflow-template-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        template = Path(folder) / "mlflow.db"
        create_whole_sqlite_store(f"sqlite:///{template}")
        _TEMPLATE_DB = template
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_TEMPLATE_DB, directory / "mlflow.db")
    return f"sqlite:///{(directory / 'mlflow.db').resolve()}"
