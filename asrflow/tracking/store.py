"""Where runs are stored and browsed: tracking URIs, their check before any work, a new SQLite store made whole,
the UI's runs page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from asrflow.errors import AsrflowError, first_line

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"  # MLflow 3's default
_SQLITE = "sqlite:///"
#: Child processes making a missing SQLite store whole, by the store's resolved path.
_BUILDERS: dict[Path, subprocess.Popen] = {}


def default_tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else MLflow 3's default ``sqlite:///mlflow.db``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (relative to the cwd unless it starts with ``/``), or None."""
    database = tracking_uri.removeprefix(_SQLITE).partition("?")[0] if tracking_uri.startswith(_SQLITE) else ""
    return Path(database) if database and database != ":memory:" and not database.startswith("file:") else None


def resolve_tracking_uri(tracking_uri: str) -> str:
    """A relative ``sqlite:`` URI made absolute (MLflow caches a store per URI string) against ``$DVC_ROOT`` (the
    repository's root, also in a queued experiment's temporary copy), else the cwd; other URIs unchanged."""
    db = sqlite_path(tracking_uri)
    if db is None or db.is_absolute():
        return tracking_uri
    query = tracking_uri.partition("?")[2]
    return f"{_SQLITE}{(Path(os.environ.get('DVC_ROOT') or '.') / db).resolve()}" + (f"?{query}" if query else "")


def default_artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """``file://`` URI of ``mlartifacts/<experiment>`` beside a SQLite store; None leaves it to MLflow."""
    db = sqlite_path(tracking_uri)
    if db is None:
        return None
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", experiment).strip("._") or "experiment"
    return (db.resolve().parent / "mlartifacts" / slug).as_uri()


def check_tracking_uri(tracking_uri: str | None = None) -> str:
    """The resolved URI of a usable store, checked before any work: a server must answer (any HTTP status), a
    SQLite store's folder must be creatable; else :class:`AsrflowError` naming the URI and the local fallback."""
    from_env = tracking_uri is None and bool(os.environ.get("MLFLOW_TRACKING_URI"))
    uri = resolve_tracking_uri(tracking_uri or default_tracking_uri())
    origin = " (from MLFLOW_TRACKING_URI)" if from_env else ""
    if uri.startswith(("http://", "https://")):
        try:
            probe = uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1"
            urllib.request.urlopen(probe, timeout=10).close()
        except urllib.error.HTTPError:
            pass  # it answered: authentication and the like are MLflow's to report
        except (urllib.error.URLError, OSError) as error:
            raise AsrflowError(
                f"MLflow tracking server {uri}{origin} cannot be reached ({getattr(error, 'reason', error)}): "
                f"start the server, or unset MLFLOW_TRACKING_URI to log to the local store {DEFAULT_TRACKING_URI} "
                f"(browse it with `mlflow ui --backend-store-uri {DEFAULT_TRACKING_URI}`)"
            ) from None
    elif (db := sqlite_path(uri)) is not None:
        try:
            db.resolve().parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise AsrflowError(
                f"MLflow store {uri}{origin}: cannot create its folder ({error.strerror}); "
                f"use a writable path, or unset MLFLOW_TRACKING_URI to use {DEFAULT_TRACKING_URI}"
            ) from None
    return uri


def create_whole_sqlite_store(tracking_uri: str) -> None:
    """Create a ``sqlite:///`` store that does not exist yet all at once, so no process ever opens a half-made one.

    MLflow builds a new store's tables in place with one migration after another, and SQLite's DDL under them is
    not transactional: a process stopped part-way (a Slurm time limit, a kill) leaves a file that no later run can
    open ("table ... already exists", mlflow/mlflow#23721). Here MLflow builds them in a hidden file beside the
    store, which is then hard-linked into place; if another process linked its own first, that one is kept. A
    process killed while building leaves only its hidden ``.building`` file behind. Other URIs and existing
    stores are left as they are.
    """
    db = sqlite_path(tracking_uri)
    if db is not None and (builder := _BUILDERS.pop(db.resolve(), None)) is not None:
        builder.wait()  # if it failed, the store is still missing: made below, where its error shows
    if db is None or db.exists():
        return
    from mlflow.store.tracking import DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    folder = db.resolve().parent
    folder.mkdir(parents=True, exist_ok=True)
    building = folder / f".{db.name}.{uuid.uuid4().hex}.building"  # SQLite creates it, with the umask's mode
    try:
        SqlAlchemyStore(f"{_SQLITE}{building}", DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH).engine.dispose()
        try:
            os.link(building, db)
        except FileExistsError:
            pass  # another process's store came first, made whole the same way
        except OSError:  # a filesystem without hard links: a rename, which could replace a store made meanwhile
            if not db.exists():
                os.replace(building, db)
    finally:
        building.unlink(missing_ok=True)


def build_store_in_background(tracking_uri: str | None = None) -> subprocess.Popen | None:
    """Start making a missing SQLite store whole (:func:`create_whole_sqlite_store`) in a child process; that
    function waits for it. The child, or None for another URI, a store that exists, or one already being made.

    A new store's migrations hold the Python interpreter for seconds. Run in the training process, beside a loop
    that launches GPU kernels, they would hold its GIL: the loop's steps then wait for it. The child is left to
    finish when its parent dies, so that the store is made whole.
    """
    db = sqlite_path(resolve_tracking_uri(tracking_uri or default_tracking_uri()))
    if db is None or db.exists() or (db := db.resolve()) in _BUILDERS:
        return None
    command = [sys.executable, "-m", "asrflow.tracking.store", f"{_SQLITE}{db}"]
    _BUILDERS[db] = builder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return builder


def store_error(tracking_uri: str, error: BaseException) -> AsrflowError:
    """What to do about a SQLite store that MLflow cannot open: ``error`` named, and the two usual causes."""
    db = sqlite_path(tracking_uri)
    return AsrflowError(
        f"MLflow cannot open the store {db} ({first_line(error)}). If it holds no runs, it was left half-made by a "
        f"process stopped while creating it (mlflow/mlflow#23721): move {db} aside and run again. If it holds "
        f"runs, back it up and run `mlflow db upgrade {tracking_uri}`"
    )


def runs_page(tracking_uri: str, experiment_id: str) -> str:
    """The UI's page of an experiment's runs: a server's own, else ``mlflow ui``'s and the command that serves it."""
    server = tracking_uri.startswith(("http://", "https://"))
    base = tracking_uri.rstrip("/") if server else "http://127.0.0.1:5000"
    hint = "" if server else f" after `mlflow ui --backend-store-uri {tracking_uri}`"
    return (
        f"{base}/#/experiments/{experiment_id}/runs{hint} (a fresh browser may open the GenAI view: "
        "switch it to model training at the top of the page)"
    )


if __name__ == "__main__":
    create_whole_sqlite_store(sys.argv[1])
