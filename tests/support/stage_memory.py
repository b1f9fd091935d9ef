"""A stage run as the pipeline runs it, in a process of its own, with its memory read from outside.

:func:`stage_peaks` is what the memory tests and the scale benchmarks measure: the peak of the process tree's
PSS (the stage and its workers; shared pages split between the processes sharing them), its RSS, and the
stage's own ``VmHWM``. Run by path as a script (``--child``), this file wraps the stage; that part imports
nothing but the standard library, so it can run another checkout's stages (``repo``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

CHILD_FLAG = "--child"


def stage_peaks(
    module: str, argv: list[str], log_path: Path, *, repo: Path | None = None, poll_s: float = 0.25
) -> dict:
    """``python -m module argv`` run from ``repo`` (default: this checkout) as the pipeline runs a stage, wrapped:
    ``peak_rss_mb`` (its ``VmHWM`` before interpreter shutdown, which would raise it), ``peak_tree_pss_mb`` and
    ``peak_tree_rss_mb`` (it and its workers, read every ``poll_s`` seconds: a shorter spike may be missed),
    ``peak_tree_anon_pss_mb`` (the anonymous part of its PSS: :class:`~tests.support.processes.MemoryReading`)
    and ``elapsed_s``. A stage that fails raises ``RuntimeError`` with its log's tail."""
    from tests.support.processes import ChildProcess
    from tests.support.repo import REPO

    repo = repo or REPO
    report = log_path.with_suffix(".memory.json")
    report.unlink(missing_ok=True)
    command = [sys.executable, __file__, CHILD_FLAG, str(report), module, *argv]  # by path: any checkout's stage
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    process = ChildProcess(command, log_path=log_path, env=env, cwd=repo, memory_poll_s=poll_s)
    code, elapsed = process.wait(), time.perf_counter() - start
    if code != 0 or not report.is_file():
        raise RuntimeError(f"python -m {module} exited {code}; log {log_path}:\n{process.tail(15)}")
    found = {"elapsed_s": elapsed, "peak_rss_mb": json.loads(report.read_text())["vm_hwm_kb"] / 1024}
    kinds = ("pss", "rss", "anon_pss")
    return found | {f"peak_tree_{kind}_mb": getattr(process, f"peak_{kind}") / 2**20 or None for kind in kinds}


def _stage_child(report: Path, module: str, argv: list[str]) -> None:
    """Run ``module`` as ``python -m`` would, write its ``VmHWM`` to ``report``, leave with ``os._exit``."""
    import runpy

    sys.path[0], sys.argv, code = os.getcwd(), [module, *argv], 0  # the repository first, as with -m
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)  # spawned workers import it as -m does
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    status = Path("/proc/self/status").read_text().splitlines()
    vm_hwm_kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    report.write_text(json.dumps({"vm_hwm_kb": vm_hwm_kb, "exit_code": code}))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__" and sys.argv[1:2] == [CHILD_FLAG]:
    _stage_child(Path(sys.argv[2]), sys.argv[3], sys.argv[4:])
