"""How the engine's linear layers multiply: `whisper-triton serve --quantize` (no torch).

The checkpoint's weights in the model's dtype are the default, and the only exact
choice: its tokens are the reference implementations'. int8 trades that for speed
on the CPU, and fp8 on Hopper GPUs, where a window's matrix products are most of its
cost.
"""

from __future__ import annotations

import enum


class Quantization(str, enum.Enum):
    NONE = "none"  # the checkpoint's weights in the model's dtype
    # On the CPU only: every linear layer, and the output projection, in int8
    # (`engine.cpu_int8`); results close to float32's, not equal to them.
    INT8 = "int8"
    # On Hopper-class GPUs only: the products over the encoder's positions in FP8
    # (`engine.fp8_linear`), the rest of the model in bfloat16; results close to
    # float16's, not equal to them (docs/benchmarks/fp8-accuracy).
    FP8 = "fp8"


DEFAULT_QUANTIZATION = Quantization.NONE
CPU_ONLY = frozenset({Quantization.INT8})
GPU_ONLY = frozenset({Quantization.FP8})


def device_problem(quantization: Quantization, device: str) -> str | None:
    """Why `quantization` cannot run on `device` ("cpu", "cuda:0", ...), or None."""
    if quantization in CPU_ONLY and not device.startswith("cpu"):
        return f"{quantization.value} quantization runs on the CPU only, not on {device}"
    if quantization in GPU_ONLY and not device.startswith("cuda"):
        return f"{quantization.value} quantization runs on a CUDA GPU only, not on {device}"
    return None
