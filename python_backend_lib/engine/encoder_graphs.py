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
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from python_backend_lib.core.geometry import N_FRAMES
from python_backend_lib.devices.buckets import bucket_sizes, choose_bucket
from python_backend_lib.devices.graph_capture import CapturedGraph, capture_graphs
from python_backend_lib.devices.transfers import pinned
from python_backend_lib.engine.attention import SdpaAttention
from python_backend_lib.engine.kv_cache import SCRATCH_SLOT, KVSlotPool
from python_backend_lib.engine.model import Whisper

log = logging.getLogger(__name__)

# Admission sizes with a captured pass, up to the engine's default `max_admit`.
ENCODER_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)


@dataclass
class _Buffers:
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
        self._graphs: dict[int, CapturedGraph[_Buffers, None]] = {}
        self.capture_seconds = 0.0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def fits(self, n: int) -> bool:
        return choose_bucket(self.buckets, n) is not None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket (`devices.graph_capture`)."""
        self._graphs, cost = capture_graphs(self.buckets, self._buffers, self._forward, self.device)
        self.capture_seconds = cost.seconds
        sizes = ",".join(map(str, self.buckets))
        log.info("captured %d encoder graphs (batch %s) in %.2f s", len(self.buckets), sizes, self.capture_seconds)

    def _buffers(self, batch: int) -> _Buffers:
        mel = torch.zeros(batch, self.model.dims.n_mels, N_FRAMES, device=self.device, dtype=self.dtype)
        return _Buffers(mel, torch.full((batch,), SCRATCH_SLOT, dtype=torch.long, device=self.device))

    def _forward(self, buffers: _Buffers) -> None:
        """The captured work: encode the clips, write their cross K/V into their slots."""
        audio = self.model.encode(buffers.mel, self.attention)
        self.pool.write_cross(buffers.slots, self.model.cross_kv(audio))

    @torch.inference_mode()
    def run(self, mel: torch.Tensor, slots: Sequence[int], *, replay: bool = True) -> None:
        """Encode `mel` [n, n_mels, 3000] (the model's dtype) into `slots` (n of them).

        replay=False launches the captured pass's kernels directly on the same buffers
        instead of replaying the graph: the same bits (tests check it)."""
        n = len(slots)
        batch = choose_bucket(self.buckets, n)
        if batch is None:
            raise ValueError(f"{n} clips do not fit the largest captured encoder batch {self.max_batch}")
        captured = self._graphs[batch]
        buffers = captured.buffers
        buffers.mel[:n].copy_(mel)
        buffers.mel[n:].zero_()
        # From pinned memory: a decoder step may still run, and admitting must not wait for it.
        padded_slots = np.array([*slots, *[SCRATCH_SLOT] * (batch - n)], dtype=np.int64)
        buffers.slots.copy_(pinned(padded_slots), non_blocking=True)
        if replay:
            captured.replay()
        else:
            self._forward(buffers)
