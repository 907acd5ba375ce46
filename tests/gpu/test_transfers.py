"""Small copies between the host and a GPU without waiting for the device
(`devices.transfers`): a ring of pinned buffers whose events are reused turn after
turn must hand back each copy's own values, and refuse a copy read after its
buffer came round again."""

from __future__ import annotations

import pytest
import torch

from python_backend_lib.devices.transfers import PinnedRing, ToHost

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")


def busy(ms: float) -> None:
    """Keep the current stream busy for about `ms`, so copies queued now wait behind it."""
    torch.cuda._sleep(int(ms * 1e6))  # cycles: about a millisecond a million at 1 to 2 GHz


def test_copies_through_a_ring_each_arrive_with_their_own_values():
    ring = PinnedRing((3,), torch.float32, depth=2)
    for turn in range(7):
        busy(2)  # each copy is queued behind work: reading it must wait for its own event
        values = torch.full((3,), float(turn), device=CUDA)
        copy = ToHost(values, into=ring.take())
        assert copy.get().tolist() == [float(turn)] * 3


def test_a_copy_read_after_its_buffer_came_round_again_is_refused():
    ring = PinnedRing((2,), torch.float32, depth=2)
    first = ToHost(torch.ones(2, device=CUDA), into=ring.take())
    ToHost(torch.zeros(2, device=CUDA), into=ring.take())
    assert first.get().tolist() == [1.0, 1.0]  # still its turn: the second took the other buffer
    ToHost(torch.full((2,), 2.0, device=CUDA), into=ring.take())  # the first's buffer, and event, again
    with pytest.raises(RuntimeError, match="handed out again"):
        first.get()
    with pytest.raises(RuntimeError, match="handed out again"):
        first.ready()


def test_staging_waits_for_the_copy_that_last_read_its_buffer():
    ring = PinnedRing((4,), torch.float32, depth=1)
    landed = torch.zeros(4, device=CUDA)
    lease = ring.take()
    lease.buffer.fill_(5.0)
    busy(5)
    landed.copy_(lease.buffer, non_blocking=True)  # queued behind the sleep
    ring.queued(lease)
    again = ring.take()  # the same buffer: waits for the copy above before handing it out
    again.buffer.fill_(9.0)
    assert landed.tolist() == [5.0] * 4
