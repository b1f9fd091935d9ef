"""Keeping a process's memory flat under glibc's ``malloc`` while it works on batches of varying shapes.

Batches of varying shapes free and allocate blocks of ever-different sizes. glibc's default
policy raises its ``mmap`` threshold each time a large block is freed, so later blocks of
that size come from the heap, whose free holes it rarely gives back: the resident set creeps
with the number of shapes seen (bench/RESULTS.md, "Trainer memory at scale"). Here:

* :func:`tune_malloc` fixes the threshold (blocks of 1 MiB and more are mapped and
  unmapped whole), fixes the trim threshold, and caps the per-thread arenas;
* :func:`release_free_memory` hands the heap's free pages back (``malloc_trim``); the
  training data loader calls it every few batches.

Elsewhere than glibc (musl, macOS, jemalloc or tcmalloc preloaded) both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger(__name__)

#: ``mallopt`` parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
#: Blocks from this size up are mmapped, so freeing them returns their pages (bytes).
MMAP_THRESHOLD = 1 << 20
#: Free memory at the heap's top above this is returned at once (bytes).
TRIM_THRESHOLD = 64 << 20
#: At most this many malloc arenas (glibc's default is 8 per core).
ARENA_MAX = 2


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc's malloc that serves this process, else None."""
    if "jemalloc" in os.environ.get("LD_PRELOAD", "") or "tcmalloc" in os.environ.get("LD_PRELOAD", ""):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.malloc_trim, libc.mallopt  # noqa: B018 (both must exist)
    except (OSError, AttributeError):
        return None
    return libc


def tune_malloc() -> bool:
    """Set the thresholds and arena cap above for this process; True when glibc took them."""
    libc = _glibc()
    if libc is None:
        return False
    done = all(
        libc.mallopt(option, value) == 1
        for option, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_ARENA_MAX, ARENA_MAX),
        )
    )
    if not done:
        logger.warning("glibc refused a malloc setting; memory may creep with the number of batch shapes")
    return done


def release_free_memory() -> None:
    """Return the free pages of every malloc arena to the system (glibc only; a few ms)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
