"""What tritonserver says, read for the launcher: its log as it starts (noise and
causes), its metrics as it drains (`Activity`).

On a machine without a GPU, Triton 2.51 logs three CUDA and NVML failures on a
healthy start. Two have a documented switch, which the launcher sets when no
GPU is there (`NO_GPU_FLAGS`). Two more lines have none and are dropped from
the log the launcher passes on (`is_no_gpu_noise`), and only when there is no
GPU, where they can mean nothing else.

Asked for (`serve --trace-file`), Triton also writes its own timestamps of
traced requests to a file (`trace_flags`).

When a model fails to load, Triton logs the Python exception inside a long
quoted line with its traceback; `load_failure` takes out the one line that
says what went wrong, so the launcher can stop at once and show it.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# Without a GPU: Triton's pinned host memory pool needs the CUDA driver (it logs
# "Unable to allocate pinned system memory ... CUDA driver version is insufficient")
# and its GPU metrics need NVML ("Failed to initialize NVML", "DCGM unable to start").
NO_GPU_FLAGS = ("--pinned-memory-pool-byte-size=0", "--allow-gpu-metrics=false")

# Without a GPU, and with no switch to avoid them: the CUDA block manager's start
# (server.cc) and each ensemble's CUDA stream (ensemble_scheduler.cc). Both are
# logged as errors, yet Triton serves normally without them.
NO_GPU_NOISE = (
    '"CudaDriverHelper has not been initialized."',
    "unable to create stream for ",
)
# E1123 12:16:19.171312 20316 model_lifecycle.cc:642] "failed to load 'whisper' version 1: Internal: <message>
_LOAD_FAILURE = re.compile(r"failed to load '(?P<model>[^']+)' version \d+: (?:[A-Za-z ]+: )?(?P<reason>.*)")
# Triton writes the exception's traceback inside the same line, after "\n\nAt:" (escaped).
_TRACEBACK = re.compile(r"(\\n)+At:")


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
    unhealthy_engines: whisper engines (one per GPU) that gave up after failing repeatedly.
    """

    busy: float
    answered: float
    unhealthy_engines: int = 0

    @classmethod
    def from_metrics(cls, text: str) -> Activity:
        busy = answered = 0.0
        unhealthy = 0
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            metric = name.split("{", 1)[0]
            if metric in ("whisper_requests_in_flight", "nv_inference_pending_request_count"):
                busy += float(value)
            elif metric in ("nv_inference_request_success", "nv_inference_request_failure"):
                answered += float(value)
            elif metric == "whisper_engine_healthy" and float(value) == 0:
                unhealthy += 1
        return cls(busy=busy, answered=answered, unhealthy_engines=unhealthy)


def trace_flags(path: Path, rate: int) -> tuple[str, ...]:
    """Triton's "triton" trace mode, timestamps only, one request in `rate`; the file is written when it stops."""
    return (f"--trace-config=triton,file={path}", "--trace-config=level=TIMESTAMPS", f"--trace-config=rate={rate}")
