"""Captured encoder passes: new requests encoded and their cross-attention K/V
written into their slots, one CUDA graph per admission size.

Admitting requests runs the whole encoder (convolutions, every layer) and the
decoder's cross K/V projections: a few hundred kernels, whose launches cost the
engine thread more time than the GPU takes for a few clips. Each bucket holds
one captured pass for exactly `batch` clips; n clips replay the smallest
bucket with batch >= n, the rest padded with silence whose K/V go to the
scratch slot (which padded decode rows read, and nothing else).

The encoder's attention goes through PyTorch SDPA in the graphs: it needs no
host-side plan, and attention is about a tenth of an encoder layer's time, so
FlashInfer's fa3 kernel (1.2x faster there) would save little.

Static buffers: `mel` [batch, n_mels, 3000] in the model's dtype and `slots`
[batch], both copied into before each replay. Outputs go to the KV pool,
outside the graphs' memory, so nothing is read back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from python_backend_lib.core.geometry import N_FRAMES
from python_backend_lib.devices.buckets import bucket_sizes, choose_bucket
from python_backend_lib.devices.transfers import pinned
from python_backend_lib.engine.attention import SdpaAttention
from python_backend_lib.engine.kv_cache import SCRATCH_SLOT, KVSlotPool
from python_backend_lib.engine.model import Whisper

log = logging.getLogger(__name__)

# Admission sizes with a captured pass, up to the engine's default `max_admit`.
ENCODER_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    mel: torch.Tensor  # [batch, n_mels, N_FRAMES]
    slots: torch.Tensor  # [batch] long


class EncoderGraphs:
    def __init__(self, model: Whisper, pool: KVSlotPool, *, buckets: Sequence[int] = ENCODER_BUCKETS) -> None:
        self.model = model
        self.pool = pool
        self.attention = SdpaAttention(pool)
        self.buckets = bucket_sizes(max(buckets), buckets)
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self._entries: dict[int, _Entry] = {}
        self.capture_seconds = 0.0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def fits(self, n: int) -> bool:
        return choose_bucket(self.buckets, n) is not None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one private memory pool of their own."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for batch in sorted(self.buckets, reverse=True):
            mel = torch.zeros(batch, self.model.dims.n_mels, N_FRAMES, device=self.device, dtype=self.dtype)
            slots = torch.full((batch,), SCRATCH_SLOT, dtype=torch.long, device=self.device)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up: lazy initialisation stays out of the graph
                    self._encode(mel, slots)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=side):  # on this GPU (engine.device)
                self._encode(mel, slots)
            self._entries[batch] = _Entry(graph, mel, slots)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        sizes = ",".join(map(str, self.buckets))
        log.info("captured %d encoder graphs (batch %s) in %.2f s", len(self.buckets), sizes, self.capture_seconds)

    def _encode(self, mel: torch.Tensor, slots: torch.Tensor) -> None:
        audio = self.model.encode(mel, self.attention)
        self.pool.write_cross(slots, self.model.cross_kv(audio))

    @torch.inference_mode()
    def run(self, mel: torch.Tensor, slots: Sequence[int]) -> None:
        """Encode `mel` [n, n_mels, 3000] (the model's dtype) into `slots` (n of them)."""
        n = len(slots)
        batch = choose_bucket(self.buckets, n)
        if batch is None:
            raise ValueError(f"{n} clips do not fit the largest captured encoder batch {self.max_batch}")
        entry = self._entries[batch]
        entry.mel[:n].copy_(mel)
        entry.mel[n:].zero_()
        # From pinned memory: a decoder step may still run, and admitting must not wait for it.
        entry.slots.copy_(pinned(np.array([*slots, *[SCRATCH_SLOT] * (batch - n)], dtype=np.int64)), non_blocking=True)
        entry.graph.replay()
