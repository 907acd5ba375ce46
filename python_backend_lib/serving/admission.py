"""Bounded admission: the whisper model holds at most so many requests.

The whisper model's `execute` hands each request to the engine and returns, so
Triton's own queue (`max_queue_size` in config.pbtxt) never sees the requests
that wait inside the engine for a decoding slot. Without a bound a burst above
capacity would wait there ever longer; with one, the admitted requests keep a
bounded latency: at most `limit` requests ahead of any one of them. The excess
is refused with UNAVAILABLE ("server overloaded, retry later"), at once or,
where several engines share Triton's queue, after `execute` waited a while for
room (`AdmissionPolicy`).

The ledger also keeps what monitoring needs: how many requests are in flight,
and each finished request's outcome, duration and audio length.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

from python_backend_lib.contract.faults import FAULT_PREFIXES, Fault

# Finished requests kept for a metrics reader between two reads; older ones are dropped.
MAX_RECENT_REQUESTS = 10_000


class Overloaded(Exception):
    """The server holds as many requests as it may; the client should retry later."""


@dataclass(eq=False)
class Entry:
    """One admitted request; `RequestLedger.leave` closes it (once)."""

    started: float = field(default_factory=time.monotonic)
    closed: bool = False


@dataclass(frozen=True)
class Finished:
    """A request's end, as monitoring sees it.

    outcome: the result (anything but an exception) or the exception it failed with.
    seconds: from `execute` to the answer; 0 for a request refused before admission.
    """

    outcome: object
    seconds: float


@dataclass(frozen=True)
class AdmissionPolicy:
    """limit: requests held at most (decoding plus waiting for a slot).
    wait_s: how long `execute` waits for room before it refuses a request. A
        model with several engines (instances) waits: while one engine's
        `execute` waits, Triton hands its queue to the others, so that requests
        go where there is room. Accepted up to a deep queue each, nothing keeps the
        engines' loads even, and beyond saturation the GPU idled while goodput fell
        (docs/benchmarks/engines.md, section 7)."""

    limit: int
    wait_s: float = 0.0


class RequestLedger:
    """Counts the requests in flight and refuses one more than `limit`.

    Thread-safe: `enter` runs on Triton's execute thread, `leave` on the engine's.
    """

    def __init__(self, limit: int, setting: str = "max_queued_requests") -> None:
        """limit: requests held at most (decoding plus waiting for a slot).
        setting: the configuration that sets the limit, named in the refusal."""
        if limit < 1:
            raise ValueError(f"the request limit must be at least 1, got {limit}")
        self.limit = limit
        self._setting = setting
        self._in_flight = 0
        self._room = threading.Condition(threading.Lock())
        self.recent: collections.deque[Finished] = collections.deque(maxlen=MAX_RECENT_REQUESTS)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def enter(self, deadline: float | None = None) -> Entry:
        """Admit one request; Overloaded when `limit` are in flight already and, given a
        `deadline` (time.monotonic()), none has left before it."""
        with self._room:
            if deadline is not None:
                self._room.wait_for(lambda: self._in_flight < self.limit, timeout=deadline - time.monotonic())
            if self._in_flight >= self.limit:
                raise Overloaded(
                    f"{FAULT_PREFIXES[Fault.OVERLOADED]}{self._in_flight} requests in flight, the limit "
                    f"(decoding slots + {self._setting}) is {self.limit}; retry later"
                )
            self._in_flight += 1
        return Entry()

    def leave(self, entry: Entry | None, outcome: object) -> None:
        """Record a request's end; `entry` None for one refused before `enter`
        (bad input, or overloaded). Closing an entry twice counts once."""
        seconds = 0.0
        if entry is not None:
            with self._room:
                if entry.closed:
                    return
                entry.closed = True
                self._in_flight -= 1
                self._room.notify()
            seconds = time.monotonic() - entry.started
        self.recent.append(Finished(outcome, seconds))
