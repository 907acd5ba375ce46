"""The live session limit, one for every gateway process (`workers`).

Each process counts the sessions it runs in its own place of an array that the
processes share, and a new session is taken while the sum of all is under the
limit. A process that dies takes its sessions with it; whoever replaces it sets
its count back to zero (`workers`).
"""

from __future__ import annotations

import multiprocessing
from typing import Any, Protocol


class SessionCounts(Protocol):
    """Live sessions by gateway process (a `multiprocessing` shared array), behind one lock."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> int: ...

    def __setitem__(self, index: int, value: int) -> None: ...

    def get_lock(self) -> Any: ...


def session_counts(processes: int = 1) -> SessionCounts:
    """A zero count for each gateway process, in memory they can all share (each is
    started with it: `workers`)."""
    return multiprocessing.get_context("spawn").Array("i", processes)


class SessionSlots:
    """How many live sessions run, against one limit for every gateway process: this
    process counts its own at `index` of the shared `counts`, and a session is taken
    while the sum of all is under the limit."""

    def __init__(self, limit: int, counts: SessionCounts | None = None, index: int = 0) -> None:
        self.limit = limit
        self.counts = counts if counts is not None else session_counts()
        self.index = index

    def take(self) -> bool:
        with self.counts.get_lock():
            if sum(self.counts) >= self.limit:
                return False
            self.counts[self.index] += 1
            return True

    def release(self) -> None:
        with self.counts.get_lock():
            self.counts[self.index] -= 1
