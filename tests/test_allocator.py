"""glibc's malloc under a long training run: fixed thresholds, and free heap pages handed back."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asrflow.allocator import _glibc

pytestmark = pytest.mark.skipif(_glibc() is None, reason="the C library here is not glibc")

_HOLES = """
from pathlib import Path
from asrflow.allocator import release_free_memory, tune_malloc

def rss_mb():
    lines = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in lines if line.startswith("VmRSS:")).split()[1]) / 1024

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
    out = subprocess.run([sys.executable, "-c", _HOLES], capture_output=True, text=True, check=True).stdout
    before, after = (float(value) for value in out.split())
    assert before - after > 150, (before, after)
