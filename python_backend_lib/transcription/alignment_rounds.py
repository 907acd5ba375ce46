"""The word alignments of the windows an engine step delivers together, run as one pass.

A window that asks for word timestamps is aligned on the engine thread, on the K/V
its decoding left in its slot, before the slot is freed (`alignment`). Aligned one at a
time, each window is an eager decoder pass of a few hundred launches and two reads back
to the host, paid while the running batch waits; live sessions ask it of every
hypothesis. So the engine opens a round around each delivery (`Engine.delivery_round`):
the windows' `align` calls made in it wait, and as it ends `Aligner.align_many` aligns
them all in one pass, then each caller's continuation runs with its result, still
before the slots are freed. Outside a round (another thread, or no engine step), a
window is aligned at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

from python_backend_lib.transcription.alignment import Aligned, Aligner, AlignmentRequest

log = logging.getLogger(__name__)

# What a window's caller continues with: its alignment, or why there is none.
Continuation = Callable[[Aligned | BaseException], None]


class AlignmentRounds:
    def __init__(self, aligner: Aligner) -> None:
        self.aligner = aligner
        self._local = threading.local()  # `waiting`: the open round's requests, on its thread

    def align(self, request: AlignmentRequest, then: Continuation) -> None:
        """Align `request`, then call `then` with the outcome: when the round open on this
        thread ends, or at once without one."""
        waiting = getattr(self._local, "waiting", None)
        if waiting is None:
            self._run([(request, then)])
        else:
            waiting.append((request, then))

    @contextlib.contextmanager
    def round(self) -> Iterator[None]:
        """Hold this thread's `align` calls until the block ends, then run them together."""
        self._local.waiting = waiting = []
        try:
            yield
        finally:
            self._local.waiting = None  # the continuations' own calls, if any, run at once
            self._run(waiting)

    def _run(self, waiting: list[tuple[AlignmentRequest, Continuation]]) -> None:
        if not waiting:
            return
        try:
            outcomes: list[Aligned | BaseException] = list(self.aligner.align_many([r for r, _ in waiting]))
        except Exception as error:  # each window's caller learns it
            outcomes = [error] * len(waiting)
        for (_, then), outcome in zip(waiting, outcomes):
            try:
                then(outcome)
            except Exception:
                log.exception("a word alignment's continuation raised")
