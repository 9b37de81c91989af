"""Actors give the heap's free pages back to the OS when their part of a transfer ends
(:func:`dcr_ray.heap.return_free_heap`)."""

import subprocess
import sys

import pytest

from dcr_ray.heap import return_free_heap

SCRIPT = r"""
import ctypes, numpy as np
from dcr_ray.heap import return_free_heap

def rss():
    with open("/proc/self/status") as f:
        return sum(int(l.split()[1]) for l in f if l.startswith(("RssAnon:",)))

big = np.ones(24 << 20, np.uint8); del big            # glibc raises its mmap threshold past 8 MiB blocks
blocks = [np.ones(8 << 20, np.uint8) for _ in range(24)]
keep = [np.ones(64, np.uint8) for _ in range(24)]     # small live blocks between them: no coalescing to the top
blocks = [b for i, b in enumerate(blocks) if i == len(blocks) - 1]  # freed, all but the top one
before = rss()
return_free_heap()
print(before, rss())
"""


def test_returning_the_free_heap_can_be_called_any_time():
    return_free_heap()
    return_free_heap()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_a_process_holds_less_after_it_returned_its_free_heap():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    before, after = map(int, out.stdout.split())
    assert after <= before
    assert before - after > 64 << 10  # KiB: most of the 23 freed 8 MiB blocks went back
