"""Keeping a process's memory flat while it works on batches of varying shapes: which ``malloc`` serves it,
glibc's settings, oneDNN's cache.

Batches of varying shapes free and allocate blocks of ever-different sizes. glibc's default
policy raises its ``mmap`` threshold each time a large block is freed, so later blocks of
that size come from the heap, whose free holes it rarely gives back: the resident set creeps
with the number of shapes seen (bench/RESULTS.md#malloc-creep). Here:

* :func:`use_allocator` re-executes the process with jemalloc preloaded (``run.allocator``) to train
  in bf16: a malloc that returns freed pages on its own, where glibc's heap still grows around
  oneDNN's per-shape primitives (bench/RESULTS.md#jemalloc);
* without jemalloc, :func:`tune_malloc` fixes the threshold (blocks from it up are mapped and unmapped whole),
  fixes the trim threshold, and caps the per-thread arenas;
* :func:`release_free_memory` hands the heap's free pages back (``malloc_trim``); the
  training data loader calls it every few batches;
* :func:`limit_onednn_cache` caps the oneDNN primitives kept for reuse, in oneDNN's own cache and in
  PyTorch's cache in front of it (ideep's). On the CPU, bf16 matrix products go through oneDNN, and each
  new batch shape adds primitives with their own buffers to caches of 1,024 by default.

Without glibc's malloc (musl, macOS, jemalloc or tcmalloc preloaded) the glibc settings do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from asrflow.params import param_error

logger = logging.getLogger(__name__)

#: ``mallopt`` parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
#: Blocks from this size up are mmapped, so freeing them returns their pages (bytes). A fixed threshold
#: stops glibc from raising its own after each large free, which is what lets the heap's holes pile up
#: with every new batch shape; a low one stops most of that growth in bf16 and fp16 training at no cost in
#: step time (bench/RESULTS.md#mmap-threshold; what bf16 still gains over an hour: bench/RESULTS.md#jemalloc).
MMAP_THRESHOLD = 1 << 20
#: ... but fp32 activations are twice as large, so more of a step's blocks cross the low threshold and are
#: mapped, faulted in and unmapped anew at every step, which costs step time. fp32 training takes 32 MiB,
#: the ceiling of glibc's own moving threshold, and pays for the speed in resident memory
#: (bench/RESULTS.md#mmap-threshold; its level over an hour: bench/RESULTS.md#memory-hour).
FP32_TRAINING_MMAP_THRESHOLD = 32 << 20
#: Free memory at the heap's top above this is returned at once (bytes).
TRIM_THRESHOLD = 64 << 20
#: At most this many malloc arenas (glibc's default is 8 per core).
ARENA_MAX = 2
#: oneDNN primitives kept for reuse. A step reuses its own (its layers share shapes), so the cache
#: must hold one step's worth; padded batch shapes rarely repeat across steps, so more than that only
#: keeps dead primitives and their buffers resident. 0 would rebuild every primitive within a step
#: (bench/RESULTS.md#onednn-cache).
ONEDNN_CACHE_CAPACITY = 64
#: Primitives kept by PyTorch's own cache in front of oneDNN's (ideep's, which reads ``LRU_CACHE_CAPACITY``).
#: With AMX each of its entries holds buffers sized to its batch shape, so at its default of 1,024 it grows
#: with every shape an epoch brings; a hit here only saves a lookup in oneDNN's cache, so the same step's
#: worth is enough (bench/RESULTS.md#primitive-cache).
IDEEP_CACHE_CAPACITY = 64


#: Accepted values of ``run.allocator``: ``auto`` preloads jemalloc for the precisions of
#: :data:`JEMALLOC_PRECISIONS` when it is installed and keeps the C library's malloc otherwise; ``jemalloc``
#: requires it; ``system`` keeps the C library's.
ALLOCATORS = ("auto", "jemalloc", "system")
#: ``train.optim.precision`` values that ``auto`` trains under jemalloc. In bf16 on a CPU glibc's heap creeps
#: around oneDNN's per-shape primitives and jemalloc is level and faster. In fp32 glibc's (with its thresholds
#: fixed) is the faster, since jemalloc hands the large activations' pages back and faults them in anew at every
#: step; it is level with the frame axis padded, as the real-corpus preset trains, and creeps unpadded, where
#: ``run.allocator: jemalloc`` is the choice for long runs (bench/RESULTS.md#memory-hour).
#: ``auto`` is fp32 on every CPU, and on a GPU the host's malloc serves little of a step.
JEMALLOC_PRECISIONS = ("bf16",)
#: Set in the environment of a process re-executed by :func:`use_allocator`, so that it never re-executes twice
#: (a preload the dynamic loader refused leaves the process on the C library's malloc).
REEXECUTED_FLAG = "ASRFLOW_ALLOCATOR_REEXECUTED"
#: The preloadable allocators, by the name their library file starts with.
PRELOADED_ALLOCATORS = ("jemalloc", "tcmalloc")


def find_jemalloc() -> str | None:
    """The jemalloc library the dynamic loader can preload (a soname such as ``libjemalloc.so.2``, which it
    finds on its own search path), or None when none is installed, and off Linux (``LD_PRELOAD`` is its
    loader's)."""
    return ctypes.util.find_library("jemalloc") if sys.platform.startswith("linux") else None


def loaded_allocator(maps: Path = Path("/proc/self/maps")) -> str | None:
    """``jemalloc`` or ``tcmalloc`` when such a library is mapped into this process (``maps``: the process's
    memory map), else None: it serves ``malloc`` only when preloaded. Where there is no ``/proc`` (macOS), what
    ``LD_PRELOAD`` names."""
    try:
        mapped = maps.read_text()
    except OSError:
        mapped = os.environ.get("LD_PRELOAD", "")
    return next((name for name in PRELOADED_ALLOCATORS if f"lib{name}" in mapped), None)


def environment_with_jemalloc(environ: Mapping[str, str], library: str) -> dict[str, str]:
    """``environ`` with ``library`` first in ``LD_PRELOAD`` (what was there is kept after it)."""
    preload = " ".join(filter(None, (library, environ.get("LD_PRELOAD", ""))))
    return {**environ, "LD_PRELOAD": preload}


def jemalloc_to_preload(choice: str, precision: str) -> str | None:
    """The jemalloc library to preload for ``run.allocator`` = ``choice`` (one of :data:`ALLOCATORS`) when
    training in ``train.optim.precision`` = ``precision``, or None for the C library's malloc. Raises
    :class:`~asrflow.errors.AsrflowError` for an unknown ``choice``, or for ``jemalloc`` when none is installed."""
    if choice not in ALLOCATORS:
        raise param_error("run", "allocator", choice, f"is not valid; use one of {', '.join(ALLOCATORS)}")
    wanted = choice == "jemalloc" or (choice == "auto" and precision in JEMALLOC_PRECISIONS)
    library = find_jemalloc() if wanted else None
    if library is None and choice == "jemalloc":
        raise param_error(
            "run",
            "allocator",
            choice,
            "needs a jemalloc library and none is installed: install one (Debian "
            "and Ubuntu: apt install libjemalloc2; conda: conda install jemalloc) or set run.allocator: auto",
        )
    return library


def use_allocator(choice: str, precision: str) -> None:
    """Make this process's malloc the one ``run.allocator`` = ``choice`` asks for when training in ``precision``:
    when that is jemalloc and it is not loaded yet, re-execute the process's own command line (``sys.orig_argv``)
    with it preloaded, so its data workers and any torchrun ranks inherit it; else return. Call it first thing in
    a process's entry point: what ran before the re-execution runs again. Errors as :func:`jemalloc_to_preload`."""
    library = jemalloc_to_preload(choice, precision)
    if library is None or loaded_allocator() is not None:
        return
    if os.environ.get(REEXECUTED_FLAG):
        logger.warning("LD_PRELOAD=%s did not load (see the loader's message above): glibc's malloc serves", library)
        return
    logging.shutdown()  # flush what was logged and printed before the process image is replaced
    sys.stdout.flush()
    sys.stderr.flush()
    environ = environment_with_jemalloc(os.environ, library) | {REEXECUTED_FLAG: "1"}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)


