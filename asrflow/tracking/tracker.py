"""Experiment tracking: the one module of asrflow that talks to MLflow.

Usage from the training loop::

    tracker = RunTracker.start_training(all_params, {"train": train_cuts, "dev": dev_cuts},
                                        experiment="asrflow", run_id=ckpt_run_id_or_None)
    if ckpt_state is None:
        tracker.log_params(flatten(all_params))       # a new run only
    else:
        tracker.load_state_dict(ckpt_state)             # a resumed run
    tracker.record(step, {"train/loss": 1.2, "train/lr": 1e-3})   # buffered in memory
    checkpoint["tracker"] = tracker.state_dict()        # plain python types
    save(checkpoint)                                    # durably written ...
    tracker.flush()                                     # ... then the buffer goes to MLflow
    tracker.log_model("exp/model.pt", registered_model_name=None, step=step)  # the MLflow model
    tracker.end("FINISHED")

Store
    :func:`default_tracking_uri` is ``$MLFLOW_TRACKING_URI`` or MLflow 3's own default,
    ``sqlite:///mlflow.db`` in the current directory. For a SQLite store, an experiment
    created here gets its artifact location in ``mlartifacts/<experiment>`` beside the
    database file, as an absolute ``file://`` URI, so ``mlflow ui`` started in that
    directory (or anywhere else on the machine) lists and serves the artifacts.

Start-up
    MLflow is imported where it is used, not by this module. The training loop uses
    :class:`asrflow.tracking.background.BackgroundTracker`, which opens its
    :class:`RunTracker` in a thread after the first step and replays the calls made before,
    in order (see its docstring).

Crash safety (exactly one point per metric and step, in one MLflow run)
    Points are buffered by :meth:`RunTracker.record` and travel inside the checkpoint
    (:meth:`RunTracker.state_dict`, with their original timestamps); :meth:`RunTracker.flush`
    runs only after the checkpoint is on disk. A flush writes the points in
    ``log_batch`` calls of at most 1,000 metrics each, and only after all of them have
    been committed does it raise the run tag ``asrflow.logged_through_step`` to the
    highest step written. MLflow 3's SQLAlchemy store does *not* commit a whole
    ``log_batch`` in one transaction (params, metrics and tags are three commits, and
    ``MlflowClient.log_batch`` puts the tags into its *first* chunk), but the metrics of one
    store call are one commit; so the tag is written in a call of its own, last, and it
    never claims points that are not in the store. On resume,
    :meth:`RunTracker.load_state_dict` drops the checkpoint's pending points at or below
    the tag; any above it (a crash during the flush) are checked against the run's metric
    history and only the missing ones are written. If the store holds points past the
    checkpoint (a previous attempt flushed and died later), the re-recorded copies of those
    ``(metric, step)`` pairs are dropped by :meth:`RunTracker.record`. Steps must be the
    global training step and must not go backwards, except through a rollback.

Rollback (the same process goes back to the checkpoint of step ``s``)
    Call :meth:`RunTracker.discard_after` with ``s`` (the abandoned steps' buffered points
    are dropped), then :meth:`RunTracker.load_state_dict` with that checkpoint's state, as a
    resume does: points of the abandoned steps that were already flushed stay in the store,
    and the retried steps' copies of them are dropped. Every step keeps exactly one point.

Unreachable store
    :func:`check_tracking_uri` (called by :meth:`RunTracker.start`) refuses a tracking
    server that does not answer, naming the URI and the local fallback, before any work.
    A server that goes away *during* a run does not stop training: :meth:`RunTracker.flush`
    keeps the points it could not send (they are in the checkpoints too) and sends them at
    the next flush once the server answers again.

What the UI shows
    The experiment is tagged ``mlflow.experimentKind = custom_model_development``, so MLflow
    3's UI opens it in its model-training view. :func:`run_name` and :func:`run_tags` name a
    run after the DVC experiment or the params that differ from the committed params.yaml,
    and tag it with the pipeline tool and a params digest; :meth:`RunTracker.log_datasets`
    logs the manifests as dataset inputs (and the data digest tag);
    ``RunTracker.start(system_metrics=True)`` runs MLflow's own system-metrics monitor
    (CPU, memory, disk, network, and GPU when ``nvidia-ml-py`` finds one).

Reopening
    ``RunTracker.start(run_id=...)`` continues that run: a RUNNING/FAILED/KILLED run is
    set RUNNING again (training resumes); a FINISHED run stays FINISHED while evaluate adds
    metrics and artifacts, and :meth:`RunTracker.end` leaves it FINISHED (a failed
    evaluation is recorded in the tag ``asrflow.reopened_end_status``).
"""

from __future__ import annotations

