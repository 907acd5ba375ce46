"""Small tensors between the host and the device without waiting for the device.

A copy from pageable host memory waits for everything queued on the stream;
while a decoder step runs, that would stall the host until it ends. From pinned
memory the copy is queued like a kernel, and PyTorch keeps the pinned block
until the copy has run, so a fresh one per copy is never rewritten under it.
Back to the host, a copy into pinned memory is queued the same way, and an event
says when it has arrived (`ToHost`).

A graph step of a few rows spends more of its host time allocating pinned memory
(PyTorch's caching host allocator records and queries an event per block) than
running: steps take their staging and their picks' landing place from a
`PinnedRing` of buffers allocated once instead.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch


def pinned(array: np.ndarray) -> torch.Tensor:
    """A pinned copy of `array`."""
    return torch.from_numpy(np.ascontiguousarray(array)).pin_memory()


def through_pinned(shape, fill: Callable[[np.ndarray], object], device: torch.device) -> torch.Tensor:
    """A float32 tensor on `device` (a GPU) whose content `fill` writes into pinned host
    memory, with numpy's copy (torch's own would wake a thread per core).

    A copy from pageable memory waits for everything queued on the stream (the
    engine's decoder steps: milliseconds per call); from pinned memory it is
    queued like a kernel, and the caller goes on at once.
    """
    pinned = torch.empty(shape, dtype=torch.float32, pin_memory=True)
    fill(pinned.numpy())
    return pinned.to(device, non_blocking=True)


def wait_idle(device: torch.device) -> None:
    """Wait for the work queued so far on `device`'s current stream, asleep.

    A plain synchronize (and a blocking copy to the host) spins a core until the
    GPU is done. A process that mostly waits for its GPU, such as preprocessing
    beside the engines, would keep a core busy per waiting thread; a blocking
    event lets the thread sleep until the driver wakes it.
    """
    done = torch.cuda.Event(blocking=True)
    done.record(torch.cuda.current_stream(device))
    done.synchronize()


def to_host_asleep(tensor: torch.Tensor) -> np.ndarray:
    """A GPU tensor's values on the host, waited for asleep (`wait_idle`)."""
    landing = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    landing.copy_(tensor, non_blocking=True)
    wait_idle(tensor.device)
    return landing.numpy()  # the array keeps the pinned block alive


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` on `device`: through pinned memory, asynchronously, on a GPU."""
    if device.type == "cuda":
        return pinned(array).to(device, non_blocking=True)
    return torch.from_numpy(np.ascontiguousarray(array))


class PinnedRing:
    """`depth` pinned host buffers of one shape and dtype, handed out in turn.

    A buffer comes back round after `depth` others were taken. Each buffer has one
    event, recorded after the last copy queued from it or into it (`queued`), so
    that a step makes no new event. Host-to-device staging: `take` waits, if it
    must, for the copy that last read the buffer. Device-to-host landing: the
    reader must have read a buffer before it comes round again; `ToHost` checks
    that it has not (`Lease.current`).
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, depth: int = 4) -> None:
        self._buffers = [torch.empty(shape, dtype=dtype, pin_memory=True) for _ in range(depth)]
        self._copied = [torch.cuda.Event() for _ in range(depth)]  # after the last copy from or into it
        self._taken = 0

    def take(self) -> Lease:
        i = self._taken % len(self._buffers)
        self._taken += 1
        self._copied[i].synchronize()  # a copy queued earlier: done long ago, as a rule
        return Lease(self, i, self._taken)

    def queued(self, lease: Lease) -> None:
        """A copy from or into the lease's buffer was just queued on the current stream."""
        self._copied[lease.index].record()


class Lease:
    """One turn of a `PinnedRing` buffer."""

    def __init__(self, ring: PinnedRing, index: int, turn: int) -> None:
        self.ring, self.index, self.turn = ring, index, turn
        self.buffer = ring._buffers[index]

    @property
    def event(self) -> torch.cuda.Event:
        """The buffer's event (`PinnedRing.queued`): passed once its last copy has run."""
        return self.ring._copied[self.index]

    def current(self) -> bool:
        """Whether the buffer has not been handed out again since."""
        return self.ring._taken - self.turn < len(self.ring._buffers)


class ToHost:
    """A device tensor copied to the host as the stream gets to it; on the CPU, the tensor itself.

    into: where it lands (a lease of a `PinnedRing` of its shape); default: fresh pinned memory.
    """

    def __init__(self, tensor: torch.Tensor, into: Lease | None = None) -> None:
        self._event = None
        self._lease = into
        if not tensor.is_cuda:
            self._host = tensor
            return
        if into is None:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:  # the ring's buffer and its event: a step allocates neither
            self._host = into.buffer
            self._host.copy_(tensor, non_blocking=True)
            into.ring.queued(into)
            self._event = into.event

    def ready(self) -> bool:
        """Whether the copy has arrived (reading it would not wait)."""
        self._check_lease()
        return self._event is None or self._event.query()

    def get(self) -> torch.Tensor:
        """The copy, once it has arrived."""
        self._check_lease()
        if self._event is not None:
            self._event.synchronize()
        return self._host

    def _check_lease(self) -> None:
        # After its turn the buffer, and its event, belong to a later copy.
        if self._lease is not None and not self._lease.current():
            raise RuntimeError("a copy to the host was read after its pinned buffer had been handed out again")
