"""New requests encoded on a second CUDA stream while the batch goes on decoding.

Admitting a request runs the whole encoder over its 30 s window. On the stream that
decodes, every decoder step queued after an admission waits for that encoder pass,
and a decoder step of a big checkpoint is hundreds of small kernels that leave most
of the GPU's units idle while they run. Here the encoder's pass runs on a stream of
its own (`SideEncoder.stream`): the decoder's steps go on between its kernels, and
the new rows join the steps once their audio is encoded.

How the two streams stay ordered:
- The side stream starts an admission's work only after everything the decoding
  stream queued before it: the features written there, and a step in flight that
  may still write into a slot just freed and handed to the new request.
- Features made on another stream are marked as used on the side stream
  (`record_stream`), so that the caching allocator does not hand their memory to
  someone else before the encoder has read them.
- A new row takes part in a step only once the host has seen its admission's event
  complete (`ready`): its cross-attention K/V are written by then, so the decoding
  stream needs no device-side wait.
- The encoder's graphs have their own memory pool and static buffers, apart from
  the decoder's, so the two never share scratch memory.

At most `MAX_IN_FLIGHT` admissions are encoding at once (`full`): one running and
one queued behind it: the side stream never idles between two admissions, and no
more of the batch's slots than that wait for their audio instead of decoding.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from python_backend_lib.engine.rows import Admission, Row

# Admissions encoding on the side stream at once.
MAX_IN_FLIGHT = 2


@dataclass
class _Encoding:
    """One admission's rows and the event after its work on the side stream."""

    rows: list[Row]
    done: torch.cuda.Event


class SideEncoder:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._encodings: collections.deque[_Encoding] = collections.deque()
        self._unready: set[Row] = set()  # rows of admissions whose encoding is not seen complete

    @property
    def full(self) -> bool:
        """Whether another admission must wait for one of those encoding to finish."""
        self._settle()
        return len(self._encodings) >= MAX_IN_FLIGHT

    @property
    def encoding(self) -> int:
        """Admissions whose encoding is not seen complete yet."""
        return len(self._encodings)

    def encode(
        self, admissions: Sequence[Admission], work: Callable[[], list[list[Row]]]
    ) -> list[list[Row]]:
        """Run `work` (which encodes `admissions` and returns their rows) on the side
        stream, after what the current stream queued; its rows are not `ready` until
        the side stream has done it."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        for admission in admissions:
            if admission.features.is_cuda:
                admission.features.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            joined = work()
            done = torch.cuda.Event()
            done.record(self.stream)
        rows = [row for group in joined for row in group]
        self._encodings.append(_Encoding(rows, done))
        self._unready.update(rows)
        return joined

    def ready(self, rows: Sequence[Row]) -> list[Row]:
        """The rows of `rows` whose audio is encoded, in their order. When none of them
        is, but some are encoding, waits for the oldest admission first: there is
        nothing else to step."""
        self._settle()
        if self._unready and rows and all(row in self._unready for row in rows):
            self._encodings[0].done.synchronize()
            self._settle()
        if not self._unready:
            return list(rows)
        return [row for row in rows if row not in self._unready]

    def wait_all(self) -> None:
        """Wait until every admission is encoded (a step over rows named by the caller)."""
        while self._encodings:
            self._encodings[0].done.synchronize()
            self._settle()

    def forget(self, row: Row) -> None:
        """A row left the batch (finished, dropped) before or after its audio was encoded."""
        self._unready.discard(row)

    def clear(self) -> None:
        """Forget every admission (the batch was reset: its slots are free again, and
        later admissions' work on this stream comes after whatever is still queued)."""
        self._encodings.clear()
        self._unready.clear()

    def _settle(self) -> None:
        """Mark the admissions whose event completed as encoded, oldest first (one stream
        runs them in order)."""
        while self._encodings and self._encodings[0].done.query():
            for row in self._encodings.popleft().rows:
                self._unready.discard(row)
