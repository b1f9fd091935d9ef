"""MLflow opened off the training's critical path: :class:`BackgroundTracker` (issue 12).

The trainer's rank-0 tracker. It keeps the training loop's calls, in order, until a
:class:`asrflow.tracking.tracker.RunTracker` has been opened in a thread of its own, then hands
them over; see the class for what waits and what does not.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from asrflow.errors import AsrflowError, first_line
from asrflow.tracking.tracker import RUN_KEY_TAG, STATE_VERSION, RunTracker, check_tracking_uri, now_ms

log = logging.getLogger(__name__)


def _run_with_key(tracking_uri: str | None, experiment: str, run_key: str) -> str | None:
    """The id of the run of ``experiment`` tagged :data:`RUN_KEY_TAG` = ``run_key``, or None."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=check_tracking_uri(tracking_uri))
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return None
    runs = client.search_runs([found.experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{run_key}'", max_results=1)
    return runs[0].info.run_id if runs else None


class BackgroundTracker:
    """A :class:`RunTracker` opened off the training's critical path, in a thread of its own.

    Opening a training run costs seconds the first optimizer step does not need: importing
    MLflow (about 2 s), creating and migrating a new SQLite store (about 4 s), creating or
    continuing the run, naming it (``git``), logging its datasets. So :meth:`start_training`
    returns at once, and the training loop's calls are kept, in order, until the run is open:

    * :meth:`record` keeps the points with the time they were measured; its first call starts
      the opening thread (before it, the process is still on its way to its first step, and
      a thread would only take the interpreter from it);
    * :meth:`log_params`, :meth:`set_tags` and :meth:`load_state_dict` are queued;
    * :meth:`flush` does nothing until the run is open, then flushes;
    * :meth:`state_dict` of a new run before any point was recorded (the step-0 checkpoint)
      names no run (``run_id`` None, no points) but a run key, the run's tag
      :data:`RUN_KEY_TAG` once it is open: a resume from it continues the run with that key
      if the process opened one, else opens a new run (with the params). Once a point is
      recorded it waits for the run, so every checkpoint that holds points names their run,
      and the resume watermark works as with :class:`RunTracker`;
    * everything else (:meth:`discard_after`, :meth:`end`, artifacts, the model, ``run_id``)
      waits for the run to be open, then goes to it.

    When everything queued has been replayed, calls go straight to the :class:`RunTracker`.
    An error while opening (a deleted run, params that differ from the run's) is raised by
    the next call the training loop makes (at the latest by the next checkpoint).
    """

    def __init__(self, open_run: Callable[[str], RunTracker], *, new_run: bool) -> None:
        self._open_run = open_run
        self._new_run = new_run
        self._run_key = uuid.uuid4().hex  # tags a new run, so a resume can find it without its id
        self._lock = threading.Lock()
        self._queue: list[Callable[[RunTracker], Any]] = []
        self._tracker: RunTracker | None = None
        self._direct = False  # the run is open and the queue replayed: calls go straight to it
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._recorded = False
        self._failed = False  # an opening error was raised in the training loop's thread
        self._done = threading.Event()

    @classmethod
    def start_training(
        cls,
        params: Mapping[str, Any],
        manifests: Mapping[str, Any],
        *,
        experiment: str = "asrflow",
        run_id: str | None = None,
        tracking_uri: str | None = None,
        **options: Any,
    ) -> BackgroundTracker:
        """:meth:`RunTracker.start_training` with the same arguments, opened in the background.

        A new run (``run_id`` None) also gets ``params`` (flattened) as its params.
        """

        def open_run(run_key: str) -> RunTracker:
            found = run_id if run_id is not None else _run_with_key(tracking_uri, experiment, run_key)
            tracker = RunTracker.start_training(
                params, manifests, experiment=experiment, run_id=found, tracking_uri=tracking_uri, **options
            )
            if found is None:
                from asrflow.params import flatten

                tracker.set_tags({RUN_KEY_TAG: run_key})
                tracker.log_params(flatten(dict(params)))
            return tracker

        return cls(open_run, new_run=run_id is None)

    # ------------------------------------------------------------------ the opening thread
    def _run(self) -> None:
        try:
            tracker = self._open_run(self._run_key)
            self._tracker = tracker
            while True:
                with self._lock:
                    if not self._queue:
                        self._direct = True
                        break
                    call = self._queue.pop(0)
                call(tracker)
        except BaseException as error:  # raised in the training loop's thread by its next call
            self._error = error
        finally:
            self._done.set()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="asrflow-mlflow-start", daemon=True)
            self._thread.start()

    def _check(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._failed = True
            raise error

    def _submit(self, call: Callable[[RunTracker], Any]) -> None:
        """``call(tracker)`` now if the run is open, else after the calls queued before it."""
        self._check()
        with self._lock:
            if not self._direct:
                self._queue.append(call)
                return
        call(self._tracker)

    @property
    def ready(self) -> bool:
        """Whether the run is open and every queued call has reached it."""
        return self._direct

    def wait(self) -> RunTracker:
        """The open :class:`RunTracker`, once every queued call has run (opens it if nothing did yet)."""
        self._start()
        self._done.wait()
        self._check()
        if self._tracker is None or not self._direct:
            raise AsrflowError("the MLflow run could not be opened (see the error logged before)")
        return self._tracker

    # ------------------------------------------------------------------ the training loop's calls
    def record(self, step: int, metrics: Mapping[str, Any]) -> None:
        """:meth:`RunTracker.record`, kept with its time until the run is open; starts the opening."""
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        values = {str(key): None if value is None else float(value) for key, value in metrics.items()}
        timestamp = now_ms()
        self._recorded = True
        self._submit(lambda tracker: tracker.record(step, values, timestamp_ms=timestamp))
        self._start()

    def log_params(self, params: Mapping[str, Any]) -> None:
        """:meth:`RunTracker.log_params`, queued until the run is open."""
        params = dict(params)
        self._submit(lambda tracker: tracker.log_params(params))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """:meth:`RunTracker.set_tags`, queued until the run is open."""
        tags = dict(tags)
        self._submit(lambda tracker: tracker.set_tags(tags))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """:meth:`RunTracker.load_state_dict`, queued until the run is open. A checkpoint that names no run
        but a run key (the step-0 checkpoint) makes a new run continue the run opened with that key, if
        the process that took it opened one."""
        if self._thread is None and state.get("run_id") is None and state.get("run_key"):
            self._run_key = str(state["run_key"])
        self._submit(lambda tracker: tracker.load_state_dict(state))

    def flush(self) -> bool:
        """:meth:`RunTracker.flush` once the run is open; before, nothing (False): the points are kept."""
        self._check()
        return self._tracker.flush() if self._direct else False

    def state_dict(self) -> dict[str, Any]:
        """:meth:`RunTracker.state_dict`; for a new run before any point, one that names no run."""
        self._check()
        if self._new_run and not self._recorded and not self._direct:
            return {
                "version": STATE_VERSION,
                "run_id": None,
                "run_key": self._run_key,
                "recorded_through": -1,
                "pending": [],
            }
        return self.wait().state_dict()

    def discard_after(self, step: int) -> int:
        """:meth:`RunTracker.discard_after`, on the open run."""
        return self.wait().discard_after(step)

    @property
    def run_id(self) -> str:
        """The run's id (waits for it to be open)."""
        return self.wait().run_id

    def end(self, status: str = "FINISHED") -> None:
        """:meth:`RunTracker.end` on the open run (opened now if it was not: a failure before the first
        step is recorded too). After an opening error, ends what was opened and raises nothing."""
        if not self._failed:
            self._start()
            self._done.wait()
            if self._error is None and self._direct:
                self._tracker.end(status)
                return
            if self._error is not None:  # never raised: the loop made no call after it
                log.warning("MLflow run could not be opened: %s", first_line(self._error))
        if self._tracker is not None:
            try:
                self._tracker.end(status)
            except Exception as error:  # the first error is the one the user sees
                log.warning("MLflow run %s could not be ended: %s", self._tracker.run_id, first_line(error))

    def __getattr__(self, name: str) -> Any:
        """Anything else of :class:`RunTracker` (artifacts, the model, ...), on the open run."""
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.wait(), name)
