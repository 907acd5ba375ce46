"""What the host does during a load point: CPU cores busy (all processes), GPU memory and utilisation.

The GPU figures come from `nvidia-smi`, so they cover every process on the
GPU (the server's stubs included); on a machine without it they are None.
"""

from __future__ import annotations

import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
GPU_SAMPLE_S = 0.5
MIB_PER_GIB = 1024


@dataclass(frozen=True)
class CpuTimes:
    busy: int  # jiffies spent on anything but idle and iowait, all cores
    total: int


def parse_proc_stat(text: str) -> CpuTimes:
    """The aggregate `cpu` line of /proc/stat: user nice system idle iowait irq softirq steal ..."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            values = [int(v) for v in line.split()[1:9]]
            idle = values[3] + values[4]
            return CpuTimes(busy=sum(values) - idle, total=sum(values))
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def cpu_times() -> CpuTimes | None:
    try:
        return parse_proc_stat(PROC_STAT.read_text())
    except (OSError, ValueError):
        return None


def busy_cores(before: CpuTimes | None, after: CpuTimes | None, cores: int) -> float | None:
    """Cores busy on average between two readings (0 to `cores`)."""
    if before is None or after is None or after.total <= before.total:
        return None
    return round(cores * (after.busy - before.busy) / (after.total - before.total), 2)


def query_gpu() -> tuple[float, float] | None:
    """(utilisation %, memory used GiB) of GPU 0, or None without nvidia-smi."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
        utilisation, memory_mib = (float(v) for v in out.split(","))
        return utilisation, memory_mib / MIB_PER_GIB
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


class GpuSampler:
    """Samples GPU 0 every GPU_SAMPLE_S while in its `with` block."""

    def __init__(self) -> None:
        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            sample = query_gpu()
            if sample is None:
                return
            self._samples.append(sample)
            self._stop.wait(GPU_SAMPLE_S)

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def summary(self) -> dict[str, float | None]:
        if not self._samples:
            return {"gpu_utilisation_pct": None, "gpu_memory_used_gib": None}
        return {
            "gpu_utilisation_pct": round(sum(u for u, _ in self._samples) / len(self._samples), 1),
            "gpu_memory_used_gib": round(max(m for _, m in self._samples), 2),
        }
