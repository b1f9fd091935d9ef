"""Memory under a long training run: glibc's fixed thresholds, free heap pages handed back, oneDNN's cache capped."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from asrflow.allocator import FP32_TRAINING_MMAP_THRESHOLD, MMAP_THRESHOLD, glibc_malloc, training_mmap_threshold

pytestmark = pytest.mark.skipif(not glibc_malloc(), reason="the C library here is not glibc")

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
weight = torch.randn(256, 144, dtype=torch.bfloat16)
torch.nn.functional.linear(torch.randn(1, 144, dtype=torch.bfloat16), weight)
before = rss_mb()
for frames in range(1000, 1400):  # 400 batch shapes, as 400 steps of padded batches bring
    torch.nn.functional.linear(torch.randn(frames, 144, dtype=torch.bfloat16), weight)
release_free_memory()
print(rss_mb() - before)
"""


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_onednn_cache_limit_keeps_memory_from_growing_with_batch_shapes():
    """bf16 products over 400 new shapes leave oneDNN primitives behind: about 220 MB at oneDNN's default
    cache of 1,024, about 120 MB at asrflow's 64."""
    env = {key: value for key, value in os.environ.items() if key != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    growth = {}
    for mode in ("default", "limited"):
        command = [sys.executable, "-c", _RSS_MB + _SHAPES, mode]
        growth[mode] = float(subprocess.run(command, capture_output=True, text=True, check=True, env=env).stdout)
    assert growth["default"] - growth["limited"] > 50, growth


def test_fp32_training_maps_only_large_blocks_and_low_precision_keeps_the_low_threshold():
    """fp32 steps fault in their activations anew under the low threshold (1.65x slower, bench/RESULTS.md)."""
    assert training_mmap_threshold("fp32") == FP32_TRAINING_MMAP_THRESHOLD == 32 << 20
    assert training_mmap_threshold("bf16") == training_mmap_threshold("fp16") == MMAP_THRESHOLD == 1 << 20
