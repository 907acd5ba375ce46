"""Which requests their clients gave up on, learned in bulk on a thread of its own.

Asking Triton whether a request was cancelled is a round trip from the Python
stub to the server process (`InferenceRequest.is_cancelled()` blocks on it).
Asked from the engine thread for every running request, it would stall every
decoder step; so one watcher thread asks for all requests in flight every
`interval_s` and keeps a flag per request that the engine reads for free.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

# A cancelled request is noticed within this long (plus one decoder step), so its
# slot is freed well within a second.
POLL_INTERVAL_S = 0.25


class Watch:
    """One request's flag: `cancelled()` is what the engine calls between steps.

    A request must never be asked once it has been answered: Triton frees its
    response factory with the final response, and asking then crashes the
    server. `forget` therefore waits for a question in progress and stops any
    later one, under the watch's own lock.
    """

    __slots__ = ("_ask", "_flag", "_forgotten", "_lock")

    def __init__(self, ask: Callable[[], bool]) -> None:
        self._ask = ask
        self._flag = False
        self._forgotten = False
        self._lock = threading.Lock()

    def cancelled(self) -> bool:
        return self._flag

    def poll(self) -> None:
        with self._lock:
            if not (self._flag or self._forgotten):
                self._flag = bool(self._ask())

    def forget(self) -> None:
        with self._lock:
            self._forgotten = True


class CancellationWatcher:
    """Polls every watched request's `is_cancelled` from its own daemon thread."""

    def __init__(self, interval_s: float = POLL_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._watches: set[Watch] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="whisper-cancellation", daemon=True)
        self._thread.start()

    def watch(self, is_cancelled: Callable[[], bool]) -> Watch:
        """Start watching a request (pass its `is_cancelled`); `forget` it once answered."""
        watch = Watch(is_cancelled)
        with self._lock:
            self._watches.add(watch)
        return watch

    def forget(self, watch: Watch) -> None:
        """Stop watching; once this returns the request is never asked again."""
        watch.forget()
        with self._lock:
            self._watches.discard(watch)

    @property
    def watched(self) -> int:
        return len(self._watches)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                watches = list(self._watches)
            for watch in watches:
                try:
                    watch.poll()
                except Exception:  # a request answered meanwhile, or the stub shutting down
                    log.debug("could not ask whether a request was cancelled", exc_info=True)
