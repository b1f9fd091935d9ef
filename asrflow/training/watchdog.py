"""Stall watchdog: when no step finishes in time, dump every thread's stack and exit.

Under torchrun every rank writes to the same stderr, and two ranks that stall together
would interleave their dumps mid-line. So the dump goes to a temporary file first and is
then written to stderr one line per ``write``, each line prefixed with the rank's label.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import tempfile
import threading
import time

logger = logging.getLogger(__name__)

#: Exit code of a process the watchdog ended.
EXIT_STALLED = 124


class StallWatchdog:
    """A daemon thread; call :meth:`beat` after each step. Exits with ``EXIT_STALLED``."""

    def __init__(self, timeout_s: float, label: str = ""):
        self.timeout_s = timeout_s
        self.label = label
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="asrflow-watchdog", daemon=True)

    def __enter__(self) -> StallWatchdog:
        if self.timeout_s > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def beat(self) -> None:
        self._last = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(min(self.timeout_s / 4, 5.0)):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                logger.error(
                    "%sno training step finished for %.0f s (train.stall_timeout_s = %.0f); "
                    "stacks of every thread follow, then exit %d",
                    self.label,
                    idle,
                    self.timeout_s,
                    EXIT_STALLED,
                )
                write_stacks(sys.stderr, self.label)
                os._exit(EXIT_STALLED)


def write_stacks(stream, prefix: str) -> None:
    """Every thread's stack (faulthandler's format) to ``stream``, each line starting with ``prefix``."""
    with tempfile.TemporaryFile("w+") as dump:
        faulthandler.dump_traceback(file=dump, all_threads=True)
        dump.seek(0)
        lines = dump.read().splitlines()
    stream.flush()
    for line in lines:  # one write per line: lines from different processes never mix
        os.write(stream.fileno(), f"{prefix}{line}\n".encode())
