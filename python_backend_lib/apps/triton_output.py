"""What tritonserver says, read for the launcher: its log (noise, routine and
causes), its metrics as it drains (`Activity`, `QuietWatch`).

On a machine without a GPU, Triton 2.51 logs three CUDA and NVML failures on a
healthy start. Two have a documented switch, which the launcher sets when no
GPU is there (`NO_GPU_FLAGS`). Three more lines have none and are dropped from
the log the launcher passes on (`is_no_gpu_noise`), and only when there is no
GPU, where they can mean nothing else.

Most of the rest is routine (`is_routine`): Triton's tables of backends, models
and options, each model's loading and unloading, its countdown while it stops.
The launcher passes on only the rest unless asked for everything: warnings,
errors, what our models log (each engine's start, with its attention backend)
and what their processes print.

Asked for (`serve --trace-file`), Triton also writes its own timestamps of
traced requests to a file (`trace_flags`).

When a model fails to load, Triton logs the Python exception inside a long
quoted line with its traceback; `load_failure` takes out the one line that
says what went wrong, so the launcher can stop at once and show it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

# Without a GPU: Triton's pinned host memory pool needs the CUDA driver (it logs
# "Unable to allocate pinned system memory ... CUDA driver version is insufficient")
# and its GPU metrics need NVML ("Failed to initialize NVML", "DCGM unable to start").
NO_GPU_FLAGS = ("--pinned-memory-pool-byte-size=0", "--allow-gpu-metrics=false")

# Without a GPU, and with no switch to avoid them: the CUDA block manager's start
# (server.cc) and each ensemble's CUDA stream (ensemble_scheduler.cc), both logged
# as errors, yet Triton serves normally without them; and the first request's
# warning that the pinned memory pool, which NO_GPU_FLAGS turned off, has no room.
NO_GPU_NOISE = (
    '"CudaDriverHelper has not been initialized."',
    "unable to create stream for ",
    "failed to allocate pinned system memory: no pinned memory pool",
)
# E1123 12:16:19.171312 20316 model_lifecycle.cc:642] "failed to load 'whisper' version 1: Internal: <message>
_LOAD_FAILURE = re.compile(r"failed to load '(?P<model>[^']+)' version \d+: (?:[A-Za-z ]+: )?(?P<reason>.*)")
# Triton writes the exception's traceback inside the same line, after "\n\nAt:" (escaped).
_TRACEBACK = re.compile(r"(\\n)+At:")
# I1126 01:18:03.074265 29806 model.py:51] "<message>": level, date, time, thread, source file and line.
_TRITON_LINE = re.compile(r"(?P<level>[IWEF])\d{4} [\d:.]+ +\d+ (?P<source>[^\s:]+):\d+\]")
# Informational lines from these sources are our models' own (pb_utils.Logger).
OUR_SOURCES = ("model.py",)
# tritonserver's line, without a prefix, when it is asked to stop.
_SIGNAL_RECEIVED = re.compile(r"Signal \(\d+\) received\.$")


@lru_cache(maxsize=1)
def visible_gpus(gpus: str | None) -> int:
    """GPUs tritonserver will see under `serve --gpus` (None: every one the driver sees; "": none)."""
    if gpus is None:
        return cuda_device_count()
    return len(gpus.split(",")) if gpus else 0


def cuda_device_count() -> int:
    """CUDA devices the driver sees; 0 without a driver (libcuda) or without a device.
    Asked of the driver directly, so the launcher needs no torch."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def is_no_gpu_noise(line: str) -> bool:
    """Whether `line` is one of Triton's harmless CUDA errors of a start without a GPU."""
    return any(marker in line for marker in NO_GPU_NOISE)


# At each Python model's exit the `triton` compiler package that torch imports (its
# dynamo layer does, on any device) reports nanobind's leak check: some 60 lines per
# process, about objects the interpreter's teardown frees anyway. Its last line ends
# without a newline, so the next line of Triton's log is glued to it.
_LEAK_REPORT = re.compile(r"nanobind: |\s+- leaked |\s+- \.\.\. skipped remainder|See https://nanobind\.\S+?\.html")
_LEAK_REPORT_END = "See https://nanobind.readthedocs.io/en/latest/refleaks.html"


