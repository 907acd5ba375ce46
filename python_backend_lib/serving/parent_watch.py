"""Ends a model's process once tritonserver is gone.

Triton runs each Python model in a stub process of its own, which is meant to
exit when it finds its parent dead. Triton 2.51's whisper stubs do not, once they
have served a request: killed with `kill -9`, or stopped by its exit timeout
before it unloaded the whisper model (clients holding connections open delay
that), tritonserver leaves the whisper stub running, with the weights, the KV
slots and on a GPU its memory, for good; a GPU instance of preprocessing would keep
its GPU memory too, and on a busy host the postprocessing stubs outlived it by seconds.

The watch cannot be a thread of the stub: a thread publishing a metric to the
dead tritonserver waits for its answer forever holding the interpreter lock,
and every other thread of the stub stops with it (seen in the whisper_stream
stub, py-spy: `WhisperMetrics.publish` in pthread_cond_wait, the watch thread
waiting for the lock). So each model starts a small shell process that asks
every `interval_s` whether the model's process still has the parent it had, and
once it has not, kills it: there is nobody left to answer. The watcher ends by
itself when the model's process does.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys

CHECK_INTERVAL_S = 1.0

# $1: the model's process, $2: its parent, $3: seconds between checks. Reads the parent from
# /proc (procps may be missing); ends quietly once the process has gone on its own. It says
# nothing: its output is the model's, a pipe to the dead tritonserver, and writing there
# would end it by SIGPIPE before the kill.
WATCHER_SCRIPT = """
parent_of() { sed -n 's/^PPid:[[:space:]]*//p' "/proc/$1/status" 2>/dev/null; }
while [ "$(parent_of "$1")" = "$2" ]; do sleep "$3"; done
if [ -e "/proc/$1" ]; then kill -KILL "$1"; fi
"""


class ParentWatch:
    """Kills this process (or `pid`) once its parent is no longer the one it had when the
    watch started. `close` ends the watch (call it from `finalize`)."""

    def __init__(self, interval_s: float = CHECK_INTERVAL_S, pid: int | None = None) -> None:
        self.pid = pid if pid is not None else os.getpid()
        self.parent = parent_of(self.pid)
        # A session of its own: a signal to the model's process group does not end the watch.
        self.watcher = subprocess.Popen(
            ["/bin/sh", "-c", WATCHER_SCRIPT, "parent-watch", str(self.pid), str(self.parent), f"{interval_s:g}"],
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip

    def close(self) -> None:
        """End the watch (the model was finalized), and the process at once when its
        interpreter exits (`exit_without_teardown`)."""
        atexit.register(exit_without_teardown)
        if self.watcher.poll() is None:
            # To its whole session: a shell defers a signal until its `sleep` ends, which
            # kept every model instance's unload waiting up to a check interval.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.watcher.pid, signal.SIGTERM)
            try:
                self.watcher.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.watcher.kill()
                self.watcher.wait()


def exit_without_teardown() -> None:
    """After `finalize` Triton waits for the model's process to exit, one instance after
    another; the interpreter's teardown (torch's modules, the heap) made that most of a
    second per instance. Nothing is left to clean up: Triton has its answer and owns
    the shared memory. Registered last, this runs before every other exit handler."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def parent_of(pid: int) -> int:
    """The parent process id of `pid` (from /proc; OSError when it is gone)."""
    if pid == os.getpid():
        return os.getppid()
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("PPid:"))
