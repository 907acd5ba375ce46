"""Linear layers in int8 on the CPU (`Quantization.INT8`), through FBGEMM.

Each weight is quantized once, at load: symmetrically, one scale per output row
(max |w| / 127), and packed in FBGEMM's layout. Each product then quantizes its
input on the fly (one scale and zero point for the whole input, from its range),
multiplies in int8 with int32 sums and returns float32 with the bias added:
PyTorch's dynamic quantization, without its module-swapping machinery.

The input's scale is the whole batch's: a row's result depends on the rows beside
it (float32's does not), so the same recording may come out differently in
another batch.

The inputs use 7 bits, not 8 (`reduce_range`): on processors without VNNI,
FBGEMM's AVX2 kernel adds pairs of u8 x s8 products in 16 bits, which full-range
inputs can overflow.

What stays float32: the convolutions, attention, layer norms and embeddings. The
output projection is quantized as well: it is tied to the token embedding, whose
float32 rows the decoder still looks up, so the int8 copy is made beside it.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from python_backend_lib.core.quantization import Quantization, device_problem
from python_backend_lib.engine.cpu_linear import replace_linears

# Integer range of the symmetric weights: -127..127, so that negating one never overflows.
WEIGHT_LEVELS = 127
ENGINE = "fbgemm"


def problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why a model on `device` in `dtype` cannot run its linear layers in int8, or None."""
    off_cpu = device_problem(Quantization.INT8, str(device))
    if off_cpu is not None:
        return off_cpu
    if ENGINE not in torch.backends.quantized.supported_engines:
        return f"int8 quantization needs PyTorch's {ENGINE} kernels, which this build of PyTorch lacks"
    if dtype != torch.float32:
        return f"int8 quantization keeps the rest of the model in float32, not {dtype}"
    return None


def pack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.ScriptObject:
    """weight [out, in] (and bias [out]) in float -> FBGEMM's packed int8 weight."""
    weight = weight.detach().float()
    scales = (weight.abs().amax(dim=1) / WEIGHT_LEVELS).clamp(min=torch.finfo(torch.float32).tiny)
    levels = torch.round(weight / scales[:, None]).clamp(-WEIGHT_LEVELS, WEIGHT_LEVELS).to(torch.int8)
    with warnings.catch_warnings():
        # PyTorch 2.13 deprecates the qint8 tensor type, which FBGEMM's packing
        # takes here once per layer; the products themselves use no such tensor.
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        quantized = torch._make_per_channel_quantized_tensor(
            levels, scales.double(), torch.zeros_like(scales, dtype=torch.long), 0
        )
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = ENGINE  # the packed weight keeps its engine; the setting is only read here
    try:
        return torch.ops.quantized.linear_prepack(quantized, None if bias is None else bias.detach().float())
    finally:
        torch.backends.quantized.engine = previous


def int8_linear(x: torch.Tensor, packed: torch.ScriptObject) -> torch.Tensor:
    """≈ F.linear(x, weight, bias) with `packed = pack(weight, bias)`; x [..., in] -> [..., out] in float32."""
    return torch.ops.quantized.linear_dynamic(x, packed, True)


class Int8Linear(nn.Module):
    """An nn.Linear whose product runs in int8. The float weight is dropped: the
    packed one holds the int8 weight, its scales and the float bias."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = pack(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.packed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_linears(module: nn.Module) -> int:
    """Replace every nn.Linear inside `module` by an Int8Linear; how many were replaced."""
    return replace_linears(module, Int8Linear)
