"""What a model process holds: its resident host memory, and what PyTorch holds on
its GPU (the tensors it allocated, and the memory its caching allocator keeps from
the driver, those tensors included).

The whisper model publishes them per instance (`serving.metrics`): memory that
keeps rising under a steady load shows there instance by instance, where the
machine's totals mix every process, and the two GPU figures tell tensors that are
kept apart from blocks the allocator merely holds for reuse.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

STATM = Path("/proc/self/statm")


@dataclass(frozen=True)
class MemoryUse:
    host_resident_bytes: int | None  # None where there is no /proc
    gpu_allocated_bytes: int | None  # None for a process on the CPU
    gpu_reserved_bytes: int | None


def host_resident_bytes() -> int | None:
    """This process's resident set size (the second field of /proc/self/statm, in pages)."""
    try:
        pages = int(STATM.read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def memory_use(device: torch.device) -> MemoryUse:
    """Read without waiting for the device: the allocator's own counts, not the driver's."""
    host = host_resident_bytes()
    if device.type != "cuda":
        return MemoryUse(host, None, None)
    # Imported here, not above: the launcher and the client commands import
    # serving.metrics for its constants, and must not load torch for them.
    import torch

    return MemoryUse(host, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))
