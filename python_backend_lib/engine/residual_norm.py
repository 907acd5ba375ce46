"""A decoder layer's residual sums and the layer norm that reads each, in one kernel.

A decoder step over a few rows is bound by how many kernels it launches, not by
what they compute. Each of a decoder layer's three sub-layers ends with
`x + branch`, and the next to read that sum is a layer norm: the next sub-layer's,
the next layer's first, or the decoder's last. `add_norm` returns both, the sum and
its norm. On a GPU one Triton kernel (`_add_norm_rows`) writes the two, where
PyTorch launches an addition and a layer norm; elsewhere PyTorch computes them as
the unfused layers did.

The kernel rounds the sum to x's dtype as PyTorch's addition does (the same bits),
and computes the norm from that sum in float32, as PyTorch's layer norm does; the
two sum the mean and the variance in different orders, which can move the norm's
last bit.
"""

from __future__ import annotations

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU torch of a CI machine
    triton = None

# Columns each warp of `_add_norm_rows` holds, and the most warps a row gets.
COLUMNS_PER_WARP = 256
MAX_WARPS = 8


def add_norm_reference(x: torch.Tensor, branch: torch.Tensor, norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """x + branch, and its layer norm by `norm`, as PyTorch's two layers compute them."""
    total = x + branch
    return total, norm(total)


def add_norm(x: torch.Tensor, branch: torch.Tensor, norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """As `add_norm_reference`, for x and branch [..., cols] of one dtype; in one kernel on a GPU."""
    if triton is None or x.device.type != "cuda" or x.numel() == 0:
        return add_norm_reference(x, branch, norm)
    return add_norm_kernel(x, branch, norm)


def add_norm_kernel(x: torch.Tensor, branch: torch.Tensor, norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_norm` through `_add_norm_rows` on x's device (the CPU in Triton's interpreter, for tests)."""
    x, branch = x.contiguous(), branch.contiguous()
    total, normed = torch.empty_like(x), torch.empty_like(x)
    cols = x.shape[-1]
    block = triton.next_power_of_2(cols)
    warps = max(1, min(MAX_WARPS, block // COLUMNS_PER_WARP))
    _add_norm_rows[(x.numel() // cols,)](
        x, branch, total, normed, norm.weight, norm.bias, cols, norm.eps, BLOCK=block, num_warps=warps
    )
    return total, normed


if triton is not None:

    @triton.jit
    def _add_norm_rows(x_ptr, branch_ptr, total_ptr, normed_ptr, weight_ptr, bias_ptr, cols, eps,
                       BLOCK: tl.constexpr):  # fmt: skip
        # One row: the sum rounded to x's dtype, then its norm from those rounded values.
        offsets = tl.program_id(0).to(tl.int64) * cols + tl.arange(0, BLOCK)
        column = tl.arange(0, BLOCK)
        inside = column < cols
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0)
        branch = tl.load(branch_ptr + offsets, mask=inside, other=0.0)
        total = (x.to(tl.float32) + branch.to(tl.float32)).to(x.dtype)
        tl.store(total_ptr + offsets, total, mask=inside)
        values = total.to(tl.float32)
        mean = tl.sum(values, axis=0) / cols
        centred = tl.where(inside, values - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / cols + eps)
        weight = tl.load(weight_ptr + column, mask=inside, other=0.0).to(tl.float32)
        bias = tl.load(bias_ptr + column, mask=inside, other=0.0).to(tl.float32)
        tl.store(normed_ptr + offsets, (centred * rstd * weight + bias).to(x.dtype), mask=inside)