def without_leak_report(line: str) -> str | None:
    """`line` without nanobind's leak report: None when it is a line of the report, the
    rest of it when the report's last line has the next line glued on."""
    while _LEAK_REPORT.match(line):  # another process's report may be glued on too
        _, end, line = line.partition(_LEAK_REPORT_END)
        if not end or not line.strip():
            return None
    return line


# Triton's last line when its exit timeout runs out: an error line that reads like a crash,
# though the stop went as designed. Before it, Triton counts down what it waits for: HTTP
# connections still open (a client's idle keep-alive connection counts), then requests in
# its models.
_EXIT_TIMEOUT = "failed to stop server: Internal - Exit timeout expired"
_OPEN_CONNECTIONS = re.compile(r"Timeout \d+: Found (\d+) HTTP service connections")
_REQUESTS_IN_MODELS = re.compile(r"Timeout \d+: Found (\d+) model versions that have in-flight inferences")
EXIT_TIMEOUT_SAID = (
    "whisper-triton: tritonserver stopped at its exit timeout with requests still in its models; "
    "they got no answer (a stop waits for requests in flight that long)\n"
)
OPEN_CONNECTIONS_SAID = (
    "whisper-triton: tritonserver stopped at its exit timeout with {n} HTTP connection(s) still open: "
    "clients keep idle connections for their next request; no request was in flight\n"
)


@dataclass
class ExitWatch:
    """What Triton's stop waited for, from its countdown lines, to say plainly why its exit
    timeout ran out."""

    open_connections: int = 0  # HTTP connections at the last countdown that counted them
    requests_in_models: int = 0  # model versions with requests in flight, likewise

    def plain(self, line: str) -> str:
        """`line`, or for Triton's exit-timeout error the launcher's plain account of it."""
        if (found := _OPEN_CONNECTIONS.search(line)) is not None:
            self.open_connections = int(found.group(1))
        elif (found := _REQUESTS_IN_MODELS.search(line)) is not None:
            self.requests_in_models = int(found.group(1))
        elif _EXIT_TIMEOUT in line:
            if self.open_connections and not self.requests_in_models:
                return OPEN_CONNECTIONS_SAID.format(n=self.open_connections)
            return EXIT_TIMEOUT_SAID
        return line


def is_routine(line: str, after_routine: bool = False) -> bool:
    """Whether `line` is one of Triton's own informational lines, or a line of a
    table (or the blank line after it) that goes on from one (`after_routine`)."""
    found = _TRITON_LINE.match(line)
    if found is not None:
        return found.group("level") == "I" and found.group("source") not in OUR_SOURCES
    if _SIGNAL_RECEIVED.match(line.strip()):
        return True
    return after_routine and (not line.strip() or line.startswith(("+", "|")))


_LOADING = re.compile(r'"loading: (?P<model>[\w.-]+):\d+"')
_LOADED = re.compile(r"\"successfully loaded '(?P<model>[\w.-]+)'\"")


@dataclass
class LoadProgress:
    """The models tritonserver has begun loading, and those it has loaded, from its log:
    what a long start says while it waits (a model loads its checkpoint and warms its
    engine in `initialize`, which can take tens of seconds on a busy CPU)."""

    loading: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)

    def see(self, line: str) -> None:
        for pattern, names in ((_LOADING, self.loading), (_LOADED, self.loaded)):
            found = pattern.search(line)
            if found is not None and found["model"] not in names:
                names.append(found["model"])

    def describe(self, elapsed_s: float) -> str:
        head = f"still starting after {elapsed_s:.0f} s: "
        if not self.loading:
            return head + "tritonserver has not begun loading the models"
        waiting = [name for name in self.loading if name not in self.loaded]
        if not waiting:
            return head + "every model is loaded; waiting for tritonserver to be ready"
        return head + f"loaded {', '.join(self.loaded) or 'none yet'}; loading {', '.join(waiting)}"


def load_failure(line: str) -> str | None:
    """"model 'whisper': <the exception's message>" when `line` reports a model
    that failed to load; None for any other line."""
    found = _LOAD_FAILURE.search(line)
    if found is None:
        return None
    reason = _TRACEBACK.split(found.group("reason"), maxsplit=1)[0].strip().rstrip('"')
    return f"model {found.group('model')!r}: {reason.replace(chr(92) + 'n', ' ')}"


