"""Atomic file writing: outputs appear whole or not at all."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """Flush a directory entry (a rename inside it) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: Inside each temporary folder: a file its writer holds locked (``flock``) while it lives.
LOCK_FILE = ".asrflow-writer.lock"
#: A temporary folder without a lock file (left by an older asrflow, or a writer killed
#: before it took the lock) is stale once it is this old, in seconds.
UNLOCKED_STALE_AFTER_S = 600.0


def _temp_name_pattern(name: str) -> re.Pattern[str]:
    """Names ``tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp")`` gives: 8 random characters
    of ``[a-z0-9_]`` between, so ``.fbank.old.XXXXXXXX.tmp`` (of an output ``fbank.old``)
    never matches ``fbank``."""
    return re.compile(re.escape(f".{name}.") + r"[a-z0-9_]{8}" + re.escape(".tmp"))


def _writer_alive(tmp: Path) -> bool:
    """Whether a live process still writes into temporary folder ``tmp`` (holds its lock)."""
    lock = tmp / LOCK_FILE
    if not lock.is_file():
        with contextlib.suppress(FileNotFoundError):
            return time.time() - tmp.stat().st_mtime < UNLOCKED_STALE_AFTER_S
        return False
    with open(lock, "rb") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def sweep_stale_temporaries(final: Path) -> list[Path]:
    """Remove the temporary siblings of ``final`` whose writer died (``kill -9``, power cut).

    Only ``.{final.name}.XXXXXXXX.tmp`` folders are candidates, and one whose writer still
    holds its lock is left alone. Returns the folders removed.
    """
    pattern = _temp_name_pattern(final.name)
    removed = []
    for sibling in final.parent.iterdir():
        candidate = pattern.fullmatch(sibling.name) and sibling.is_dir() and not sibling.is_symlink()
        if candidate and not _writer_alive(sibling):
            shutil.rmtree(sibling, ignore_errors=True)
            removed.append(sibling)
    return removed


@contextlib.contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``final``; on success rename it into place.

    Works for files and directories. On an exception the temporary is removed and
    ``final`` is left as it was. Temporaries that a killed writer of the same ``final``
    left behind are removed on entry (:func:`sweep_stale_temporaries`); this writer holds
    a lock inside its own so that a concurrent writer never removes it.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_temporaries(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    target = tmp / final.name
    with open(tmp / LOCK_FILE, "wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield target
            if target.is_file():
                with open(target, "rb") as handle:
                    os.fsync(handle.fileno())
            if final.is_dir() and not final.is_symlink():
                shutil.rmtree(final)
            os.replace(target, final)
            fsync_dir(final.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def write_json(path: str | Path, payload: object) -> None:
    """Write ``payload`` as indented JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    """Write one JSON object per line, atomically."""
    with atomic_path(path) as tmp, open(tmp, "w") as handle:
        for row in rows:
            handle.write(json.dumps(row, sort_keys=True) + "\n")
