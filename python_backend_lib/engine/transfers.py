"""Small tensors between the host and the device without waiting for the device.

A copy from pageable host memory waits for everything queued on the stream;
while a decoder step runs, that would stall the host until it ends. From pinned
memory the copy is queued like a kernel, and PyTorch keeps the pinned block
until the copy has run, so a fresh one per copy is never rewritten under it.
Back to the host, a copy into pinned memory is queued the same way, and an event
says when it has arrived (`ToHost`).
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


class ToHost:
    """A device tensor copied to the host as the stream gets to it; on the CPU, the tensor itself."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event = None
        if tensor.device.type == "cuda":
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = tensor

    def ready(self) -> bool:
        """Whether the copy has arrived (reading it would not wait)."""
        return self._event is None or self._event.query()

    def get(self) -> torch.Tensor:
        """The copy, once it has arrived."""
        if self._event is not None:
            self._event.synchronize()
        return self._host
