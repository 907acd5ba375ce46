"""Giving the host memory that a process has freed back to the system.

glibc's allocator keeps freed memory in its heaps for reuse. After a burst of
large requests (two-minute waveforms, their features and activations) a
server that has gone idle would go on holding the burst's peak; `malloc_trim`
returns the free pages of every heap. Elsewhere than glibc this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def release_free_memory() -> bool:
    """Return freed heap memory to the system; False where that cannot be done."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)  # ctypes lets go of the GIL for the call
    return True
