"""Tie a helper process's life to the process that started it (data workers, feature-extraction jobs)."""

from __future__ import annotations

import ctypes
import signal
import sys

#: Linux's ``prctl`` option that sends the process a signal when its parent dies.
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (elsewhere: nothing happens).

    The parent may already have exited before this call: a caller that must not outlive it compares
    ``os.getppid()`` with the parent's pid afterwards.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
