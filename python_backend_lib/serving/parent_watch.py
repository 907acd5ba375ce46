"""Ends a model's process once tritonserver is gone.

Triton runs each Python model in a stub process of its own, which is meant to
exit when it finds its parent dead. Triton 2.51's whisper stub does not, once it
has served a request: killed with `kill -9`, or stopped by its exit timeout
before it unloaded the whisper model (clients holding connections open delay
that), tritonserver leaves the whisper stub running, with the weights, the KV
slots and on a GPU its memory, for good; a GPU instance of preprocessing would keep
its GPU memory too, and on a busy host the postprocessing stubs outlived it by seconds.
Every model runs this watch: it asks every `interval_s`
whether the process that started this one is still its parent and, once it is
not, ends the process: there is nobody left to answer.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0
ORPHANED_EXIT_STATUS = 1


def _exit_now() -> None:
    os._exit(ORPHANED_EXIT_STATUS)  # no cleanup: it would wait on a parent that is gone


class ParentWatch:
    """Calls `on_orphaned` (default: end the process at once) once this process's
    parent is no longer the one it had when the watch started."""

    def __init__(self, interval_s: float = CHECK_INTERVAL_S, on_orphaned: Callable[[], None] = _exit_now) -> None:
        self.parent = os.getppid()
        self.interval_s = interval_s
        self.on_orphaned = on_orphaned
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="parent-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if os.getppid() != self.parent:
                log.error("tritonserver (process %d) is gone; this model's process ends", self.parent)
                self.on_orphaned()
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 1)
