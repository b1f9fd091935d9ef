"""The thin MLflow writer of one run, fed from a :class:`~asrflow.tracking.metric_log.MetricLog`; docs/mlflow.md."""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from asrflow.data.loading.index_store import combined_digest, manifest_facts
from asrflow.errors import AsrflowError, first_line
from asrflow.params import committed_params, flatten
from asrflow.tracking.metric_log import MetricLog, Point, now_ms
from asrflow.tracking.naming import dvc_experiment_tags, param_value, run_name, run_tags
from asrflow.tracking.store import (
    check_tracking_uri,
    create_whole_sqlite_store,
    default_artifact_location,
    runs_page,
    sqlite_path,
    store_error,
)

# Before MLflow loads: no git warning, no telemetry, no minutes of retries on a server that is down.
_ENV_DEFAULTS = {
    "GIT_PYTHON_REFRESH": "quiet",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
}
os.environ.update({key: value for key, value in _ENV_DEFAULTS.items() if key not in os.environ})
for _name in ("alembic", "mlflow.store.db.utils"):  # a fresh SQLite store's migrations are not news
    logging.getLogger(_name).setLevel(logging.WARNING)
log = logging.getLogger(__name__)
_TERMINAL = {"terminal": True}  # the log record also goes to the terminal

MAX_TAG_VAL_LENGTH = 8000  # MLflow's limit (a test checks it agrees)
#: Run tags of the metric protocol and the datasets (see docs/mlflow.md).
LOGGED_THROUGH_TAG = "asrflow.logged_through_step"
REOPENED_END_STATUS_TAG = "asrflow.reopened_end_status"
RUN_KEY_TAG = "asrflow.run_key"
DATA_DIGEST_TAG = "asrflow.data_digest"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"  # MLflow 3's UI opens an experiment in its kind's view
EXPERIMENT_KIND = "custom_model_development"


def _store_errors() -> tuple[type[BaseException], ...]:
    from mlflow.exceptions import MlflowException

    return (MlflowException, OSError)


