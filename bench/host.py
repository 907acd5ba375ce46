"""What the host does during a load point: CPU cores busy (all processes, and the
server's own by role), GPU memory and utilisation.

The GPU figures come from `nvidia-smi`, so they cover every process on the
GPU (the server's stubs included); on a machine without it they are None.
The server's processes are tritonserver and one Python-backend stub per model
instance (`loadtest.processes`): a stub near one core is bound by its own
interpreter lock, however many cores the host has left.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from loadtest.metrics import per_instance
from loadtest.processes import stat_fields, stub_processes, tritonserver_pid
from python_backend_lib.serving.metrics import GPU_MEMORY_POOLS

PROC = Path("/proc")
PROC_STAT = PROC / "stat"
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


def process_cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of one process so far (/proc/<pid>/stat), None once it is gone."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: fields 14 and 15


def process_memory_gib(pid: int) -> float | None:
    """A process's proportional set size (its private pages, and its share of the pages it
    shares, such as torch's libraries mapped by every stub), None once it is gone."""
    try:
        for line in (PROC / str(pid) / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class ServerProcesses:
    """A whisper-triton server's processes by role: "tritonserver", and each model's stubs by its name."""

    roles: dict[str, tuple[int, ...]]

    @classmethod
    def find(cls, grpc_port: int) -> ServerProcesses:
        roles: dict[str, tuple[int, ...]] = {"tritonserver": (tritonserver_pid(grpc_port),)}
        for stub in stub_processes(grpc_port):
            roles[stub.model] = (*roles.get(stub.model, ()), stub.pid)
        return cls(roles)

    def cpu_seconds(self) -> dict[int, float | None]:
        return {pid: process_cpu_seconds(pid) for pids in self.roles.values() for pid in pids}

    def memory_gib(self) -> dict[str, float]:
        """Per role, the host memory its processes hold now (proportional set sizes, summed)."""
        record = {}
        for role, pids in self.roles.items():
            sizes = [m for m in map(process_memory_gib, pids) if m is not None]
            if sizes:
                record[role] = round(sum(sizes), 2)
        return record

    def gpu_memory(self) -> dict:
        """The GPU memory (GiB) its processes hold now, by role, as nvidia-smi lists its compute
        processes; the processes it lists that are none of the server's (CUDA MPS's server, or PIDs
        of another namespace: in a container nvidia-smi may list host PIDs); every GPU's memory in use."""
        by_pid = gpu_memory_by_pid()
        ours = {pid for pids in self.roles.values() for pid in pids}
        return {
            "by_role_gib": {role: round(sum(by_pid.get(pid, 0.0) for pid in pids), 3)
                            for role, pids in self.roles.items() if any(pid in by_pid for pid in pids)},
            "other_processes_gib": {pid: round(gib, 3) for pid, gib in by_pid.items() if pid not in ours},
            "gpus_used_gib": [round(g.memory_used_gib, 3) for g in query_gpus() or []],
        }  # fmt: skip

    def busy(self, before: dict[int, float | None], after: dict[int, float | None], seconds: float) -> dict:
        """Per role, between two `cpu_seconds` readings `seconds` apart: the cores its processes
        kept busy in all, and the busiest one's (1.0: a stub bound by its interpreter lock)."""
        record = {}
        for role, pids in self.roles.items():
            cores = [(after[p] - before[p]) / seconds for p in pids if before.get(p) is not None and after.get(p) is not None]
            if cores:
                record[role] = {"processes": len(pids), "cores": round(sum(cores), 2), "busiest": round(max(cores), 2)}
        return record



@dataclass(frozen=True)
class GpuReading:
    utilisation_pct: float
    memory_used_gib: float


def query_gpus() -> list[GpuReading] | None:
    """Every GPU's utilisation and memory in use, in nvidia-smi's order; None without nvidia-smi."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
        readings = []
        for line in out.strip().splitlines():
            utilisation, memory_mib = (float(v) for v in line.split(","))
            readings.append(GpuReading(utilisation, memory_mib / MIB_PER_GIB))
        return readings or None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def gpu_memory_by_pid() -> dict[int, float]:
    """GiB of GPU memory per process, as nvidia-smi lists its compute processes; empty without it."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    memory: dict[int, float] = {}
    for line in out.strip().splitlines():
        pid, used = (field.strip() for field in line.split(","))
        if pid.isdigit() and used.replace(".", "", 1).isdigit():
            memory[int(pid)] = memory.get(int(pid), 0.0) + float(used) / MIB_PER_GIB
    return memory


class GpuSampler:
    """Samples every GPU every GPU_SAMPLE_S while in its `with` block."""

    def __init__(self) -> None:
        self._samples: list[list[GpuReading]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            sample = query_gpus()
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

    def summary(self) -> dict[str, object]:
        """GPU 0's mean utilisation and peak memory (as before several GPUs were sampled),
        and each GPU's mean utilisation."""
        if not self._samples:
            return {"gpu_utilisation_pct": None, "gpu_memory_used_gib": None, "gpus_utilisation_pct": None}
        gpus = range(min(len(sample) for sample in self._samples))
        each = [round(sum(s[g].utilisation_pct for s in self._samples) / len(self._samples), 1) for g in gpus]
        return {
            "gpu_utilisation_pct": each[0],
            "gpu_memory_used_gib": round(max(s[0].memory_used_gib for s in self._samples), 2),
            "gpus_utilisation_pct": each,
        }


class MemoryWatch:
    """Reads the server's memory every `every_s` while in its `with` block: each role's host
    memory (`ServerProcesses.memory_gib`), each GPU's memory in use, and what each whisper
    instance publishes of its GPU's memory held by PyTorch (`whisper_gpu_memory_bytes`:
    allocated to tensors, or reserved by its allocator), so that a long load shows whether
    any of them keeps rising (`later_growth`)."""

    def __init__(self, grpc_port: int, metrics_url: str, every_s: float) -> None:
        self.grpc_port, self.metrics_url, self.every_s = grpc_port, metrics_url, every_s
        # {"s": seconds since the start, "host_gib": {role: GiB}, "gpus_gib": [GiB],
        #  "instances_gib": {pool: {"gpu<n>/<instance>": GiB}}}
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-watch", daemon=True)

    def _run(self) -> None:
        started = time.monotonic()
        processes = ServerProcesses.find(self.grpc_port)
        while not self._stop.wait(self.every_s):
            gpus = query_gpus() or []
            instances = {pool: {instance: round(value / 2**30, 3) for instance, value in
                                per_instance(self.metrics_url, "whisper_gpu_memory_bytes", pool=pool).items()}
                         for pool in GPU_MEMORY_POOLS}  # fmt: skip
            self.samples.append({"s": round(time.monotonic() - started, 1), "host_gib": processes.memory_gib(),
                                 "gpus_gib": [round(g.memory_used_gib, 3) for g in gpus],
                                 "instances_gib": instances})  # fmt: skip

    def __enter__(self) -> MemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def later_growth(samples: list[dict]) -> dict[str, float]:
    """How much each role's host memory ("host <role>"), each GPU's ("gpu <n>") and each
    whisper instance's PyTorch pools ("<pool> gpu<n>/<instance>") grew over the second half
    of `samples` (MemoryWatch's): from the first sample at or past half the last one's time
    to the last. What rises with the first minutes of a load and then holds is not in it; a
    steady leak is. Empty with fewer than two samples."""
    if len(samples) < 2:
        return {}
    middle = next(sample for sample in samples if sample["s"] >= samples[-1]["s"] / 2)
    last = samples[-1]
    growth = {f"host {role}": round(gib - middle["host_gib"][role], 3)
              for role, gib in last["host_gib"].items() if role in middle["host_gib"]}  # fmt: skip
    for index, (then, now) in enumerate(zip(middle["gpus_gib"], last["gpus_gib"])):
        growth[f"gpu {index}"] = round(now - then, 3)
    for pool, by_instance in last.get("instances_gib", {}).items():
        before = middle.get("instances_gib", {}).get(pool, {})
        growth |= {f"{pool} {instance}": round(gib - before[instance], 3)
                   for instance, gib in by_instance.items() if instance in before}  # fmt: skip
    return growth
