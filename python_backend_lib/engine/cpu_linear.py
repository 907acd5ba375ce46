"""Linear layers on the CPU through oneDNN, their weights packed once at load.

PyTorch's float32 `F.linear` on the CPU calls MKL, which takes its AVX2 code
path on AMD processors; oneDNN picks the widest instructions the processor has
(AVX-512 on Zen 4 and 5), which is the faster path on AMD for the encoder's
products and the tied output projection (read whole at every decoder step). The
products are the same float32 arithmetic summed in another order: logits differ
from MKL's in the last bits (about 1e-5 relative), and the greedy tokens stay those
of transformers on every test clip (tests/unit/test_transcribe.py).

Packing is for float32 on the CPU only; elsewhere the model stays as it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# Rows the packed layout is tuned for: the encoder's 1,500 positions. Decoder
# steps (a few rows) measured as fast with it as with a layout tuned for them.
PACKING_ROWS = 1500


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this PyTorch can run float32 linears through oneDNN here."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> oneDNN's blocked layout of it (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) with `packed = pack(weight)`; x [..., in] -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """An nn.Linear whose product runs on its packed weight.

    The original weight and bias stay registered, so state dicts and
    `parameters()` are unchanged; the packed copy is a non-persistent buffer.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.register_buffer("packed", pack(linear.weight), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


def replace_linears(module: nn.Module, replacement: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every nn.Linear inside `module` by `replacement(linear)`; how many were replaced."""
    replaced = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, replacement(child))
            replaced += 1
        else:
            replaced += replace_linears(child, replacement)
    return replaced


def pack_linears(module: nn.Module) -> int:
    """Replace every nn.Linear inside `module` by a PackedLinear; how many were replaced."""
    return replace_linears(module, PackedLinear)
