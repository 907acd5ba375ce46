"""The Python backend's shared-memory regions in /dev/shm, named per server.

Each model process has regions there. Triton removes them when it stops
normally, but not when it exits because a model failed to load, nor when it is
killed. So each server names its regions with a prefix of its own (Triton's
`shm-region-prefix-name` backend setting, which `prefix` makes from the
launcher's process id and the server's serial) and the launcher removes what is
left under that prefix once the server's processes are gone.
"""

from __future__ import annotations

from pathlib import Path

DIRECTORY = Path("/dev/shm")
# The Python backend's own default prefix, then ours: tools that look for the
# backend's regions still find them.
PREFIX = "triton_python_backend_shm_region_whisper-triton-"


def prefix(launcher_pid: int, serial: int | str) -> str:
    """The names of the regions of the `serial`-th server started by process
    `launcher_pid` begin with this ("*" for `serial`: a glob of them all)."""
    return f"{PREFIX}{launcher_pid}-{serial}-"


def regions(name_prefix: str) -> list[Path]:
    return sorted(DIRECTORY.glob(name_prefix + "*"))


def remove(name_prefix: str) -> None:
    """Remove the regions whose names begin with `name_prefix`: only once nothing maps them."""
    for region in regions(name_prefix):
        region.unlink(missing_ok=True)
