"""Which requests their clients gave up on, learned in bulk on a thread of its own.

Asking Triton whether a request was cancelled is a round trip from the Python
stub to the server process (`InferenceRequest.is_cancelled()` blocks on it).
Asked from the engine thread for every running request, it would stall every
decoder step; so one watcher thread asks for all requests in flight every
`interval_s` and keeps a flag per request that the engine reads for free.

Triton 2.51 never tells a running step of an ensemble that its client cancelled
(triton-inference-server/server#6739), so a request sent to `transcribe` is
cancelled another way: the client names it (request parameter `request_id`) and,
to give up, sends the `whisper` model a cancel request naming that id. Whichever
whisper instance gets it flags the request at once if it holds it, and posts the
id on the server's `CancelBoard`, a folder that every other instance (a process
each) reads on the same poll; the one holding the request drops it. An id posted for a request that already finished, or
never came, harms nobody and is swept away after `POSTED_FOR_S`.

The launcher uses the same board to end a stop: when its drain runs out with
requests still in flight, it posts STOPPING, and every instance answers what it
holds at once (`ServerUnavailable`) instead of leaving Triton to wait out its exit
timeout with clients that would never hear back.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# A cancelled request is noticed within this long (plus one decoder step), so its
# slot is freed well within a second.
POLL_INTERVAL_S = 0.25
# A posted id waits this long for its request: a cancel may come while the request
# is still queued or its audio decoded, before it reaches the whisper model.
POSTED_FOR_S = 600.0
# The mark of a stopping server: no request id starts with a dot (`parameters.REQUEST_ID_PATTERN`).
STOPPING = ".stopping"


def board_folder(server_pid: int) -> Path:
    """The cancel board of the tritonserver process `server_pid` (the parent of every whisper instance)."""
    return Path(tempfile.gettempdir()) / f"whisper-triton-cancels-{server_pid}"


class CancelBoard:
    """Request ids whose clients gave up, shared by one server's whisper instances:
    a file per id in `folder`, so that a cancel reaches whichever process holds it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def post(self, request_id: str) -> None:
        """Cancel the request of this id (`parameters.REQUEST_ID_PATTERN` makes it a plain file name)."""
        self.folder.mkdir(mode=0o700, exist_ok=True)
        (self.folder / request_id).touch()

    def post_stopping(self) -> None:
        """The server is stopping: every instance answers what it holds now."""
        self.post(STOPPING)

    def posted(self) -> set[str]:
        """The ids posted, and STOPPING once the server stops."""
        try:
            return set(os.listdir(self.folder))
        except FileNotFoundError:
            return set()

    def remove(self, request_id: str) -> None:
        (self.folder / request_id).unlink(missing_ok=True)

    def sweep(self, request_ids: set[str], now: float) -> None:
        """Remove those of `request_ids` posted more than POSTED_FOR_S before `now` (wall-clock seconds)."""
        for request_id in request_ids:
            try:
                if now - (self.folder / request_id).stat().st_mtime > POSTED_FOR_S:
                    self.remove(request_id)
            except FileNotFoundError:  # another instance's request, just answered
                pass

    def close(self) -> None:
        """Remove the folder (the server is stopping: nothing is left to cancel)."""
        shutil.rmtree(self.folder, ignore_errors=True)


class Watch:
    """One request's flag: `cancelled()` is what the engine calls between steps.

    A request must never be asked once it has been answered: Triton frees its
    response factory with the final response, and asking then crashes the
    server. `forget` therefore waits for a question in progress and stops any
    later one, under the watch's own lock.
    """

    __slots__ = ("_ask", "_flag", "_forgotten", "_lock", "request_id")

    def __init__(self, ask: Callable[[], bool], request_id: str | None = None) -> None:
        self._ask = ask
        self.request_id = request_id  # the client's name for it, looked for on the CancelBoard
        self._flag = False
        self._forgotten = False
        self._lock = threading.Lock()

    def cancelled(self) -> bool:
        return self._flag

    def poll(self) -> None:
        with self._lock:
            if not (self._flag or self._forgotten):
                self._flag = bool(self._ask())

    def cancel(self) -> None:
        """Its id was posted on the CancelBoard."""
        self._flag = True

    def forget(self) -> None:
        with self._lock:
            self._forgotten = True


class CancellationWatcher:
    """Polls every watched request's `is_cancelled`, and the board for their ids, from its own daemon thread."""

    def __init__(
        self,
        board: CancelBoard | None = None,
        interval_s: float = POLL_INTERVAL_S,
        on_stopping: Callable[[], None] | None = None,
    ) -> None:
        """on_stopping: called once, on the watcher's thread, when the board says STOPPING."""
        self.board = board
        self.interval_s = interval_s
        self._on_stopping = on_stopping
        self.stopping = False
        self._watches: set[Watch] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="whisper-cancellation", daemon=True)
        self._thread.start()

    def watch(self, is_cancelled: Callable[[], bool], request_id: str | None = None) -> Watch:
        """Start watching a request (pass its `is_cancelled`, and the client's id for it if any);
        `forget` it once answered."""
        watch = Watch(is_cancelled, request_id)
        with self._lock:
            self._watches.add(watch)
        return watch

    def post(self, request_id: str) -> None:
        """A cancel for `request_id` came to this instance: posted on the board for the
        others, and a request of that id held here is flagged now, not at the next poll."""
        if self.board is not None:
            self.board.post(request_id)
        with self._lock:
            held = [watch for watch in self._watches if watch.request_id == request_id]
        for watch in held:
            watch.cancel()

    def forget(self, watch: Watch) -> None:
        """Stop watching; once this returns the request is never asked again."""
        watch.forget()
        with self._lock:
            self._watches.discard(watch)
        if self.board is not None and watch.request_id is not None and watch.cancelled():
            self.board.remove(watch.request_id)

    @property
    def watched(self) -> int:
        return len(self._watches)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self.board is not None:
            self.board.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                watches = list(self._watches)
            posted = self._read_board(watches)
            if STOPPING in posted and not self.stopping:
                self.stopping = True
                if self._on_stopping is not None:
                    self._on_stopping()
            for watch in watches:
                if watch.request_id in posted:
                    watch.cancel()
                    continue
                try:
                    watch.poll()
                except Exception:  # a request answered meanwhile, or the stub shutting down
                    log.debug("could not ask whether a request was cancelled", exc_info=True)

    def _read_board(self, watches: list[Watch]) -> set[str]:
        """The ids posted on the board; those of no request here that are old enough are swept away."""
        if self.board is None:
            return set()
        try:
            posted = self.board.posted()
            if posted:
                self.board.sweep(posted - {w.request_id for w in watches} - {STOPPING}, time.time())
            return posted
        except OSError:  # a board that cannot be read cancels nothing; Triton's own cancels still come
            log.warning("could not read the cancel board %s", self.board.folder, exc_info=True)
            return set()
