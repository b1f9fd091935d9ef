"""Logging set-up and progress reporting for long loops.

Under Snakemake a stage's stdout and stderr go to its log file (``logs/<stage>.log``), and
the terminal would show nothing for the minutes a stage takes. So the rules (see
``workflow/rules/common.smk``) hand the stage Snakemake's own stderr as a spare file
descriptor (``ASRFLOW_PROGRESS_FD``), and :func:`setup_logging` adds a terminal handler on
it that shows only: where the log file is, the lines of the :data:`PROGRESS_LOGGER` logger
(:class:`TerminalProgress`, :func:`progress`), lines logged with ``extra={"terminal": True}``
(where the MLflow run is), and warnings and errors. The log file keeps every line. Under
DVC, which shows a stage's output as it comes, there is no log file and nothing changes.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")

LOG_FORMAT = "%(asctime)s %(levelname)s [%(name)s] %(message)s"
#: Logger whose lines are progress for the terminal (and the log file).
PROGRESS_LOGGER = "asrflow.progress"
#: Environment variables set by the Snakemake rules: the file descriptor of the terminal
#: (Snakemake's stderr), the stage's log file, and the stage's name.
PROGRESS_FD_ENV = "ASRFLOW_PROGRESS_FD"
LOG_FILE_ENV = "ASRFLOW_LOG_FILE"
STAGE_ENV = "ASRFLOW_STAGE"
#: Set by the first process that opened the terminal descriptor: ``st_dev:st_ino`` of it, so
#: that a child process (torchrun's workers) uses the descriptor only if it is the same file.
_PROGRESS_ID_ENV = "ASRFLOW_PROGRESS_FD_ID"
#: ... and where a child that did not inherit the descriptor opens that file again.
_PROGRESS_PATH_ENV = "ASRFLOW_PROGRESS_PATH"


class TerminalFilter(logging.Filter):
    """Passes progress lines, lines marked ``extra={"terminal": True}``, warnings and errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        return (
            record.levelno >= logging.WARNING
            or record.name == PROGRESS_LOGGER
            or bool(getattr(record, "terminal", False))
        )


def _terminal_stream():
    """The stream of ``$ASRFLOW_PROGRESS_FD`` if it is the descriptor the rule handed over, else None.

    torchrun's workers do not inherit the descriptor (it starts them with ``close_fds``): they
    reopen it through the launcher's ``/proc/<pid>/fd/<fd>``, which the first process recorded.
    """
    try:
        fd = int(os.environ.get(PROGRESS_FD_ENV, ""))
    except ValueError:
        return None
    return _inherited_descriptor(fd) or _reopened_descriptor()


def _identity(info: os.stat_result) -> str:
    return f"{info.st_dev}:{info.st_ino}"


def _inherited_descriptor(fd: int):
    try:
        identity = _identity(os.fstat(fd))
    except OSError:
        return None
    if os.environ.setdefault(_PROGRESS_ID_ENV, identity) != identity:
        return None
    os.environ.setdefault(_PROGRESS_PATH_ENV, f"/proc/{os.getpid()}/fd/{fd}")
    try:
        return os.fdopen(fd, "w", buffering=1, closefd=False)
    except OSError:
        return None


def _reopened_descriptor():
    path, expected = os.environ.get(_PROGRESS_PATH_ENV), os.environ.get(_PROGRESS_ID_ENV)
    if not path or not expected:
        return None
    try:
        stream = open(path, "a", buffering=1)  # noqa: SIM115 - the terminal handler's stream, open for the process
    except OSError:
        return None
    if _identity(os.fstat(stream.fileno())) != expected:
        stream.close()
        return None
    return stream


logger = logging.getLogger(__name__)