@dataclass(frozen=True)
class Activity:
    """What Triton's /metrics says about work in the server.

    busy: requests held by the whisper model plus requests queued in any model.
    answered: requests answered so far (successes and failures, all models).
    unhealthy_engines: whisper engines that gave up after failing repeatedly, or stalled.
    heartbeats: each whisper instance's last metrics publish (Unix time), by its labels.
    held: the requests each whisper instance holds, by its labels (part of `busy`).
    pids: each whisper instance's process id, by its labels.
    """

    busy: float
    answered: float
    unhealthy_engines: int = 0
    heartbeats: tuple[tuple[str, float], ...] = ()
    held: tuple[tuple[str, float], ...] = ()
    pids: tuple[tuple[str, int], ...] = ()

    def frozen(self, now: float, after_s: float) -> list[str]:
        """The instances (their labels) whose last publish is more than `after_s` before `now`."""
        return [labels for labels, at in self.heartbeats if now - at > after_s]

    def without(self, instances: Collection[str]) -> Activity:
        """This reading with `instances` left out: a killed frozen process's last publish
        still shows the requests it held, which Triton has failed since."""
        if not instances:
            return self
        return dataclasses.replace(
            self,
            busy=self.busy - sum(n for labels, n in self.held if labels in instances),
            heartbeats=tuple(h for h in self.heartbeats if h[0] not in instances),
            held=tuple(h for h in self.held if h[0] not in instances),
        )

    @classmethod
    def from_metrics(cls, text: str) -> Activity:
        busy = answered = 0.0
        unhealthy = 0
        heartbeats, held, pids = [], [], []
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            metric = name.split("{", 1)[0]
            labels = name[len(metric) :]
            if metric == "whisper_heartbeat_timestamp_seconds":
                heartbeats.append((labels, float(value)))
            elif metric == "whisper_process_id":
                pids.append((labels, int(float(value))))
            if metric == "whisper_requests_in_flight":
                held.append((labels, float(value)))
            if metric in ("whisper_requests_in_flight", "nv_inference_pending_request_count"):
                busy += float(value)
            elif metric in ("nv_inference_request_success", "nv_inference_request_failure"):
                answered += float(value)
            elif metric == "whisper_engine_healthy" and float(value) == 0:
                unhealthy += 1
        return cls(busy=busy, answered=answered, unhealthy_engines=unhealthy, heartbeats=tuple(heartbeats),
                   held=tuple(held), pids=tuple(pids))


@dataclass
class QuietWatch:
    """Since when the `Activity` read from the metrics has shown no work: nothing
    in flight or queued in any read, and the same count of answered requests."""

    last: Activity | None = None
    since: float = 0.0  # time.monotonic() of the first read of the current quiet
    seen: float = 0.0  # ... and of the last read

    def see(self, activity: Activity, now: float) -> None:
        last = self.last
        if activity.busy > 0 or last is None or last.busy > 0 or activity.answered != last.answered:
            self.since = now  # the work ended after the last read, not before it
        self.last, self.seen = activity, now

    @property
    def quiet_s(self) -> float:
        """Seconds from the first read of the quiet to the last (0 while busy)."""
        return 0.0 if self.last is None or self.last.busy > 0 else self.seen - self.since


# Traces Triton holds before it writes them out. With 0 it writes them only when it stops,
# and a server stopped past its exit timeout (a GPU server often is) writes none.
TRACE_LOG_FREQUENCY = 50


def trace_flags(path: Path, rate: int) -> tuple[str, ...]:
    """Triton's "triton" trace mode, timestamps only, one request in `rate`.

    Triton writes each TRACE_LOG_FREQUENCY traces to a file of their own, `path`.0, `path`.1
    and so on, and what is left when it stops to the next (`bench.triton_trace` reads them all)."""
    return (f"--trace-config=triton,file={path}", "--trace-config=level=TIMESTAMPS", f"--trace-config=rate={rate}",
            f"--trace-config=triton,log-frequency={TRACE_LOG_FREQUENCY}")
