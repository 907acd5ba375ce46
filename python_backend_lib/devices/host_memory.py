"""Giving the host memory that a process has freed back to the system.

glibc's allocator keeps freed memory in its heaps for reuse. After a burst of
large requests (two-minute waveforms, their features and activations) a
server that has gone idle would go on holding the burst's peak; `malloc_trim`
returns the free pages of every heap. Elsewhere than glibc this does nothing.
A process gives it back once its work pauses (`IdleRelease`, or the engine's own
loop), never under load, where the pages would be taken again at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
from collections.abc import Callable

# Idle this long, a process gives freed host memory back: long enough that a server
# under load never pays for it between two requests.
IDLE_RELEASE_S = 1.0


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


class IdleRelease:
    """Gives freed memory back once a process's work has paused: `idle_s` after the last
    piece of work ended with no other begun, once per pause. For a process whose work
    arrives on several threads (the preprocessing model's decoding pool), where no one
    thread sees the whole pause, as the engine's loop does for its own."""

    def __init__(self, idle_s: float = IDLE_RELEASE_S, release: Callable[[], bool] = release_free_memory) -> None:
        self.idle_s = idle_s
        self.releases = 0
        self._release = release
        self._busy = 0
        self._changes = 0  # every begin and end: a pause is the same count for idle_s
        self._released_at = 0  # the count when memory was last given back
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._watch, name="idle-release", daemon=True)
        self._thread.start()

    def begin(self) -> None:
        with self._changed:
            self._busy += 1
            self._changes += 1

    def end(self) -> None:
        with self._changed:
            self._busy -= 1
            self._changes += 1
            self._changed.notify()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join()

    def _watch(self) -> None:
        with self._changed:
            while not self._closed:
                if self._busy or self._changes == self._released_at:  # working, or given back since
                    self._changed.wait()
                    continue
                pause = self._changes
                self._changed.wait_for(lambda: self._closed or self._changes != pause, timeout=self.idle_s)
                if self._closed or self._changes != pause:
                    continue
                self._released_at = pause
                self._changed.release()  # work may begin while memory is given back
                try:
                    self.releases += self._release()
                finally:
                    self._changed.acquire()