def setup_logging(level: int = logging.INFO) -> None:
    """Log to stderr in one format for every stage.

    Every module logs under its import path (``logging.getLogger(__name__)``; a stage
    script, run as ``__main__``, spells it: ``"stages.train"``), shown as ``[name]``. Under
    torchrun with several processes every line also names its rank (``[rank 1]``): all ranks
    write to the same terminal. Under Snakemake (``$ASRFLOW_PROGRESS_FD`` set), progress,
    warnings and errors also go to the terminal, after a line that says where the full log is.
    """
    log_format = LOG_FORMAT
    stage = os.environ.get(STAGE_ENV) or "asrflow"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        log_format = LOG_FORMAT.replace("[%(name)s]", f"[rank {os.environ.get('RANK', '?')}] [%(name)s]")
        stage = f"{stage} rank {os.environ.get('RANK', '?')}"
    logging.basicConfig(level=level, format=log_format, stream=sys.stderr, force=True)
    stream = _terminal_stream()
    if stream is not None:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter(f"%(asctime)s [{stage}] %(message)s", "%H:%M:%S"))
        handler.addFilter(TerminalFilter())
        logging.getLogger().addHandler(handler)
        if os.environ.get(LOG_FILE_ENV) and "LOCAL_RANK" not in os.environ:  # once: torchrun's launcher said it
            logging.getLogger(PROGRESS_LOGGER).info("running; full log in %s", os.environ[LOG_FILE_ENV])


def format_duration(seconds: float) -> str:
    """``95 -> "1m35s"``, ``4000 -> "1h06m"``, ``12 -> "12s"``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class TerminalProgress:
    """One line of training progress at most every ``every_s`` seconds, on :data:`PROGRESS_LOGGER`.

    ``step 120/400 (30%) epoch 12: loss 0.8123, 64.2 audio s/s, ETA 2m10s``. The ETA is
    (steps left) x (seconds per step since this process started training): a resumed run
    measures only its own steps. Use one instance per run, on the main rank only::

        progress = TerminalProgress(total_steps, start_step=global_step)
        ... after each optimizer step:
        progress.update(step, epoch, loss, audio_s_per_s)

    Attributes:
        started: :func:`time.monotonic` when the instance was made: the ETA counts the time since then
            (pass ``now=started + seconds`` to :meth:`line` for the line ``seconds`` into training).
    """

    def __init__(self, total_steps: int | None = None, start_step: int = 0, every_s: float = 30.0):
        self.total_steps = total_steps
        self.start_step = start_step
        self.every_s = every_s
        self.started = time.monotonic()
        self._last: float | None = None
        self.logger = logging.getLogger(PROGRESS_LOGGER)

    def line(self, step: int, epoch: int, loss: float, audio_s_per_s: float, *, now: float | None = None) -> str:
        """The progress line for ``step`` (without logging it)."""
        now = time.monotonic() if now is None else now
        total = self.total_steps
        where = f"step {step}/{total} ({100 * step / total:.0f}%)" if total else f"step {step}"
        text = f"{where} epoch {epoch}: loss {loss:.4f}, {audio_s_per_s:.1f} audio s/s"
        done = step - self.start_step
        if total and done > 0 and step <= total:
            text += f", ETA {format_duration((total - step) * (now - self.started) / done)}"
        return text

    def update(self, step: int, epoch: int, loss: float, audio_s_per_s: float, *, force: bool = False) -> bool:
        """Log the line if ``every_s`` passed since the last one (or on the first step, the last
        step, or ``force``); returns whether it did."""
        now = time.monotonic()
        due = self._last is None or now - self._last >= self.every_s or step == self.total_steps
        if not (due or force):
            return False
        self._last = now
        self.logger.info("%s", self.line(step, epoch, loss, audio_s_per_s, now=now))
        return True


def progress(items: Iterable[T], desc: str, total: int | None = None, log_every_s: float = 30.0) -> Iterator[T]:
    """Iterate with a tqdm bar on a terminal, or a log line every ``log_every_s`` otherwise."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        yield from tqdm(items, desc=desc, total=total)
        return
    logger = logging.getLogger(PROGRESS_LOGGER)
    last = time.monotonic()
    count = 0
    for count, item in enumerate(items, start=1):
        yield item
        now = time.monotonic()
        if now - last >= log_every_s:
            last = now
            of_total = f"/{total}" if total else ""
            logger.info("%s: %d%s", desc, count, of_total)