import getpass
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asrflow.errors import AsrflowError, first_line

# Set before MLflow (and GitPython, which MLflow imports) is loaded: no warning when git is
# missing, no telemetry attempts from a machine without network.
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# A tracking server that is down must not hold a training step for minutes (MLflow's
# default is 7 retries with exponential backoff): a few quick retries, then the points wait
# in the buffer for the next flush.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")

if TYPE_CHECKING:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

# MLflow itself (about 2 s of imports) is imported where it is used, so that importing this
# module costs nothing on the train stage's way to its first step (see BackgroundTracker).
#: MLflow's limits (``mlflow.utils.validation``; a test checks they agree).
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_VAL_LENGTH = 6000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_TAG_VAL_LENGTH = 8000


def _store_errors() -> tuple[type[BaseException], ...]:
    """What a store call raises when the store cannot be used: MLflow's exception and OSError."""
    from mlflow.exceptions import MlflowException

    return (MlflowException, OSError)


log = logging.getLogger(__name__)

# Table creation and migrations of a fresh SQLite store log several INFO lines per process.
for _name in ("alembic", "mlflow.store.db.utils"):
    logging.getLogger(_name).setLevel(logging.WARNING)

#: MLflow 3's default tracking store.
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
#: Folder beside a SQLite store that holds the artifacts of experiments created here.
ARTIFACTS_DIRNAME = "mlartifacts"
#: Run tag: every point with a step at or below this value is in the store.
LOGGED_THROUGH_TAG = "asrflow.logged_through_step"
#: Run tag: the status :meth:`RunTracker.end` was given on a reopened FINISHED run.
REOPENED_END_STATUS_TAG = "asrflow.reopened_end_status"
#: Experiment tag MLflow 3's UI reads to pick its view, and the value of the model-training view.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
#: Run tag: the tool that ran the stage: ``snakemake``, ``dvc`` or ``direct``.
PIPELINE_TAG = "asrflow.pipeline"
#: Run tag: digest of the run's (flattened) params.
PARAMS_DIGEST_TAG = "asrflow.params_digest"
#: Run tag: digest of the train and dev manifests (see :meth:`RunTracker.log_datasets`).
DATA_DIGEST_TAG = "asrflow.data_digest"
#: Run tag: a key drawn when a run is opened in the background (:class:`BackgroundTracker`): the
#: step-0 checkpoint holds it before the run id is known, and a resume finds the run by it.
RUN_KEY_TAG = "asrflow.run_key"
#: Run tag: the DVC experiment that ran the stage (``dvc exp run``).
DVC_EXP_TAG = "asrflow.dvc_experiment"
#: Environment variable the Snakemake rules set to ``snakemake`` (see :func:`pipeline_tool`).
PIPELINE_ENV = "ASRFLOW_PIPELINE"
#: Dataset input tag MLflow's UI shows as the dataset's context.
DATASET_CONTEXT_TAG = "mlflow.data.context"
#: Longest run name made from params differences.
MAX_RUN_NAME_CHARS = 80
#: Seconds to wait for a tracking server's answer in :func:`check_tracking_uri`.
PROBE_TIMEOUT_S = 10.0
STATE_VERSION = 1
_END_STATUSES = ("FINISHED", "FAILED", "KILLED")
_TRUNCATED = "...[truncated]"


def default_tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI`` if set, else MLflow 3's default ``sqlite:///mlflow.db``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a ``sqlite:`` tracking URI (relative to the cwd if relative)."""
    if not tracking_uri.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url

    database = make_url(tracking_uri).database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


def resolve_tracking_uri(tracking_uri: str) -> str:
    """Make a relative ``sqlite:`` URI absolute (against the cwd); other URIs unchanged.

    MLflow caches one store per URI string for the whole process, so a relative
    ``sqlite:///mlflow.db`` would keep writing to the first directory it was opened in.
    """
    db = sqlite_path(tracking_uri)
    if db is None or db.is_absolute():
        return tracking_uri
    from sqlalchemy.engine import make_url

    return make_url(tracking_uri).set(database=str(db.resolve())).render_as_string(hide_password=False)


def default_artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """``file://`` URI of ``mlartifacts/<experiment>`` beside a SQLite store, else None.

    None leaves the choice to MLflow (a tracking server decides for itself).
    """
    db = sqlite_path(tracking_uri)
    if db is None:
        return None
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", experiment).strip("._") or "experiment"
    return (db.resolve().parent / ARTIFACTS_DIRNAME / slug).as_uri()


def param_value(value: Any) -> str:
    """Render one param value as MLflow stores it: JSON-like, at most 6,000 characters.

    ``None -> "null"``, ``True -> "true"``, lists as JSON; strings as they are.
    """
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


