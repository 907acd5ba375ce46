"""Captured encoder passes: new requests encoded and their cross-attention K/V
written into their slots, one CUDA graph per admission size.

Admitting requests runs the whole encoder (convolutions, every layer) and the
decoder's cross K/V projections: a few hundred kernels, whose launches cost the
engine thread more time than the GPU takes for a few clips. Each bucket holds
one captured pass for exactly `batch` clips; n clips replay the smallest
bucket with batch >= n, the rest padded with silence whose K/V go to the
scratch slot (which padded decode rows read, and nothing else).

The encoder's attention goes through PyTorch SDPA in the graphs by default: it
needs no host-side plan. With `EncoderKernel.FLASHINFER` each bucket gets its own
`RaggedEncoderAttention`, planned for its batch when its buffers are made, before its
warm-up and capture; its replays reuse that plan. The buckets share one float
workspace, apart from the decoder's: they run one after another on the admitting
stream while decoder steps run beside them.

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

from python_backend_lib.core.encoder_kernel import EncoderKernel
from python_backend_lib.core.geometry import N_FRAMES
from python_backend_lib.devices.buckets import bucket_sizes, choose_bucket
from python_backend_lib.devices.graph_capture import CapturedGraph, capture_graphs
from python_backend_lib.devices.transfers import pinned
from python_backend_lib.engine.attention import EncoderAttention, SdpaAttention
from python_backend_lib.engine.kv_cache import SCRATCH_SLOT, KVSlotPool
from python_backend_lib.engine.model import Whisper

log = logging.getLogger(__name__)

# Admission sizes with a captured pass, up to the engine's default `max_admit`.
ENCODER_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16)


@dataclass
class _Buffers:
    mel: torch.Tensor  # [batch, n_mels, N_FRAMES]
    slots: torch.Tensor  # [batch] long
    attention: EncoderAttention  # planned for this batch


class EncoderGraphs:
    def __init__(
        self,
        model: Whisper,
        pool: KVSlotPool,
        *,
        buckets: Sequence[int] = ENCODER_BUCKETS,
        kernel: EncoderKernel = EncoderKernel.SDPA,
    ) -> None:
        self.model = model
        self.pool = pool
        self.kernel = EncoderKernel(kernel)
        self.buckets = bucket_sizes(max(buckets), buckets)
        parameter = next(model.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self._workspace: torch.Tensor | None = None  # FlashInfer's, made with the first bucket that needs it
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
        slots = torch.full((batch,), SCRATCH_SLOT, dtype=torch.long, device=self.device)
        return _Buffers(mel, slots, self._attention(batch))

    def _attention(self, batch: int) -> EncoderAttention:
        if self.kernel is EncoderKernel.SDPA:
            return SdpaAttention(self.pool)
        from python_backend_lib.engine.flashinfer_attention import WORKSPACE_BYTES, RaggedEncoderAttention

        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        dims = self.model.dims
        attention = RaggedEncoderAttention(self._workspace)
        head_dim = dims.n_audio_state // dims.n_audio_head
        attention.plan((batch, dims.n_audio_ctx, dims.n_audio_head, head_dim), self.dtype)
        return attention

    def _forward(self, buffers: _Buffers) -> None:
        """The captured work: encode the clips, write their cross K/V into their slots."""
        audio = self.model.encode(buffers.mel, buffers.attention)
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