class MlflowRun:
    """One MLflow run; calls that need the run wait until it is open, points wait in :attr:`metrics`."""

    max_metrics_per_batch = 1000  # MLflow's limit (a test checks it agrees)

    def __init__(self, opener: Callable[[MlflowRun], None]) -> None:
        self.metrics = MetricLog()
        self.run_key = uuid.uuid4().hex
        self.tracking_uri = self.experiment_id = None
        self._opener, self._thread, self._opened = opener, None, threading.Event()
        self._error: BaseException | None = None  # from the opening thread, raised by the next call
        self._client = self._run_id = self._monitor = self._replaces_run_id = self._state_run_id = None
        self._queued_tags: dict[str, str] = {}  # set before the run is open
        self._failed = self._reopened_finished = self._settled = self._restored = self._store_down = self._ended = False
        self._in_flight: list[tuple[Any, list[Point]]] = []  # (MLflow's future, its points)

    @classmethod
    def start(cls, experiment: str = "asrflow", run_id: str | None = None, **options: Any) -> MlflowRun:
        """Open a new run in ``experiment`` (created if needed), or continue ``run_id``, now; see :meth:`_open`."""
        run = cls(lambda run: run._open(experiment, run_id, **options))
        run._ready()
        return run

    def _open(
        self,
        experiment: str,
        run_id: str | None,
        *,
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: Mapping[str, Any] | None = None,
        create_if_missing: bool = False,
        by_key: bool = False,
        system_metrics: bool | None = None,
        system_metrics_interval_s: float = 10.0,
    ) -> bool:
        """Open the run (a new one with MLflow's context tags); returns whether it is new. ``create_if_missing``:
        a ``run_id`` not in the store gets a new run; ``by_key``: continue the run tagged :attr:`run_key`, if any."""
        from mlflow.tracking.context.registry import resolve_tags

        client = self._connect(tracking_uri)
        tags = {str(k): str(v) for k, v in (tags or {}).items()}
        if run_id is None and by_key:
            run_id = self._run_id_by_key(experiment)
        run = self._existing_run(run_id, create_if_missing=create_if_missing)
        if self._replaces_run_id is not None:
            tags["asrflow.replaces_run_id"] = self._replaces_run_id
        if new := run is None:
            self.experiment_id = self._experiment_id(experiment)
            tags = resolve_tags({RUN_KEY_TAG: self.run_key, **tags})
            run = client.create_run(self.experiment_id, tags=tags, run_name=run_name)
            log.info(
                "started MLflow run %s (%s) in %s",
                run.info.run_id,
                run.info.run_name,
                self.tracking_uri,
                extra=_TERMINAL,
            )
        self._run_id = run.info.run_id
        if not new:
            self._continue(run, tags)
        self._start_system_metrics(system_metrics, system_metrics_interval_s, resume=not new)
        return new

    def _connect(self, tracking_uri: str | None) -> Any:
        """The MLflow client of ``tracking_uri`` (checked; a SQLite store is created whole), kept as the run's."""
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
        from sqlalchemy.exc import SQLAlchemyError

        self.tracking_uri = uri = check_tracking_uri(tracking_uri)
        create_whole_sqlite_store(uri)
        try:
            self._client = MlflowClient(tracking_uri=uri)  # opens a SQLite store's tables
        except (MlflowException, SQLAlchemyError) as error:
            if sqlite_path(uri) is None:
                raise
            raise store_error(uri, error) from error
        return self._client

    def _run_id_by_key(self, experiment: str) -> str | None:
        """The id of the run of ``experiment`` tagged with this :attr:`run_key`, or ``None``."""
        known = self._client.get_experiment_by_name(experiment)
        if known is None:
            return None
        found = self._client.search_runs([known.experiment_id], f"tags.`{RUN_KEY_TAG}` = '{self.run_key}'")
        return found[0].info.run_id if found else None

    def _existing_run(self, run_id: str | None, *, create_if_missing: bool) -> Any:
        """MLflow's run ``run_id``, or ``None`` for a new run: no ``run_id``, or (``create_if_missing``) one the
        store lacks, whose id is kept as :attr:`_replaces_run_id`. Raises AsrflowError for a missing or deleted run."""
        from mlflow.exceptions import MlflowException

        uri = self.tracking_uri
        try:
            run = self._client.get_run(run_id) if run_id is not None else None
        except MlflowException as error:
            if error.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            if not create_if_missing:
                raise AsrflowError(
                    f"MLflow run {run_id} is not in the tracking store {uri}: set MLFLOW_TRACKING_URI to the store "
                    "that holds it, or delete the checkpoints to start a new run"
                ) from None
            log.warning("MLflow run %s is not in %s; starting a new run", run_id, uri)
            self._replaces_run_id = run_id
            return None
        if run is not None and run.info.lifecycle_stage != "active":
            raise AsrflowError(
                f"MLflow run {run_id} is deleted in {uri}: restore it (`mlflow runs restore --run-id {run_id}`) "
                "or start training afresh"
            )
        return run

    def _continue(self, run: Any, tags: dict[str, str]) -> None:
        """Take up an existing run: marked RUNNING again (a FINISHED one stays so), given ``tags``, and its
        metric watermark (:data:`LOGGED_THROUGH_TAG`) read into :attr:`metrics`."""
        self.experiment_id, self._reopened_finished = run.info.experiment_id, run.info.status == "FINISHED"
        if not self._reopened_finished:
            self._client.update_run(self._run_id, status="RUNNING")
        self._write_tags(tags)
        through = run.data.tags.get(LOGGED_THROUGH_TAG, "-1")
        self.metrics.logged_through = int(through) if through.lstrip("-").isdigit() else -1
        log.info("continuing MLflow run %s in %s", self._run_id, self.tracking_uri, extra=_TERMINAL)

    def _start_system_metrics(self, wanted: bool | None, interval_s: float, *, resume: bool) -> None:
        """Start MLflow's system metrics monitor (a sample every ``interval_s`` seconds) when ``wanted``, or when
        MLflow's own switch (``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING``) says so, which wins; never on a reopened
        FINISHED run. ``resume``: continue the run's earlier samples' steps."""
        from mlflow.environment_variables import MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING as switch
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        if (switch.get() if switch.defined else wanted) and not self._reopened_finished:
            self._monitor = SystemMetricsMonitor(
                self._run_id, interval_s, resume_logging=resume, tracking_uri=self.tracking_uri
            )
            self._monitor.start()

    def _experiment_id(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        experiment = self._client.get_experiment_by_name(name)
        if experiment is None:
            location = default_artifact_location(self.tracking_uri, name)
            try:
                return self._client.create_experiment(name, location, {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
            except MlflowException:  # another process created it meanwhile
                if (experiment := self._client.get_experiment_by_name(name)) is None:
                    raise
        if experiment.lifecycle_stage != "active":
            raise AsrflowError(
                f"MLflow experiment {name!r} is deleted in {self.tracking_uri}: restore it (`mlflow experiments "
                f"restore --experiment-id {experiment.experiment_id}`) or choose another experiment name"
            )
        if EXPERIMENT_KIND_TAG not in experiment.tags:  # a kind the user chose stays
            self._client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return experiment.experiment_id

    def _start_opening(self) -> None:
        def open_run() -> None:
            try:
                self._opener(self)
            except BaseException as error:  # raised in the training loop's thread by its next call
                self._error = error
            self._opened.set()

        if self._thread is None:
            self._thread = threading.Thread(target=open_run, name="asrflow-mlflow-open", daemon=True)
            self._thread.start()

    def _raise_opening_error(self) -> None:
        if self._error is not None:
            error, self._error, self._failed = self._error, None, True
            raise error

    def _ready(self) -> None:
        """Wait for the run to be open (opening it now if no point did), then write what was kept meanwhile."""
        if threading.current_thread() is self._thread:
            return  # the opener writes to the run it is opening
        if self._failed:
            raise AsrflowError("the MLflow run could not be opened (see the error above)")
        self._start_opening()
        self._opened.wait()
        self._raise_opening_error()
        if not self._settled:
            self._settled = True
            self._write_tags(self._queued_tags)
            if self._restored:
                self._reconcile()

    @property
    def run_id(self) -> str:
        self._ready()
        return self._run_id

    def wait_open(self, timeout_s: float | None = None) -> bool:
        """Wait up to ``timeout_s`` seconds (``None``: as long as it takes) for the run's opening to end, without
        starting it; True once it has ended (the run is open, or the opening failed and the next call raises
        its error), False if it has not, or never started (no point recorded, no call that needs the run)."""
        return self._opened.wait(timeout_s)

    @property
    def system_metrics_active(self) -> bool:
        """Whether MLflow's system metrics monitor samples this run now: from the opening (waited for, and started
        as :attr:`run_id` starts it), when ``system_metrics`` asked for it and MLflow's own switch allows it, until
        :meth:`end` stops it."""
        if not self._ended:
            self._ready()
        return self._monitor is not None

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log flat params (once the run is open); a changed value raises :class:`AsrflowError`."""
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        self._ready()
        entities = [Param(str(key), param_value(value)) for key, value in params.items()]
        try:  # MLflow splits them into its batch sizes, keeps a value logged again, refuses a changed one
            self._client.log_batch(self._run_id, params=entities)
        except MlflowException as error:
            if error.error_code != "INVALID_PARAMETER_VALUE":
                raise
            raise AsrflowError(
                f"MLflow run {self._run_id}: {first_line(error)[:600]}; a run's params cannot change: start a new "
                "run (delete the checkpoints) or restore the old params"
            ) from None

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set run tags (kept until the run is open)."""
        rendered = {str(key): str(value) for key, value in tags.items()}
        self._write_tags(rendered) if self._settled else self._queued_tags.update(rendered)

    def _write_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        if tags:
            entities = [RunTag(key, str(value)[:MAX_TAG_VAL_LENGTH]) for key, value in tags.items()]
            self._client.log_batch(self._run_id, tags=entities)

    def record(self, step: int, metrics: Mapping[str, Any], *, timestamp_ms: int | None = None) -> None:
        """Keep one point per metric at ``step`` until :meth:`flush`; the first point starts the opening."""
        self._raise_opening_error()
        self.metrics.record(step, metrics, timestamp_ms=timestamp_ms)
        self._start_opening()

    def discard_after(self, step: int) -> int:
        """Drop the points after ``step``: a rollback to its checkpoint, before :meth:`load_state_dict`."""
        return self.metrics.discard_after(step)

    def flush(self, *, through: int | None = None) -> bool:
        """Write the kept points (up to step ``through``), then raise the watermark; False while the store is down."""
        if self._thread is None:
            return False  # no point yet: the run opens after the first one, a checkpoint later waits for it
        self._ready()
        try:
            self._collect()
            while chunk := self.metrics.unsent(self.max_metrics_per_batch, through):
                self._in_flight.append((self._write_metrics(chunk), chunk))
                self.metrics.mark_sent(chunk)
            self._collect()
            if (stored := self.metrics.stored_through()) > self.metrics.logged_through:
                self._write_watermark(stored)
        except _store_errors() as error:
            if not self._store_down:
                message = "MLflow store %s cannot be reached (%s); training goes on, the %d points kept meanwhile"
                log.warning(message, self.tracking_uri, first_line(error), len(self.metrics.pending))
            self._store_down = True
            return False
        if self._store_down:
            log.warning("MLflow store %s is reachable again: buffered points sent", self.tracking_uri)
            self._store_down = False
        return True

    def _write_metrics(self, points: list[Point]) -> Any:  # one log_batch; returns MLflow's future
        from mlflow.entities import Metric

        metrics = [Metric(key, value, ts, step) for key, step, value, ts in points]
        return self._client.log_batch(self._run_id, metrics=metrics, synchronous=False)

    def _collect(self) -> None:
        """Wait for the writes in flight: committed points leave the log, failed ones are sent again."""
        in_flight, self._in_flight, failure = self._in_flight, [], None
        for operation, chunk in in_flight:
            try:
                operation.wait()
                self.metrics.confirm(chunk)
            except _store_errors() as error:
                self.metrics.unsend(chunk)
                failure = failure or error
        if failure is not None:
            raise failure

    def _write_watermark(self, step: int) -> None:  # a call of its own, after the points' commits
        self._write_tags({LOGGED_THROUGH_TAG: step})
        self.metrics.logged_through = step

    def log_metrics(self, metrics: Mapping[str, Any], step: int = 0, *, model_id=None, dataset=None) -> None:
        """Write metrics now (evaluate), attached to a logged model and to the dataset they were measured on."""
        from mlflow.entities import Metric

        names = {"dataset_name": dataset.name, "dataset_digest": dataset.digest} if dataset is not None else {}
        values = {str(key): float(value) for key, value in metrics.items() if value is not None}
        points = [Metric(key, value, now_ms(), int(step), model_id=model_id, **names) for key, value in values.items()]
        self._client.log_batch(self.run_id, metrics=points)

    def state_dict(self) -> dict[str, Any]:
        """The kept points, the run (None before it is open) and its key, as plain python types."""
        self._raise_opening_error()
        run_id = self._run_id if self._opened.is_set() else None
        return {**self.metrics.state_dict(), "run_id": run_id, "run_key": self.run_key}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a checkpoint's points back; once the run is open, those it holds are dropped, the rest written."""
        self._raise_opening_error()
        self.metrics.load_state_dict(state)
        if state.get("run_id") is None and state.get("run_key") and self._thread is None:
            self.run_key = str(state["run_key"])
        self._state_run_id, self._restored = state.get("run_id"), True
        if self._settled:
            self._reconcile()

    def _reconcile(self) -> None:
        self._restored = False
        if self._state_run_id not in (None, self._run_id, self._replaces_run_id):
            raise AsrflowError(
                f"the checkpoint belongs to MLflow run {self._state_run_id}, but this tracker has run "
                f"{self._run_id}: start the tracker with run_id=state['run_id']"
            )
        stored: set[tuple[str, int]] = set()
        if window := self.metrics.check_window():
            keys = set(self._client.get_run(self._run_id).data.metrics) | {p[0] for p in self.metrics.pending}
            for key in keys:
                history = self._client.get_metric_history(self._run_id, key)
                stored |= {(key, point.step) for point in history if window[0] < point.step <= window[1]}
        self.metrics.reconcile(stored)
        recorded = self.metrics.recorded_through
        if self.flush(through=recorded) and self.metrics.logged_through < recorded:
            self._write_watermark(recorded)  # a flush died before its tag

    def log_datasets(self, manifests: Mapping[str, str | os.PathLike], names: Mapping | None = None) -> dict:
        """Cut manifests (context -> path) as the run's datasets, named by ``names`` (default: the context)."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        self._ready()
        datasets, inputs = {}, []  # the store keeps one input per dataset and run
        for context, path in manifests.items():
            if not (path := Path(path)).is_file():
                raise AsrflowError(f"manifest {path} not found: run the stage that writes it first")
            facts, source = manifest_facts(path), json.dumps({"uri": str(path.resolve())})
            profile = json.dumps({"utterances": facts["utterances"], "hours": facts["hours"]})
            name = (names or {}).get(context, context)
            datasets[context] = Dataset(name, facts["digest"], "local", source, profile=profile)
            inputs.append(DatasetInput(datasets[context], [InputTag("mlflow.data.context", context)]))
        if inputs:
            self._client.log_inputs(self._run_id, inputs)
        if training := [datasets[context].digest for context in ("train", "dev") if context in datasets]:
            self._write_tags({DATA_DIGEST_TAG: combined_digest(training)})
        return datasets

    def log_model(self, bundle_path: str | os.PathLike, **kwargs: Any) -> Any:
        """The bundle as the run's MLflow model, in its experiment: :func:`asrflow.serving.pyfunc.log_bundle`."""
        from asrflow.serving.pyfunc import log_bundle

        return log_bundle(bundle_path, run_id=self.run_id, tracking_uri=self.tracking_uri, **kwargs)

    def model_ids(self) -> list[str]:
        """The run's logged models, oldest first."""
        outputs = self._client.get_run(self.run_id).outputs
        models = [self._client.get_logged_model(out.model_id) for out in (outputs.model_outputs if outputs else [])]
        return [model.model_id for model in sorted(models, key=lambda m: (m.creation_timestamp, m.model_id))]

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Copy a file or a whole folder into the run's artifacts (under ``artifact_path``)."""
        if not (path := Path(path)).exists():
            raise AsrflowError(f"cannot log artifact {path}: no such file or folder")
        write = self._client.log_artifacts if path.is_dir() else self._client.log_artifact
        try:
            write(self.run_id, str(path), artifact_path)
        except _store_errors()[0] as error:
            raise AsrflowError(
                f"cannot store artifact {path} at {self._client.get_run(self._run_id).info.artifact_uri} "
                f"({error.message}); if the experiment was created by an MLflow server, set MLFLOW_TRACKING_URI "
                "to that server's http:// address, or use another experiment name"
            ) from None

    def end(self, status: str = "FINISHED") -> None:
        """Flush, stop system metrics, mark the run ``status`` (a reopened FINISHED run stays so: a tag says it)."""
        if status not in ("FINISHED", "FAILED", "KILLED"):
            raise ValueError(f"status must be FINISHED, FAILED or KILLED, got {status!r}")
        if self._ended:
            return
        self._ended, raised_before, opened = True, self._failed, False
        try:
            self._ready()
            opened = True
        except Exception as error:  # not opened whole: the training's own error is the one to show
            if not raised_before:
                log.warning("MLflow run could not be opened: %s", first_line(error))
        if self._monitor is not None:
            self._monitor, monitor = None, self._monitor
            monitor.finish()
        if opened and not self.flush():
            message = "%d metric points not sent to %s (those in a checkpoint are sent on resume); run %s left as is"
            log.warning(message, len(self.metrics.pending), self.tracking_uri, self._run_id)
        elif opened and self._reopened_finished:
            self._write_tags({REOPENED_END_STATUS_TAG: status} if status != "FINISHED" else {})
        elif self._run_id is not None:
            self._client.set_terminated(self._run_id, status=status)
        if opened:
            page = runs_page(self.tracking_uri, self.experiment_id)
            log.info("MLflow run %s: %s", self._run_id, page, extra=_TERMINAL)


def start_training_run(
    params: Mapping[str, Any],
    manifests: Mapping[str, Any],
    *,
    experiment: str = "asrflow",
    run_id: str | None = None,
    tracking_uri: str | None = None,
    system_metrics: bool = True,
    system_metrics_interval_s: float = 10.0,
) -> MlflowRun:
    """The training's run, opened in a thread once a point is recorded: a new one is named and described against
    the committed params.yaml, gets ``params`` flattened; ``manifests`` (context -> path) become datasets."""

    def open_run(run: MlflowRun) -> None:
        defaults = committed_params() if run_id is None else None
        options = {"system_metrics": system_metrics, "system_metrics_interval_s": system_metrics_interval_s}
        tags = run_tags(params, defaults) if run_id is None else dvc_experiment_tags()
        name = run_name(params, defaults)
        if run._open(experiment, run_id, run_name=name, tracking_uri=tracking_uri, tags=tags, by_key=True, **options):
            run.log_params(flatten(dict(params)))
        run.log_datasets(manifests)

    return MlflowRun(open_run)


class NullTracker:
    """The tracker of a process that logs nothing (every rank but 0): each call does nothing."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def _nothing(self, *args: Any, **kwargs: Any) -> None: ...

    set_tags = record = discard_after = flush = load_state_dict = end = _nothing
