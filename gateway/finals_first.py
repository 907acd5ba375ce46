"""Finals before hypotheses: while a live turn's final transcription waits for room on an
overloaded server, the sessions of this gateway process send no hypotheses.

A hypothesis the server refuses as overloaded is only skipped, and the turn's next one
comes once its audio has grown by the cadence; a refused final is asked again after a
pause (`live_turn.FINAL_RETRY_PAUSES_S`). With many sessions on a server at its request
limit, hypotheses sent every cadence took each place that a finished request freed
before a final's next try came, and turns failed after the last pause. A final's text is
what a caption keeps, where a hypothesis's is replaced a moment later, so the final goes
first. The gate holds for this process only: other gateway processes' sessions go on
sending.

One event loop runs a process's sessions, so the count needs no lock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class FinalsFirst:
    """How many of this process's final transcriptions wait for room on the server."""

    def __init__(self) -> None:
        self._waiting = 0

    @property
    def holding(self) -> bool:
        """Whether a final waits for room: hypotheses are not sent meanwhile."""
        return self._waiting > 0

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Held while a refused final waits and is asked again."""
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1
