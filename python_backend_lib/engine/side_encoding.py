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
- A new row takes part in a step once the host has seen its admission's event
  complete (`ready`): its cross-attention K/V are written by then. When no other row
  can step, the decoding stream waits for the event on the device instead, and the
  step is queued behind the encoder's pass at once.
- The encoder's graphs have their own memory pool and static buffers, apart from
  the decoder's, so the two never share scratch memory.

At most `MAX_IN_FLIGHT` admissions wait to join at once (`full`): one encoding and
one queued behind it, so that the side stream never idles between two admissions,
and no more of the batch's slots than that wait for their audio instead of decoding.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from python_backend_lib.engine.rows import Admission, Row

# Admissions encoding on the side stream whose rows no step may take yet.
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

    def ready(self, rows: Sequence[Row]) -> Sequence[Row]:
        """The rows of `rows` that a step launched now may take, in their order: those
        whose audio is encoded. When none of them is, but some are encoding, there is
        nothing else to step: the decoding stream is ordered after the oldest admission
        instead (`_follow`), so that its first step is queued behind the encoder's pass
        as on one stream, without the host waking up in between."""
        self._settle()
        if self._unready and rows and all(row in self._unready for row in rows):
            self._follow(self._encodings.popleft())
        if not self._unready:  # the common case, at every step: no copy
            return rows
        return [row for row in rows if row not in self._unready]

    def wait_all(self) -> None:
        """Order the decoding stream after every admission (a step over rows the caller names)."""
        while self._encodings:
            self._follow(self._encodings.popleft())

    def _follow(self, encoding: _Encoding) -> None:
        """Make the decoding stream wait on the device for `encoding`'s work: its rows
        may take part in what is launched next."""
        torch.cuda.current_stream(self.device).wait_event(encoding.done)
        for row in encoding.rows:
            self._unready.discard(row)

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
