"""Which kernel runs the encoder's self-attention on a GPU: the whisper model's
`encoder_attention` parameter (no torch).

Each 30 s window attends over its own 1,500 positions, every head, without a mask.
Both kernels compute it in the model's dtype with float32 sums, in different orders,
so a transcript may differ between them as it may between two GPUs. PyTorch's SDPA
(cuDNN's flash kernel) needs nothing at start; FlashInfer's ragged prefill kernel
(FA3 on Hopper) is faster but its module compiles when the engine starts, once per
machine (`engine.flashinfer_attention.RaggedEncoderAttention`).
"""

from __future__ import annotations

import enum


class EncoderKernel(str, enum.Enum):
    SDPA = "sdpa"  # torch.nn.functional.scaled_dot_product_attention
    FLASHINFER = "flashinfer"  # FlashInfer's BatchPrefillWithRaggedKVCacheWrapper, non-causal


DEFAULT_ENCODER_KERNEL = EncoderKernel.SDPA
