"""Small host arrays to the device without waiting for it.

A copy from pageable host memory waits for everything queued on the stream;
while a decoder step runs, that would stall the host until it ends. From pinned
memory the copy is queued like a kernel, and PyTorch keeps the pinned block
until the copy has run, so a fresh one per copy is never rewritten under it.
"""

from __future__ import annotations

import numpy as np
import torch


def pinned(array: np.ndarray) -> torch.Tensor:
    """A pinned copy of `array`."""
    return torch.from_numpy(np.ascontiguousarray(array)).pin_memory()


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` on `device`: through pinned memory, asynchronously, on a GPU."""
    if device.type == "cuda":
        return pinned(array).to(device, non_blocking=True)
    return torch.from_numpy(np.ascontiguousarray(array))
