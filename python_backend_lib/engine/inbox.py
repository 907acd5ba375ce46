"""The windows submitted to an engine, on their way from the submitting threads to its own.

Any thread submits; the engine thread takes what has arrived between two decoder steps,
and, with nothing to do, takes the first window at once. A caller handing on several
windows at once (one `execute` call's requests, `transcribe_many`'s recordings) gathers
them (`gathering`): they arrive as one group, encoded in one pass, rather than the first
alone and the rest a step later in a pass of their own.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator

from python_backend_lib.engine.rows import Admission


class Inbox:
    """Groups of windows, in the order they were put; None marks the engine's close()."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[list[Admission] | None] = queue.SimpleQueue()
        self._put = 0  # windows put, by submitters (under the engine's lock)
        self._taken = 0  # windows taken, by the engine thread
        self._local = threading.local()  # `group`: the windows of this thread's open `gathering`

    @property
    def waiting(self) -> int:
        """Windows put and not taken yet (approximate from other threads)."""
        return self._put - self._taken

    def put(self, group: list[Admission] | None) -> None:
        if group is not None:
            self._put += len(group)
        self._queue.put(group)

    def take(self, block: bool = False, timeout: float | None = None) -> list[Admission] | None:
        """The next group (or close()'s None); queue.Empty if none came."""
        group = self._queue.get(block, timeout)
        if group is not None:
            self._taken += len(group)
        return group

    def hold(self, admission: Admission) -> bool:
        """Keep `admission` in this thread's open gathering, if there is one."""
        group = getattr(self._local, "group", None)
        if group is not None:
            group.append(admission)
        return group is not None

    @contextlib.contextmanager
    def gathering(self) -> Iterator[list[Admission] | None]:
        """Hold this thread's windows (`hold`) in the group it yields, for the caller to
        put as the block ends; None inside another gathering, which holds them."""
        if getattr(self._local, "group", None) is not None:
            yield None
            return
        self._local.group = group = []
        try:
            yield group
        finally:
            self._local.group = None
