"""Which kernel runs the encoder's self-attention on a GPU: the whisper model's
`encoder_attention` parameter (no torch).

Each 30 s window attends over its own 1,500 positions, every head, without a mask.
Both kernels compute it in the model's dtype with float32 sums, in different orders,
so a transcript may differ between them as it may between two GPUs. PyTorch's SDPA
(cuDNN's flash kernel) needs nothing at start; FlashInfer's ragged prefill kernel
(FA3 on Hopper, `engine.flashinfer_attention.RaggedEncoderAttention`) is faster over
many windows but its module compiles when an engine first starts on a machine.

"auto" picks FlashInfer with FP8 products, which run on Hopper only and serve the big
checkpoints at saturation, where the encoder bounds the engine (docs/performance.md,
the big checkpoints), and SDPA otherwise: over one window, what a lone clip costs,
SDPA was the faster.
"""

from __future__ import annotations

import enum


class EncoderKernel(str, enum.Enum):
    SDPA = "sdpa"  # torch.nn.functional.scaled_dot_product_attention
    FLASHINFER = "flashinfer"  # FlashInfer's BatchPrefillWithRaggedKVCacheWrapper, non-causal




def encoder_kernel_for(chosen: EncoderKernel | None, fp8: bool) -> EncoderKernel:
    """The kernel that runs: `chosen`, or for "auto" (None) FlashInfer with FP8 products."""
    if chosen is not None:
        return chosen
    return EncoderKernel.FLASHINFER if fp8 else EncoderKernel.SDPA
