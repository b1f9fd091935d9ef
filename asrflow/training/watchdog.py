"""Stall watchdog: when no step finishes in time, dump every thread's stack and exit."""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time

logger = logging.getLogger("asrflow.watchdog")

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
                    self.label, idle, self.timeout_s, EXIT_STALLED,
                )
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(EXIT_STALLED)
