"""Atomic file writing: outputs appear whole or not at all."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    """Flush a directory entry (a rename inside it) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``final``; on success rename it into place.

    Works for files and directories. On an exception the temporary is removed and
    ``final`` is left as it was.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    target = tmp / final.name
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
