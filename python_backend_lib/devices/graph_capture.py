"""The one capture loop behind every table of CUDA graphs keyed by size: the log-mel
(`audio.feature_graphs`), the encoder (`engine.encoder_graphs`), the decode step
(`engine.cuda_graphs`) and the word alignment's pass (`transcription.alignment_graphs`).
Each table supplies only its static buffers for a size and the forward pass over them;
this loop owns what all of them must get right alike.

- Largest size first, into one private memory pool: the smaller graphs reuse the
  largest one's blocks instead of each reserving its own.
- Warm-up on a side stream before capture, twice: lazy initialisation (cuBLAS
  handles, FFT plans, Triton's kernel cache, FlashInfer's first launch) happens
  outside the graph, and capture never runs on the legacy default stream.
- One side stream for every size, and its cached blocks released at the end. PyTorch's
  caching allocator gives a freed block again only to the stream that allocated it: a
  stream a size would leave each size's warm-up blocks reserved for a stream never used
  again (docs/performance.md has the capture that showed it). The graphs' private pool
  is in use, and stays.
- Python's collector held off while capturing. An engine closed earlier may leave its
  graphs in reference cycles; freeing one is a CUDA call that a capture in progress
  forbids, so a collection that happened to run mid-capture broke the capture (a
  process that loaded pipelines one after another, bench.fp8_accuracy, failed so).
  PyTorch's own `torch.cuda.graph` no longer collects on entry by default.
- The seconds and the device memory the table took, for the start-up log and the
  benchmarks.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

Buffers = TypeVar("Buffers")
Outputs = TypeVar("Outputs")

WARM_UPS = 2  # runs of the forward pass before its capture


@dataclass
class CapturedGraph(Generic[Buffers, Outputs]):
    """One size's graph, the static buffers it reads and the outputs it rewrites."""

    graph: torch.cuda.CUDAGraph
    buffers: Buffers
    outputs: Outputs

    def replay(self) -> Outputs:
        self.graph.replay()
        return self.outputs


@dataclass(frozen=True)
class CaptureCost:
    seconds: float
    bytes: int  # device memory reserved by the capture: the graphs' pool and the buffers


def capture_graphs(
    sizes: Sequence[int],
    buffers_for: Callable[[int], Buffers],
    forward: Callable[[Buffers], Outputs],
    device: torch.device,
) -> tuple[dict[int, CapturedGraph[Buffers, Outputs]], CaptureCost]:
    """Capture `forward(buffers_for(size))` for every size on `device`, largest first,
    into one private memory pool. `buffers_for` runs before the size's warm-up, on the
    current stream, so what it writes is in place before the forward pass reads it."""
    torch.cuda.synchronize(device)
    gc.collect()  # what earlier engines left in cycles goes now, before any capture
    torch.cuda.empty_cache()  # so that the cost below is the table's own
    reserved = torch.cuda.memory_reserved(device)
    start = time.perf_counter()
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream(device)
    captured: dict[int, CapturedGraph[Buffers, Outputs]] = {}
    for size in sorted(sizes, reverse=True):
        buffers = buffers_for(size)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARM_UPS):
                forward(buffers)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with collector_held(), torch.cuda.graph(graph, pool=pool, stream=side):
            outputs = forward(buffers)
        captured[size] = CapturedGraph(graph, buffers, outputs)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the warm-ups' blocks, cached for the side stream
    cost = CaptureCost(time.perf_counter() - start, torch.cuda.memory_reserved(device) - reserved)
    return captured, cost


@contextlib.contextmanager
def collector_held():
    """No automatic collection until the block ends: what becomes garbage meanwhile
    waits for the next one."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
