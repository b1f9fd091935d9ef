"""An external sort for manifest lines: memory bounded by one chunk, whatever the corpus size.

:class:`SortedSpool` takes ``(key, line)`` pairs in any order and gives them back sorted by
key, stable (equal keys come back in the order they were added). Up to ``chunk_lines``
pairs are held in memory; each full chunk is sorted and written to a temporary file in
``folder``, and :meth:`SortedSpool.drain` merges the files (``heapq.merge``). Memory:
``chunk_lines`` lines plus one line per written chunk; disk: every line once.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from pathlib import Path

#: Lines held in memory before a sorted chunk is written to disk.
DEFAULT_CHUNK_LINES = 20_000


class SortedSpool:
    """Collect ``(key, line)`` pairs; :meth:`drain` yields them sorted by key (stable).

    Keys and lines must not contain a newline; keys must not contain a tab.
    """

    def __init__(self, folder: Path, name: str, *, chunk_lines: int = DEFAULT_CHUNK_LINES) -> None:
        if chunk_lines < 1:
            raise ValueError(f"chunk_lines must be >= 1, got {chunk_lines}")
        self.folder = Path(folder)
        self.name = name
        self.chunk_lines = chunk_lines
        self.buffer: list[tuple[str, str]] = []
        self.chunks: list[Path] = []
        self.count = 0

    def add(self, key: str, line: str) -> None:
        """Add one pair; writes a sorted chunk when the buffer is full."""
        self.buffer.append((key, line))
        self.count += 1
        if len(self.buffer) >= self.chunk_lines:
            self._flush()

    def _flush(self) -> None:
        if not self.buffer:
            return
        self.buffer.sort(key=lambda pair: pair[0])  # stable: equal keys keep their order
        path = self.folder / f"{self.name}.{len(self.chunks):05d}.spool"
        with open(path, "w", encoding="utf-8") as handle:
            handle.writelines(f"{key}\t{line}\n" for key, line in self.buffer)
        self.chunks.append(path)
        self.buffer = []

    def drain(self) -> Iterator[tuple[str, str]]:
        """Every pair added, sorted by key; the chunk files are removed once read."""
        if not self.chunks:
            self.buffer.sort(key=lambda pair: pair[0])
            yield from self.buffer
            self.buffer = []
            return
        self._flush()
        handles = [open(path, encoding="utf-8") for path in self.chunks]  # noqa: SIM115 - closed below
        try:
            streams = [_pairs(handle, index) for index, handle in enumerate(handles)]
            for key, _, line in heapq.merge(*streams):
                yield key, line
        finally:
            for handle in handles:
                handle.close()
            for path in self.chunks:
                path.unlink(missing_ok=True)
            self.chunks = []


def _pairs(handle, index: int) -> Iterator[tuple[str, tuple[int, int], str]]:
    """``(key, (chunk, position), line)``: the middle field keeps the merge stable."""
    for position, text in zip(itertools.count(), handle, strict=False):
        key, _, line = text.rstrip("\n").partition("\t")
        yield key, (index, position), line
