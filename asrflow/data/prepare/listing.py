"""A corpus folder's listing: every file's path, size and modification time, without reading it.

The ``corpus_listing`` stage writes it (``always_changed`` for DVC; for Snakemake, run
while the workflow is read), and ``prepare`` depends on the listing instead of the corpus
folder: DVC and Snakemake then compare one small file, not hours of audio, yet any file
added, removed, replaced or touched changes the listing and re-runs prepare.
A file edited in place with its size and mtime kept (``touch -r``) goes unseen: force
``dvc repro -f prepare`` / ``snakemake -R prepare`` then.

Format: one line per file, ``<path relative to the corpus folder>\\t<bytes>\\t<mtime in ns>``,
sorted by path (byte order); symlinks are listed with their target's size and mtime. The
file :func:`write_listing` writes holds a ``# <folder>`` line before each folder's lines.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from asrflow.errors import AsrflowError


def corpus_listing(corpus_dir: str | Path) -> Iterator[str]:
    """The listing's lines (without newline), sorted by relative path; streams the walk.

    Raises:
        AsrflowError: when ``corpus_dir`` is not a folder.
    """
    root = Path(corpus_dir)
    if not root.is_dir():
        raise AsrflowError(
            f"corpus_dir {root} does not exist or is not a folder (prepare.corpus_dir in params.yaml); "
            "point it at the folder that holds the corpus"
        )
    yield from _walk(root, "")


def _walk(folder: Path, prefix: str) -> Iterator[str]:
    with os.scandir(folder) as scan:
        entries = sorted(scan, key=lambda entry: entry.name.encode("utf-8", "surrogateescape"))
    for entry in entries:
        relative = f"{prefix}{entry.name}"
        if entry.is_dir():
            yield from _walk(Path(entry.path), relative + "/")
        elif entry.is_file():
            stat = entry.stat()
            yield f"{_escape(relative)}\t{stat.st_size}\t{stat.st_mtime_ns}"


def _escape(name: str) -> str:
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace").replace("\t", "\\t")


def corpus_fingerprint(corpus_dir: str | Path) -> str:
    """SHA-256 of the listing (hex): changes whenever a file is added, removed, resized or touched."""
    digest = hashlib.sha256()
    for line in corpus_listing(corpus_dir):
        digest.update(line.encode("utf-8") + b"\n")
    return digest.hexdigest()


def write_listing(corpus_dirs: Sequence[str | Path], path: str | Path) -> bool:
    """Write the listing of ``corpus_dirs`` to ``path`` when it differs from what is there; returns whether it did.

    An unchanged listing keeps its file (and its modification time), so Snakemake sees no
    newer input. The new file replaces the old one whole (written aside, then renamed).

    Raises:
        AsrflowError: when one of ``corpus_dirs`` is not a folder (nothing is written).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            for folder in corpus_dirs:
                handle.write(f"# {_escape(str(folder))}\n")
                for line in corpus_listing(folder):
                    handle.write(line + "\n")
        if path.is_file() and _same_bytes(tmp, path):
            return False
        os.replace(tmp, path)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _same_bytes(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as first, open(b, "rb") as second:
        while True:
            block = first.read(1 << 20)
            if block != second.read(1 << 20):
                return False
            if not block:
                return True
