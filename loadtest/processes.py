"""The processes of a whisper-triton server on this machine, found from its gRPC
port, and their memory: for the soak test's check that memory comes back.

tritonserver runs each model in a Python-backend stub process of its own
(`triton_python_backend_stub <model folder>/1/model.py ...`); the whisper
model's stub holds the engine, the weights and the KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
STUB_NAME = "triton_python_backend_stub"


@dataclass(frozen=True)
class StubProcess:
    model: str  # the model's folder name in the repository
    pid: int


def cmdline(pid: int) -> list[str]:
    """A process's arguments, [] once it is gone."""
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:  # gone meanwhile
        return []


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after "pid (comm)": the state letter first, then the
    parent's pid ...; None once the process is gone."""
    try:
        return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _parent(pid: int) -> int | None:
    fields = stat_fields(pid)
    return None if fields is None else int(fields[1])


def state(pid: int) -> str:
    """A process's state letter (Z: ended, not yet reaped by its parent), "" once it is gone."""
    fields = stat_fields(pid)
    return "" if fields is None else fields[0]


def child_pids(pid: int) -> tuple[int, ...]:
    """The processes whose parent is `pid` now."""
    return tuple(sorted(child for child in _pids() if _parent(child) == pid))


def _pids() -> list[int]:
    return [int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit()]


def tritonserver_pid(grpc_port: int) -> int:
    """The tritonserver process listening on `grpc_port`; LookupError if none here."""
    flag = f"--grpc-port={grpc_port}"
    for pid in _pids():
        arguments = cmdline(pid)
        if arguments and Path(arguments[0]).name == "tritonserver" and flag in arguments:
            return pid
    raise LookupError(f"no tritonserver with {flag} on this machine")


def stub_processes(grpc_port: int) -> list[StubProcess]:
    """The model stubs of the tritonserver listening on `grpc_port`."""
    server = tritonserver_pid(grpc_port)
    stubs = []
    for pid in _pids():
        arguments = cmdline(pid)
        if len(arguments) > 1 and Path(arguments[0]).name == STUB_NAME and _parent(pid) == server:
            stubs.append(StubProcess(model=Path(arguments[1]).parent.parent.name, pid=pid))
    return sorted(stubs, key=lambda stub: stub.model)


def rss_mib(pid: int) -> float:
    """Resident memory (VmRSS in /proc/<pid>/status), in MiB."""
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024  # kB
    raise LookupError(f"process {pid} reports no VmRSS")
