"""No request waits forever on a stuck whisper instance: a watch that notices the stall.

The engine answers from one thread. If that thread never comes back (a device
call that does not return, a lost event, a deadlock), or the threads that send
the answers hang, nothing inside the engine raises, and every request it holds
would wait for good. A `StallWatch` thread reads a `Beat` every
`CHECK_INTERVAL_S`: the work done so far (engine loop turns and answers sent)
and the work held (requests admitted and not answered, `execute` calls not
returned). Held work with no progress for `bound_s` is a stall: `on_stall`
runs once, with the seconds it lasted, and the watch ends. The whisper service
then fails what it holds with an error naming the instance and where its
engine thread stands, and marks the engine unhealthy (`Engine.stall`), which
the metrics and the launcher read.

The log of a stall holds every Python thread's stack and, for this process and
its parent (tritonserver), where each thread waits in the kernel
(`kernel_waits`): a thread inside a call to the Triton process shows only that
call in Python, and the kernel's wait channels tell a full pipe from a lock.

The bound comes from the longest legitimate gap between two signs of progress:
one engine loop turn, which encodes up to `EngineOptions.max_admit` new windows
and takes one decoder step (`stall_bound_s`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0
LIBRARY = Path(__file__).resolve().parents[1].name  # python_backend_lib
# The default bounds (`stall_timeout_s` "auto"). On a GPU one loop turn takes
# milliseconds (large-v3 encodes 16 windows in well under a second), so a minute
# without progress is never legitimate. On a CPU a turn that encodes 16 windows at
# once takes seconds for tiny and base and minutes for the large checkpoints on a
# small host: ten minutes.
GPU_STALL_BOUND_S = 60.0
CPU_STALL_BOUND_S = 600.0


def stall_bound_s(on_gpu: bool, configured: float | None = None) -> float:
    """Seconds without progress that make a stall: `configured` (the model's
    `stall_timeout_s`), else the device's default."""
    if configured is not None:
        return configured
    return GPU_STALL_BOUND_S if on_gpu else CPU_STALL_BOUND_S


class EngineStalled(RuntimeError):
    """The whisper instance made no progress for its bound while holding requests: the
    server's fault (INTERNAL). The instance refuses new requests from then on."""


@dataclass(frozen=True)
class Beat:
    """progress: a count that grows with any work done (loop turns, answers sent).
    held: requests admitted and not answered, plus `execute` calls not returned."""

    progress: int
    held: int


class StallClock:
    """When progress last moved, and whether a held stretch outlasted the bound (pure: `now` is given)."""

    def __init__(self, bound_s: float, now: float) -> None:
        self.bound_s = bound_s
        self._progress: int | None = None
        self._since = now

    def stalled_for(self, beat: Beat, now: float) -> float | None:
        """Seconds without progress while work is held, once they reach the bound; else None."""
        if beat.progress != self._progress or beat.held == 0:
            self._progress, self._since = beat.progress, now
            return None
        waited = now - self._since
        return waited if waited >= self.bound_s else None


def thread_stacks() -> str:
    """Every Python thread's stack, for the log of a stall."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(parts)


def kernel_waits(pid: int, proc: Path = Path("/proc")) -> str:
    """Where the threads of process `pid` wait in the kernel, counted by thread name, state
    (R running, S sleeping, D uninterruptible) and wait channel, from `/proc/PID/task`:
    "12 x python_backend S futex_wait_queue, 2 x tritonserver S anon_pipe_write". '-' for a
    channel the kernel does not name; '' where `/proc` cannot be read."""
    counts: Counter[str] = Counter()
    for task in sorted((proc / str(pid) / "task").glob("*")):
        try:
            name = (task / "comm").read_text().strip()
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
            channel = (task / "wchan").read_text().strip()
        except (OSError, IndexError):  # the thread ended while read, or /proc hides it
            continue
        counts[f"{name} {state} {channel if channel not in ('', '0') else '-'}"] += 1
    return ", ".join(f"{n} x {key}" for key, n in counts.most_common())


def where(thread: threading.Thread | None) -> str:
    """Where `thread` stands: its innermost frame in this library, as file:line in
    function (the frames below it are Python's or a dependency's); '?' when not running."""
    frame = sys._current_frames().get(thread.ident) if thread is not None and thread.ident else None
    innermost = frame
    while frame is not None and LIBRARY not in Path(frame.f_code.co_filename).parts:
        frame = frame.f_back
    frame = frame or innermost
    if frame is None:
        return "?"
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} in {frame.f_code.co_name}"


class StallWatch:
    """Reads `read()` every `interval_s` on a thread of its own; calls `on_stall(seconds)`
    once when held work made no progress for `bound_s`, then stops."""

    def __init__(
        self,
        read: Callable[[], Beat],
        on_stall: Callable[[float], None],
        bound_s: float,
        interval_s: float = CHECK_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.read, self.on_stall, self.interval_s, self.clock = read, on_stall, interval_s, clock
        self.stall_clock = StallClock(bound_s, clock())
        self.fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="whisper-stall-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                seconds = self.stall_clock.stalled_for(self.read(), self.clock())
                if seconds is not None:
                    self.fired = True
                    self.on_stall(seconds)
                    return
            except Exception:  # the watch must never take the model down
                log.exception("the stall watch failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