def malloc_in_use() -> str:
    """Which ``malloc`` serves this process: ``jemalloc``, ``tcmalloc``, ``glibc`` or ``system`` (another C
    library's), for the logs."""
    return loaded_allocator() or ("glibc" if glibc_malloc() else "system")


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc's malloc that serves this process, else None."""
    if loaded_allocator() is not None:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        libc.malloc_trim, libc.mallopt  # noqa: B018 (both must exist)
    except (OSError, AttributeError):
        return None
    return libc


def glibc_malloc() -> bool:
    """Whether glibc's ``malloc`` serves this process: :func:`tune_malloc` and :func:`release_free_memory` act
    only then (not under musl or macOS, nor with jemalloc or tcmalloc in ``LD_PRELOAD``)."""
    return _glibc() is not None


def training_mmap_threshold(precision: str) -> int:
    """The mmap threshold (bytes) for training in ``precision`` (fp32, bf16 or fp16)."""
    return FP32_TRAINING_MMAP_THRESHOLD if precision == "fp32" else MMAP_THRESHOLD


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Set ``mmap_threshold`` (bytes), the trim threshold and the arena cap above for this process;
    True when glibc took them."""
    libc = _glibc()
    if libc is None:
        return False
    done = all(
        libc.mallopt(option, value) == 1
        for option, value in (
            (M_MMAP_THRESHOLD, mmap_threshold),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_ARENA_MAX, ARENA_MAX),
        )
    )
    if not done:
        logger.warning("glibc refused a malloc setting; memory may creep with the number of batch shapes")
    return done


def release_free_memory() -> None:
    """Return the free pages of every malloc arena to the system (glibc only). It walks every arena, so
    callers run it every few batches rather than at every free."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def limit_onednn_cache() -> None:
    """Cap oneDNN's primitive cache at :data:`ONEDNN_CACHE_CAPACITY` and PyTorch's in front of it at
    :data:`IDEEP_CACHE_CAPACITY`, each unless its variable (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``,
    ``LRU_CACHE_CAPACITY``) is set. Both are read when the first primitive is built: call this before any model
    runs."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(IDEEP_CACHE_CAPACITY))
