"""What a running tritonserver's metrics say, and what the launcher does about it: whether
every whisper engine still serves, whether one's process froze (it is then killed), and
when the requests in flight are answered before a stop (the drain)."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from typing import Callable

from python_backend_lib.apps import process_group
from python_backend_lib.apps.triton_output import Activity, QuietWatch

# Before stopping, wait this long at most for the requests in flight to be answered:
# once stopping, Triton refuses an ensemble's next step, so it would fail them. What
# is still in flight then is answered UNAVAILABLE (`cancellation.STOPPING`).
DRAIN_TIMEOUT_S = 30.0
# Idle means: nothing in flight or queued, and no request answered, for this long
# (two publications of the whisper_* metrics, which are published every second).
# The launcher reads the metrics while it serves, so a server idle for that long
# before it is asked to stop has nothing to wait for.
DRAIN_QUIET_S = 2.0
DRAIN_POLL_S = 0.2
DRAIN_REPORT_S = 5.0  # a changing count of requests in flight is told at most this often
# How often a serving launcher reads whether every whisper engine is still healthy.
HEALTH_POLL_S = 2.0
READ_TIMEOUT_S = 2.0  # one read of the metrics


class ServerWatch:
    """Reads of one tritonserver's metrics port while it runs. `report` hears what was
    found and what a drain waits for. Frozen instances, once killed, are left out of every
    later reading: their last publish still counts requests Triton has failed since."""

    def __init__(self, metrics_url: str, process: subprocess.Popen, report: Callable[[str], None] | None = None):
        self.metrics_url = metrics_url
        self.process = process
        self.report = report
        self.aborted = False  # the launcher's abort: a drain waits for nothing more
        self._quiet = QuietWatch()  # since when the metrics read show no work
        self._killed: set[str] = set()  # frozen whisper instances killed (their labels)

    def activity(self) -> Activity | None:
        """The server's current `Activity`; None when its metrics cannot be read.
        Every read also tells `drain` how long the server has been idle."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=READ_TIMEOUT_S) as response:
                activity = Activity.from_metrics(response.read().decode("utf-8", "replace")).without(self._killed)
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            return None
        self._quiet.see(activity, time.monotonic())
        return activity

    def wait_while_healthy(self, frozen_after_s: float, poll_s: float = HEALTH_POLL_S) -> int | None:
        """Block until tritonserver exits (its exit status) or a whisper engine gives up, stalls
        or freezes (None). Frozen: its process published no metrics for over `frozen_after_s`,
        as a process stopped or holding its interpreter lock would: its own stall watch could
        not run. A frozen process is killed."""
        while True:
            try:
                return self.process.wait(timeout=poll_s)
            except subprocess.TimeoutExpired:
                activity = self.activity()
                if activity is None:
                    continue
                if activity.unhealthy_engines:
                    return None
                frozen = activity.frozen(time.time(), frozen_after_s)
                if frozen:
                    killed = self._kill_frozen(activity, frozen)
                    if self.report is not None:
                        self.report(f"whisper instance {', '.join(frozen)} published no metrics for over "
                                    f"{frozen_after_s:.0f} s: its process is frozen; {killed}")
                    return None

    def _kill_frozen(self, activity: Activity, frozen: list[str]) -> str:
        """Kill the frozen instances' processes: Triton then fails the requests they held at
        once, and the drain and stop that follow need not wait for them; what was done."""
        pids = dict(activity.pids)
        killed = [pids[labels] for labels in frozen
                  if labels in pids and process_group.kill_child(pids[labels], self.process.pid)]
        self._killed.update(frozen)
        if not killed:
            return "its process id is unknown, so the requests it holds wait for the stop"
        return f"killed process {', '.join(map(str, killed))}, so that the requests it held fail now"

    def drain(self, timeout: float = DRAIN_TIMEOUT_S) -> bool:
        """Wait until no request has been in flight or answered for DRAIN_QUIET_S
        (at once when the reads of the metrics while serving saw it idle that long);
        False after `timeout` (or when the metrics cannot be read, or after an abort).
        `report` hears how many requests it waits for when that changes, at most every
        DRAIN_REPORT_S (the count read from the metrics can flicker between publications).
        Triton keeps accepting requests meanwhile: take the server out of rotation first."""
        deadline = time.monotonic() + timeout
        reported, reported_at = None, -DRAIN_REPORT_S
        while time.monotonic() < deadline:
            if self.aborted or self.process.poll() is not None:
                return False
            now = self.activity()
            if now is None:
                return False
            if self._quiet.quiet_s >= DRAIN_QUIET_S:
                return True
            count, due = round(now.busy), time.monotonic() - reported_at >= DRAIN_REPORT_S
            if self.report is not None and count > 0 and count != reported and due:
                self.report(f"waiting for {count} request{'s' if count != 1 else ''} in flight")
                reported, reported_at = count, time.monotonic()
            time.sleep(DRAIN_POLL_S)
        return False
