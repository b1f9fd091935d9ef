"""Memory under a long training run: glibc's fixed thresholds, free heap pages handed back, oneDNN's cache capped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from asrflow.allocator import glibc_malloc
from asrflow.training.tune import Machine

pytestmark = pytest.mark.skipif(not glibc_malloc(), reason="the C library here is not glibc")

#: The variables that size oneDNN's primitive cache and PyTorch's in front of it (asrflow.allocator.limit_onednn_cache).
CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
#: The resident set in MB, put before each script below (each runs in a fresh interpreter).
_RSS_MB = """
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
"""

_HOLES = """
from asrflow.allocator import release_free_memory, tune_malloc

assert tune_malloc()
blocks = [bytearray(512 * 1024) for _ in range(400)]  # 200 MB of heap blocks, below the mmap threshold
top = bytearray(512 * 1024)  # the heap's top stays in use: freeing the rest leaves holes below it
del blocks
before = rss_mb()
release_free_memory()
print(before, rss_mb())
"""


def test_free_heap_pages_below_a_block_in_use_go_back_to_the_system():
    """200 MB freed under a block still in use stay resident (glibc only trims the heap's top)
    until release_free_memory hands their pages back."""
    out = subprocess.run([sys.executable, "-c", _RSS_MB + _HOLES], capture_output=True, text=True, check=True).stdout
    before, after = (float(value) for value in out.split())
    assert before - after > 150, (before, after)


_SHAPES = """
import sys
import torch
from asrflow.allocator import limit_onednn_cache, release_free_memory, tune_malloc

tune_malloc()
if sys.argv[1] == "limited":
    limit_onednn_cache()
torch.set_num_threads(1)
weight = torch.randn(576, 144, dtype=torch.bfloat16, requires_grad=sys.argv[2] == "backward")


def step(frames):
    product = torch.nn.functional.linear(torch.randn(frames, 144, dtype=torch.bfloat16), weight)
    if weight.requires_grad:
        product.sum().backward()


step(1)
before = rss_mb()
for frames in range(1024, 1024 + 64 * int(sys.argv[3]), 64):  # as padded batches bring new shapes, step by step
    step(frames)
release_free_memory()
print(rss_mb() - before)
"""


def growth_over_shapes(passes: str, shapes: int, **environment: str) -> dict[str, float]:
    """MB the resident set grows by over bf16 products of ``shapes`` new shapes (``passes``: ``forward`` or
    ``backward``, a training step's), with oneDNN's caches at their defaults and capped by asrflow, in a fresh
    interpreter each; ``environment`` is set in both."""
    env = {key: value for key, value in os.environ.items() if key not in CACHE_VARIABLES} | environment
    growth = {}
    for mode in ("default", "limited"):
        command = [sys.executable, "-c", _RSS_MB + _SHAPES, mode, passes, str(shapes)]
        growth[mode] = float(subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout)
    return growth


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 itself (AVX512-BF16 or AMX), so that PyTorch hands bf16 products to
    oneDNN's bf16 kernels rather than converting them."""
    return bool({"avx512_bf16", "amx_bf16"} & set(Machine.here().flags))


needs_onednn_bf16 = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and native_bf16()),
    reason="oneDNN's bf16 kernels do not run here (a torch without oneDNN, or a CPU without bf16 instructions)",
)


@pytest.mark.slow
@needs_onednn_bf16
def test_onednn_cache_limit_keeps_memory_from_growing_with_batch_shapes():
    """bf16 products over 400 new shapes leave oneDNN primitives behind, fewer with asrflow's cap; PyTorch's cache
    in front of it is capped in both runs, so that only oneDNN's own cache differs."""
    growth = growth_over_shapes("forward", 400, LRU_CACHE_CAPACITY="64")
    assert growth["default"] - growth["limited"] > 50, growth


@pytest.mark.slow
@needs_onednn_bf16
def test_pytorchs_own_primitive_cache_is_capped_too():
    """Training steps (forward and backward) over 200 new shapes, with oneDNN's own cache already capped: what
    PyTorch's cache in front of it keeps grows with the shapes unless asrflow caps it as well."""
    growth = growth_over_shapes("backward", 200, ONEDNN_PRIMITIVE_CACHE_CAPACITY="64")
    assert growth["default"] - growth["limited"] > 50, growth


#: Where glibc serves blocks of each size from once the train stage's threshold for a precision (argv[1]) is set:
#: its heap (``[heap]``, whose pages a freed block keeps for the next) or a mapping of their own (faulted in anew
#: each time). A 24 MB block freed first raises glibc's own moving threshold to 24 MB, as a step's large free does.
_WHERE_BLOCKS_GO = """
import ctypes, json, sys
from asrflow.allocator import training_mmap_threshold, tune_malloc

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]


def heap():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            return [int(bound, 16) for bound in line.split()[0].split("-")]
    return [0, 0]


def on_heap(size):
    block = libc.malloc(size)
    low, high = heap()
    libc.free(block)
    return low <= block < high


libc.free(libc.malloc(24 << 20))
assert tune_malloc(training_mmap_threshold(sys.argv[1]))
print(json.dumps({size >> 10: on_heap(size) for size in (512 << 10, 8 << 20, 40 << 20)}))
"""


def blocks_on_the_heap(precision: str) -> dict[str, bool]:
    """KiB -> whether a block that large comes from glibc's heap, in a fresh interpreter tuned for ``precision``."""
    command = [sys.executable, "-c", _WHERE_BLOCKS_GO, precision]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def test_fp32_training_maps_only_large_blocks_and_low_precision_keeps_the_low_threshold():
    """fp32 steps fault in their activations anew when blocks of a few MB are mapped (1.65x slower,
    bench/RESULTS.md): under fp32's setting an 8 MB block comes from the heap, only one over 32 MB is mapped. bf16
    and fp16 map it, though glibc's own threshold, raised by the 24 MB free, would have put it on the heap."""
    assert blocks_on_the_heap("fp32") == {"512": True, "8192": True, "40960": False}
    for precision in ("bf16", "fp16"):
        assert blocks_on_the_heap(precision) == {"512": True, "8192": False, "40960": False}, precision
