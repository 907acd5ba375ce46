"""The capture loop behind every graph table (`devices.graph_capture`) on a GPU: a graph
left in a reference cycle by an engine closed earlier must not be freed in the middle of
a capture, where destroying it is a CUDA call the capture forbids."""

from __future__ import annotations

import gc

import pytest
import torch

from python_backend_lib.devices.graph_capture import capture_graphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")


class _Cycle:
    """Holds what it is given, and itself: only the collector frees it (young, so the
    next collection of the youngest generation does)."""

    def __init__(self, held: object) -> None:
        self.held = held
        self.itself = self


def test_a_graph_that_becomes_garbage_during_a_capture_does_not_break_it():
    def doubled(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    earlier, _ = capture_graphs([4], lambda size: torch.ones(size, device=CUDA), doubled, CUDA)
    pending = [earlier]  # an earlier engine's graphs, still referenced
    del earlier

    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing() and pending:
            _Cycle(pending.pop())  # mid-capture their last reference goes, into a new cycle...
            for _ in range(100):
                _Cycle(None)  # ...and allocations reach the collector's threshold
        return x + 1

    thresholds = gc.get_threshold()
    gc.set_threshold(10)  # a collection every few allocations
    try:
        graphs, _ = capture_graphs([8], lambda size: torch.zeros(size, device=CUDA), forward, CUDA)
    finally:
        gc.set_threshold(*thresholds)
    assert not pending  # the capture ran where the garbage appeared
    gc.collect()  # the earlier graphs go now, outside any capture
    assert torch.equal(graphs[8].replay(), torch.ones(8, device=CUDA))
