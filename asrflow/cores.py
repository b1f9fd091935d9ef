"""How many CPU cores this process may keep busy."""

from __future__ import annotations

import os

#: Set by the Snakemake rules to the threads Snakemake granted the stage (``{threads}``, at most ``--cores``).
GRANTED_THREADS_ENV = "ASRFLOW_THREADS"


def available_cores() -> int:
    """CPU cores this process may use: its affinity mask (as taskset or a batch scheduler set it), and no
    more than a workflow manager granted the stage in ``$ASRFLOW_THREADS``, so that stages Snakemake runs
    side by side do not oversubscribe the machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    granted = os.environ.get(GRANTED_THREADS_ENV, "").strip()
    if granted.isdigit() and int(granted) > 0:
        return min(cores, int(granted))
    return cores