def _chunks(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def now_ms() -> int:
    return int(time.time() * 1000)


def _git_commit() -> str | None:
    """The current git commit, or None; never prints anything."""
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = result.stdout.strip()
    return commit if result.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", commit) else None


def check_tracking_uri(tracking_uri: str | None = None) -> str:
    """Refuse a tracking store that cannot be used, before any work; returns the resolved URI.

    An ``http(s)://`` server must answer (any HTTP status counts) within
    :data:`PROBE_TIMEOUT_S`; a SQLite store's folder must be creatable. Raises
    :class:`AsrflowError` naming the URI and how to fall back to the local store.
    """
    from_env = tracking_uri is None and bool(os.environ.get("MLFLOW_TRACKING_URI"))
    uri = resolve_tracking_uri(tracking_uri or default_tracking_uri())
    origin = " (from MLFLOW_TRACKING_URI)" if from_env else ""
    fallback = (
        f"start the server, or unset MLFLOW_TRACKING_URI to log to the local store {DEFAULT_TRACKING_URI} "
        f"(browse it with `mlflow ui --backend-store-uri {DEFAULT_TRACKING_URI}`)"
    )
    if uri.startswith(("http://", "https://")):
        probe = uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1"
        try:
            with urllib.request.urlopen(probe, timeout=PROBE_TIMEOUT_S):
                pass
        except urllib.error.HTTPError:
            pass  # it answered: authentication and the like are MLflow's to report
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise AsrflowError(
                f"MLflow tracking server {uri}{origin} cannot be reached ({reason}): {fallback}"
            ) from None
        return uri
    db = sqlite_path(uri)
    if db is not None:
        try:
            db.resolve().parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise AsrflowError(
                f"MLflow store {uri}{origin}: cannot create its folder ({error.strerror}); "
                f"use a writable path, or unset MLFLOW_TRACKING_URI to use {DEFAULT_TRACKING_URI}"
            ) from None
    return uri


def _ui_hint(uri: str) -> str:
    """How to browse a store: `` (browse: mlflow ui --backend-store-uri ...)`` for SQLite."""
    return f" (browse: mlflow ui --backend-store-uri {uri})" if sqlite_path(uri) is not None else ""


def pipeline_tool() -> str:
    """Which tool ran this stage: ``snakemake`` (its rules set ``ASRFLOW_PIPELINE``), ``dvc``
    (it sets ``DVC_STAGE`` for every command), or ``direct``."""
    if os.environ.get(PIPELINE_ENV):
        return os.environ[PIPELINE_ENV]
    if os.environ.get("DVC_STAGE") or os.environ.get("DVC_EXP_NAME"):
        return "dvc"
    return "direct"


def params_digest(params: Mapping[str, Any]) -> str:
    """First 8 hex characters of the SHA-256 of the flattened params (keys sorted)."""
    from asrflow.params import flatten

    flat = {key: param_value(value) for key, value in flatten(dict(params)).items()}
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()[:8]


def committed_params(path: str | os.PathLike = "params.yaml") -> dict | None:
    """``path`` as committed in git's HEAD (the defaults a run is compared with), or None."""
    import yaml

    try:
        result = subprocess.run(
            ["git", "show", f"HEAD:./{Path(path).name}"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
            cwd=Path(path).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    try:
        loaded = yaml.safe_load(result.stdout)
    except yaml.YAMLError:
        return None
    return loaded if isinstance(loaded, dict) else None


def run_name(params: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> str:
    """A run name a person can tell apart from the others.

    ``$DVC_EXP_NAME`` under ``dvc exp run``; else the params that differ from ``defaults``
    (e.g. the committed params.yaml, :func:`committed_params`) as ``train.lr=0.001
    train.epochs=60``, cut at :data:`MAX_RUN_NAME_CHARS` with ``+N more``; else
    ``defaults-<digest>`` (nothing differs) or ``params-<digest>`` (no defaults known).
    """
    if os.environ.get("DVC_EXP_NAME"):
        return os.environ["DVC_EXP_NAME"]
    digest = params_digest(params)
    if defaults is None:
        return f"params-{digest}"
    from asrflow.params import flatten

    now, before = flatten(dict(params)), flatten(dict(defaults))
    changed = [
        f"{key}={param_value(now[key]) if key in now else '(unset)'}"
        for key in sorted(set(now) | set(before))
        if param_value(now.get(key)) != param_value(before.get(key)) or (key in now) != (key in before)
    ]
    if not changed:
        return f"defaults-{digest}"
    name = ""
    for count, item in enumerate(changed):
        rest = len(changed) - count
        candidate = f"{name} {item}".strip()
        if len(candidate) > MAX_RUN_NAME_CHARS and count:
            return f"{name} +{rest} more"
        name = candidate
    return name


def run_tags(params: Mapping[str, Any]) -> dict[str, str]:
    """Tags of a new run: the pipeline tool, the params digest and, under ``dvc exp run``, the
    experiment name. (:meth:`RunTracker.start` adds the git commit; :meth:`RunTracker.log_datasets`
    the data digest.)"""
    tags = {PIPELINE_TAG: pipeline_tool(), PARAMS_DIGEST_TAG: params_digest(params)}
    if os.environ.get("DVC_EXP_NAME"):
        tags[DVC_EXP_TAG] = os.environ["DVC_EXP_NAME"]
    return tags


class RunTracker:
    """One MLflow run, fed by the training loop (buffered) or by evaluate (direct).

    Create with :meth:`start`. The tracker buffers metric points in memory until
    :meth:`flush`; :meth:`state_dict`/:meth:`load_state_dict` carry the buffer through a
    checkpoint so that a resumed run has every step exactly once (see the module docstring).
    """

    #: Most metrics per ``log_batch`` call (MLflow's limit is 1,000).
    max_metrics_per_batch = MAX_METRICS_PER_BATCH

    def __init__(
        self,
        client: MlflowClient,
        run_id: str,
        *,
        tracking_uri: str,
        experiment_id: str,
        logged_through: int,
        reopened_finished: bool = False,
        replaces_run_id: str | None = None,
    ) -> None:
        self._client = client
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.experiment_id = experiment_id
        self._logged_through = logged_through
        self._reopened_finished = reopened_finished
        self._replaces_run_id = replaces_run_id
        self._pending: list[tuple[str, int, float, int]] = []  # (key, step, value, timestamp ms)
        self._recorded_through = -1
        self._written_through = -1
        self._skip: set[tuple[str, int]] = set()
        self._ended = False
        self._monitor = None  # MLflow's SystemMetricsMonitor, when started
        self._store_down = False  # the last flush could not reach the store

    # ------------------------------------------------------------------ opening
    @classmethod
    def start(
        cls,
        experiment: str = "asrflow",
        run_id: str | None = None,
        run_name: str | None = None,
        tracking_uri: str | None = None,
        *,
        tags: Mapping[str, Any] | None = None,
        create_if_missing: bool = False,
        system_metrics: bool = False,
        system_metrics_interval_s: float = 10.0,
    ) -> RunTracker:
        """Open a new run in ``experiment``, or continue run ``run_id``.

        Args:
            experiment: experiment name; created (with its artifact folder) if needed.
            run_id: an existing run to continue (from a checkpoint or a model bundle), or
                None for a new run.
            run_name: display name of a new run.
            tracking_uri: the store; None means :func:`default_tracking_uri`.
            tags: extra tags for the run.
            create_if_missing: if ``run_id`` is not in the store, start a new run (tagged
                ``asrflow.replaces_run_id``) instead of raising :class:`AsrflowError`.
            system_metrics: sample CPU, memory, disk, network (and GPU) every
                ``system_metrics_interval_s`` with MLflow's own monitor, as ``system/*``
                metrics of the run, until :meth:`end`. A continued run goes on from its
                last system-metrics step.

        Raises :class:`AsrflowError` when the store cannot be reached (:func:`check_tracking_uri`).
        """
        from mlflow.tracking import MlflowClient

        uri = check_tracking_uri(tracking_uri)
        client = MlflowClient(tracking_uri=uri)
        extra_tags = {str(k): str(v) for k, v in (tags or {}).items()}

        if run_id is not None:
            run = cls._get_run(client, run_id, uri)
            if run is not None:
                if run.info.lifecycle_stage != "active":
                    raise AsrflowError(
                        f"MLflow run {run_id} is deleted in {uri}: restore it "
                        f"(`mlflow runs restore --run-id {run_id}`) or start training afresh"
                    )
                finished = run.info.status == "FINISHED"
                if not finished:
                    client.update_run(run_id, status="RUNNING")
                tracker = cls(
                    client,
                    run_id,
                    tracking_uri=uri,
                    experiment_id=run.info.experiment_id,
                    logged_through=cls._tag_step(run.data.tags.get(LOGGED_THROUGH_TAG)),
                    reopened_finished=finished,
                )
                if extra_tags:
                    tracker.set_tags(extra_tags)
                log.info("continuing MLflow run %s in %s", run_id, uri, extra={"terminal": True})
                if system_metrics and not finished:
                    tracker.start_system_metrics(system_metrics_interval_s, resume=True)
                return tracker
            if not create_if_missing:
                raise AsrflowError(
                    f"MLflow run {run_id} is not in the tracking store {uri}: set "
                    "MLFLOW_TRACKING_URI to the store that holds it, or delete the "
                    "checkpoints to start a new run"
                )
            log.warning("MLflow run %s is not in %s; starting a new run", run_id, uri)
            extra_tags["asrflow.replaces_run_id"] = run_id

        experiment_id = cls._experiment_id(client, experiment, uri)
        run_tags = {
            "mlflow.user": getpass.getuser(),
            "mlflow.source.name": Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python",
            "mlflow.source.type": "LOCAL",
        }
        commit = _git_commit()
        if commit:
            run_tags["mlflow.source.git.commit"] = commit
        run_tags.update(extra_tags)
        run = client.create_run(experiment_id, tags=run_tags, run_name=run_name)
        log.info(
            "started MLflow run %s (%s) in %s%s",
            run.info.run_id,
            run.info.run_name,
            uri,
            _ui_hint(uri),
            extra={"terminal": True},
        )
        tracker = cls(
            client,
            run.info.run_id,
            tracking_uri=uri,
            experiment_id=experiment_id,
            logged_through=-1,
            replaces_run_id=run_id,
        )
        if system_metrics:
            tracker.start_system_metrics(system_metrics_interval_s)
        return tracker

    @classmethod
    def start_training(
        cls,
        params: Mapping[str, Any],
        manifests: Mapping[str, Any],
        *,
        experiment: str = "asrflow",
        run_id: str | None = None,
        tracking_uri: str | None = None,
        params_path: str | os.PathLike = "params.yaml",
        system_metrics: bool = True,
        system_metrics_interval_s: float = 10.0,
    ) -> RunTracker:
        """:meth:`start` for the training loop, with everything the UI shows of a training run.

        A new run (``run_id`` None) is named by :func:`run_name` (against the committed
        ``params_path``) and tagged by :func:`run_tags`; a continued run keeps its name and
        tags. MLflow's system metrics run until :meth:`end`. ``manifests`` (context ->
        ``<split>_cuts.jsonl.gz``, e.g. ``{"train": ..., "dev": ...}``) are logged by
        :meth:`log_datasets` (a continued run gets nothing twice). Params are not logged here:
        call :meth:`log_params` for a new run, :meth:`load_state_dict` for a resumed one.
        """
        tracker = cls.start(
            experiment,
            run_id,
            run_name(params, committed_params(params_path)),
            tracking_uri,
            tags=run_tags(params) if run_id is None else None,
            system_metrics=system_metrics,
            system_metrics_interval_s=system_metrics_interval_s,
        )
        try:
            tracker.log_datasets(manifests)
        except BaseException:
            tracker.end("FAILED")
            raise
        return tracker

    @staticmethod
    def _get_run(client: MlflowClient, run_id: str, uri: str):
        from mlflow.exceptions import MlflowException

        try:
            return client.get_run(run_id)
        except MlflowException as error:
            if error.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise

    @staticmethod
    def _experiment_id(client: MlflowClient, name: str, uri: str) -> str:
        from mlflow.exceptions import MlflowException

        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            location = default_artifact_location(uri, name)
            try:
                return client.create_experiment(
                    name, artifact_location=location, tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND}
                )
            except MlflowException:
                # Another process created it in the meantime.
                experiment = client.get_experiment_by_name(name)
                if experiment is None:
                    raise
        if experiment.lifecycle_stage != "active":
            raise AsrflowError(
                f"MLflow experiment {name!r} is deleted in {uri}: restore it "
                f"(`mlflow experiments restore --experiment-id {experiment.experiment_id}`) "
                "or choose another experiment name"
            )
        if EXPERIMENT_KIND_TAG not in experiment.tags:  # a kind the user chose stays
            client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return experiment.experiment_id

    @staticmethod
    def _tag_step(value: str | None) -> int:
        try:
            return int(value) if value is not None else -1
        except ValueError:
            return -1

    # ------------------------------------------------------------------ properties
    @property
    def logged_through_step(self) -> int:
        """Highest step whose points are all in the store (-1: none yet)."""
        return self._logged_through

    @property
    def pending(self) -> int:
        """Number of buffered points not yet flushed."""
        return len(self._pending)

    @property
    def artifact_uri(self) -> str:
        """Where this run's artifacts go."""
        return self._client.get_run(self.run_id).info.artifact_uri

    # ------------------------------------------------------------------ params and tags
    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log params (already flat, e.g. from :func:`asrflow.params.flatten`).

        Any number of params (written 100 per call); values rendered by
        :func:`param_value`. Params the run already has with the same value are skipped;
        a different value raises :class:`AsrflowError` (MLflow params cannot change).
        """
        from mlflow.entities import Param

        rendered = {str(key): param_value(value) for key, value in params.items()}
        existing = self._client.get_run(self.run_id).data.params
        changed = [key for key, value in rendered.items() if key in existing and existing[key] != value]
        if changed:
            details = ", ".join(f"{key}: {existing[key]!r} -> {rendered[key]!r}" for key in changed[:5])
            raise AsrflowError(
                f"MLflow run {self.run_id} already has different values for {len(changed)} "
                f"param(s) ({details}); a run's params cannot change: start a new run "
                "(delete the checkpoints) or restore the old params"
            )
        new = [Param(key, value) for key, value in rendered.items() if key not in existing]
        for chunk in _chunks(new, MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, params=chunk)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set run tags (values as strings, cut at MLflow's 8,000 characters)."""
        from mlflow.entities import RunTag

        items = [RunTag(str(k), str(v)[:MAX_TAG_VAL_LENGTH]) for k, v in tags.items()]
        for chunk in _chunks(items, MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, tags=chunk)

    # ------------------------------------------------------------------ metrics
    def record(self, step: int, metrics: Mapping[str, Any], *, timestamp_ms: int | None = None) -> None:
        """Buffer one point per metric at ``step`` (global training step, never decreasing).

        Values are converted with ``float()`` (0-d tensors work); None values are skipped.
        ``timestamp_ms`` (Unix milliseconds) is when they were measured (default: now).
        Nothing reaches MLflow until :meth:`flush`.
        """
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        timestamp = now_ms() if timestamp_ms is None else int(timestamp_ms)
        for key, value in metrics.items():
            if value is None or (key, step) in self._skip:
                continue
            self._pending.append((str(key), step, float(value), timestamp))
        self._recorded_through = max(self._recorded_through, step)

    def flush(self) -> bool:
        """Write the buffered points, then advance ``asrflow.logged_through_step``.

        Call it right after a checkpoint holding :meth:`state_dict` is durably written,
        and at the end. A chunk that has been written leaves the buffer at once, so a flush
        that failed half-way can simply be called again.

        When the store cannot be reached (a tracking server that went away), the points
        stay in the buffer (and so in the next checkpoints), one warning says so, and the
        next flush sends them: returns False then, True when everything was written.
        """
        try:
            self._flush()
        except _store_errors() as error:
            if not self._store_down:
                log.warning(
                    "MLflow store %s cannot be reached (%s); training goes on, and the %d metric points "
                    "kept are sent at the next flush once it is back",
                    self.tracking_uri,
                    first_line(error),
                    len(self._pending),
                )
            self._store_down = True
            return False
        if self._store_down:
            log.warning("MLflow store %s is reachable again: buffered points sent", self.tracking_uri)
            self._store_down = False
        return True

    def _flush(self) -> None:
        from mlflow.entities import Metric

        while self._pending:  # in step order, so every chunk written covers the steps before it
            chunk = self._pending[: self.max_metrics_per_batch]
            self._write_metrics([Metric(key, value, ts, step) for key, step, value, ts in chunk])
            del self._pending[: len(chunk)]
            self._written_through = max(self._written_through, max(point[1] for point in chunk))
        if self._written_through > self._logged_through:
            self._write_watermark(self._written_through)

    def discard_after(self, step: int) -> int:
        """Drop the buffered points of steps after ``step``; returns how many were dropped.

        For a rollback to the checkpoint of ``step``: the abandoned steps are trained again
        and re-recorded, so their first points must never reach the store. Call it before
        :meth:`load_state_dict` with that checkpoint's tracker state.
        """
        step = int(step)
        kept = [point for point in self._pending if point[1] <= step]
        dropped = len(self._pending) - len(kept)
        self._pending = kept
        self._recorded_through = min(self._recorded_through, step)
        return dropped

    def _write_metrics(self, metrics: list[Metric]) -> None:
        """One store call, one commit: at most ``max_metrics_per_batch`` metrics."""
        self._client.log_batch(self.run_id, metrics=metrics)

    def _write_watermark(self, step: int) -> None:
        """Set ``asrflow.logged_through_step``: only once every point up to ``step`` is stored."""
        from mlflow.entities import RunTag

        self._client.log_batch(self.run_id, tags=[RunTag(LOGGED_THROUGH_TAG, str(step))])
        self._logged_through = step

    def log_metrics(
        self,
        metrics: Mapping[str, Any],
        step: int = 0,
        *,
        model_id: str | None = None,
        dataset: Any | None = None,
    ) -> None:
        """Write metrics now, bypassing the buffer (for evaluate; not for the training loop).

        ``model_id`` attaches them to a logged model (its page shows them), ``dataset`` (an
        MLflow dataset, e.g. :class:`asrflow.tracking.datasets.ManifestDataset`) says what they
        were measured on.
        """
        from mlflow.entities import Metric

        timestamp = now_ms()
        points = [
            Metric(
                str(key),
                float(value),
                timestamp,
                int(step),
                model_id=model_id,
                dataset_name=dataset.name if dataset is not None else None,
                dataset_digest=dataset.digest if dataset is not None else None,
            )
            for key, value in metrics.items()
            if value is not None
        ]
        for chunk in _chunks(points, self.max_metrics_per_batch):
            self._write_metrics(chunk)

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        """The run id and the unflushed points, as plain python types for a checkpoint."""
        return {
            "version": STATE_VERSION,
            "run_id": self.run_id,
            "recorded_through": self._recorded_through,
            "pending": [[key, step, value, ts] for key, step, value, ts in self._pending],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from a checkpoint's :meth:`state_dict` and write what the store lacks.

        Pending points at or below the run's ``asrflow.logged_through_step`` are already
        stored and dropped; those above it are checked against the metric history, and
        only missing ones are written. Points the store holds past the checkpoint are
        remembered, and :meth:`record` drops their re-recorded copies.
        """
        if state.get("version") != STATE_VERSION:
            raise AsrflowError(
                f"tracking state in the checkpoint has version {state.get('version')!r}, "
                f"expected {STATE_VERSION}: delete the checkpoints to start a new run"
            )
        # run_id None: a checkpoint taken before the run was open (BackgroundTracker), which holds no points.
        if state.get("run_id") not in (self.run_id, self._replaces_run_id, None):
            raise AsrflowError(
                f"the checkpoint belongs to MLflow run {state.get('run_id')}, but this tracker "
                f"has run {self.run_id}: start the tracker with run_id=state['run_id']"
            )
        recorded_through = int(state.get("recorded_through", -1))
        pending = [(str(key), int(step), float(value), int(ts)) for key, step, value, ts in state["pending"]]
        self._recorded_through = max(self._recorded_through, recorded_through)
        through = self._logged_through
        unsure = [point for point in pending if point[1] > through]
        low, high = min(through, recorded_through), max(through, recorded_through)
        existing: set[tuple[str, int]] = set()
        if unsure or through > recorded_through:
            keys = set(self._client.get_run(self.run_id).data.metrics) | {p[0] for p in unsure}
            existing = self._existing_points(keys, low, high)
        self._pending = [p for p in unsure if (p[0], p[1]) not in existing] + self._pending
        if unsure:
            log.info(
                "re-writing %d of %d checkpointed metric points to MLflow run %s",
                len(self._pending),
                len(unsure),
                self.run_id,
            )
        self.flush()
        if self._logged_through < recorded_through:  # a flush died before its tag: set it now
            self._write_watermark(recorded_through)
        self._skip = {(key, step) for key, step in existing if step > recorded_through}

    def _existing_points(self, keys: Iterable[str], low: int, high: int) -> set[tuple[str, int]]:
        """``(key, step)`` pairs in the store with ``low < step <= high``."""
        found: set[tuple[str, int]] = set()
        for key in keys:
            for metric in self._client.get_metric_history(self.run_id, key):
                if low < metric.step <= high:
                    found.add((key, metric.step))
        return found

    # ------------------------------------------------------------------ datasets, models, system metrics
    def log_datasets(self, manifests: Mapping[str, Any]) -> dict[str, Any]:
        """Log cut manifests as the run's dataset inputs, one per context.

        Args:
            manifests: context (``train``, ``dev``, ``test``) -> a ``<split>_cuts.jsonl.gz``
                path or a :class:`asrflow.tracking.datasets.ManifestDataset`.

        Each gets its digest, source and profile (utterances, hours); a dataset already
        logged with that context is not logged again (so a resumed run may call this
        again). The train and dev digests give the run tag ``asrflow.data_digest``.
        Returns context -> ManifestDataset.
        """
        from mlflow.entities import DatasetInput, InputTag

        from asrflow.tracking.datasets import ManifestDataset, combined_digest

        datasets = {
            context: item if isinstance(item, ManifestDataset) else ManifestDataset(item, name=context)
            for context, item in manifests.items()
        }
        run = self._client.get_run(self.run_id)
        logged = {
            (item.dataset.name, item.dataset.digest, tag.value)
            for item in (run.inputs.dataset_inputs if run.inputs else [])
            for tag in item.tags
            if tag.key == DATASET_CONTEXT_TAG
        }
        inputs = [
            DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag(DATASET_CONTEXT_TAG, context)])
            for context, dataset in datasets.items()
            if (dataset.name, dataset.digest, context) not in logged
        ]
        if inputs:
            self._client.log_inputs(self.run_id, datasets=inputs)
        training = [datasets[context].digest for context in ("train", "dev") if context in datasets]
        if training:
            self.set_tags({DATA_DIGEST_TAG: combined_digest(training)})
        return datasets

    def log_model(self, bundle_path: str | os.PathLike, **kwargs: Any) -> Any:
        """Log a model bundle as this run's MLflow model (a ``pyfunc`` that transcribes audio).

        See :func:`asrflow.serving.pyfunc.log_bundle` for the arguments (``name``,
        ``registered_model_name``, ``step``); returns MLflow's ``ModelInfo`` (``model_id``,
        ``model_uri``).
        """
        from asrflow.serving.pyfunc import log_bundle

        return log_bundle(bundle_path, run_id=self.run_id, tracking_uri=self.tracking_uri, **kwargs)

    def model_ids(self) -> list[str]:
        """The ids of the MLflow models logged by this run, oldest first (by creation time: MLflow
        lists a run's model outputs in no promised order)."""
        run = self._client.get_run(self.run_id)
        outputs = run.outputs.model_outputs if run.outputs else []
        created = {
            output.model_id: self._client.get_logged_model(output.model_id).creation_timestamp for output in outputs
        }
        return sorted(created, key=lambda model_id: (created[model_id], model_id))

    def start_system_metrics(self, interval_s: float = 10.0, resume: bool = False) -> None:
        """Start MLflow's system-metrics monitor for this run (``system/*`` metrics every ``interval_s``).

        ``resume``: continue the steps of the run's earlier system metrics. Needs psutil;
        GPU metrics need ``nvidia-ml-py`` and an NVIDIA GPU. Stopped by :meth:`end`.
        """
        if self._monitor is not None:
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self._monitor = SystemMetricsMonitor(
            self.run_id, sampling_interval=interval_s, resume_logging=resume, tracking_uri=self.tracking_uri
        )
        self._monitor.start()

    def stop_system_metrics(self) -> None:
        """Stop the system-metrics monitor, writing its last samples (nothing if none runs)."""
        if self._monitor is not None:
            self._monitor.finish()
            self._monitor = None

    # ------------------------------------------------------------------ artifacts and end
    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Copy a file or a whole folder into the run's artifacts (under ``artifact_path``)."""
        path = Path(path)
        if not path.exists():
            raise AsrflowError(f"cannot log artifact {path}: no such file or folder")
        try:
            if path.is_dir():
                self._client.log_artifacts(self.run_id, str(path), artifact_path)
            else:
                self._client.log_artifact(self.run_id, str(path), artifact_path)
        except _store_errors()[0] as error:
            raise AsrflowError(
                f"cannot store artifact {path} at {self.artifact_uri} ({error.message}); if the "
                "experiment was created by an MLflow server, set MLFLOW_TRACKING_URI to that "
                "server's http:// address, or use another experiment name"
            ) from None

    def end(self, status: str = "FINISHED") -> None:
        """Flush, then mark the run ``FINISHED``, ``FAILED`` or ``KILLED``.

        A reopened FINISHED run (evaluate) stays FINISHED; another status is kept in the
        tag ``asrflow.reopened_end_status``. Calling it again does nothing.
        """
        if status not in _END_STATUSES:
            raise ValueError(f"status must be one of {_END_STATUSES}, got {status!r}")
        if self._ended:
            return
        self.stop_system_metrics()
        if not self.flush():
            log.warning(
                "%d metric points could not be sent to %s (those saved in a checkpoint are sent when "
                "training resumes from it); MLflow run %s is left as it was",
                len(self._pending),
                self.tracking_uri,
                self.run_id,
            )
            self._ended = True
            return
        if self._reopened_finished:
            if status != "FINISHED":
                self.set_tags({REOPENED_END_STATUS_TAG: status})
        else:
            self._client.set_terminated(self.run_id, status=status)
        self._ended = True

    def __enter__(self) -> RunTracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.end("FINISHED")
        elif issubclass(exc_type, KeyboardInterrupt):
            self.end("KILLED")
        else:
            self.end("FAILED")


class NullTracker:
    """The tracker of a process that logs nothing (every rank but 0): each call does nothing.

    It has :class:`RunTracker`'s methods, so the training loop calls one tracker on every
    rank without asking which rank it is on.
    """

    run_id = None

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        pass

    def record(self, step: int, metrics: Mapping[str, Any]) -> None:
        pass

    def flush(self) -> None:
        pass

    def discard_after(self, step: int) -> int:
        return 0

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        pass

    def log_model(self, bundle_path: str | os.PathLike, **kwargs: Any) -> None:
        pass

    def end(self, status: str = "FINISHED") -> None:
        pass
