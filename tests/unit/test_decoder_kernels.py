"""The decoder step's fused kernels against the PyTorch they replace: the residual sum
with the layer norm that reads it (`residual_norm`), and each row's new K and V written
to the self-attention cache in one kernel (`kv_cache.write_positions`).

On a GPU the kernels run compiled (`scripts/gpu_run.sh tests`); without one, in Triton's
interpreter, so that CI checks them on every change.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
from torch import nn

from python_backend_lib.engine import kv_cache

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Without a GPU, conftest.py has asked for Triton's interpreter before anything imported Triton.
assert DEVICE.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
pytest.importorskip("triton")
residual_norm = importlib.import_module("python_backend_lib.engine.residual_norm")
pytestmark = pytest.mark.gpu
# The interpreter computes with NumPy, which has no bfloat16: that dtype is checked compiled only.
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def _norm(width: int, dtype: torch.dtype, seed: int) -> nn.LayerNorm:
    norm = nn.LayerNorm(width).to(DEVICE, dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=generator) * 0.5 + 1.0)
        norm.bias.copy_(torch.randn(width, generator=generator) * 0.1)
    return norm


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [384, 1280])  # tiny's and large-v3's: neither a power of two
def test_the_residual_sum_and_its_norm_are_pytorchs(dtype, width):
    """The sum is PyTorch's to the bit (the next layer adds to it). The norm, computed in
    float32 either way with the mean and variance summed in other orders, differs from
    PyTorch's in a 16-bit dtype at most in its last bit, and in few values."""
    norm = _norm(width, dtype, seed=width)
    generator = torch.Generator().manual_seed(7)
    x = (torch.randn(9, width, generator=generator) * 4).to(DEVICE, dtype)
    branch = (torch.randn(9, width, generator=generator) + 3).to(DEVICE, dtype)  # a mean far from 0
    with torch.no_grad():
        total, normed = residual_norm.add_norm_kernel(x, branch, norm)
        wanted_total, wanted = residual_norm.add_norm_reference(x, branch, norm)
    assert torch.equal(total, wanted_total)
    if dtype == torch.float32:  # the norm's float32 arithmetic is its output: a few of its ulps apart
        torch.testing.assert_close(normed, wanted)
        return
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(normed, wanted, rtol=ulp, atol=ulp)
    assert (normed != wanted).float().mean() < 0.02


def test_a_decoder_step_s_rows_keep_their_own_norms():
    """Rows of one call are normalised each on its own: a row's output does not depend on
    the rows beside it (a bucket's padding rows included)."""
    norm = _norm(384, torch.float16, seed=1)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 384, generator=generator).to(DEVICE, torch.float16)
    branch = torch.randn(5, 384, generator=generator).to(DEVICE, torch.float16)
    with torch.no_grad():
        _, together = residual_norm.add_norm_kernel(x, branch, norm)
        _, alone = residual_norm.add_norm_kernel(x[2:3] * 1, branch[2:3] * 1, norm)
        _, scaled = residual_norm.add_norm_kernel(torch.cat([x[:2] * 100, x[2:]]), torch.cat([branch[:2] * 100, branch[2:]]), norm)
    assert torch.equal(together[2], alone[0]) and torch.equal(together[2:], scaled[2:])


def test_each_row_s_k_and_v_land_where_index_copy_puts_them():
    """K and V as the decoder hands them, views of the fused q/k/v product (rows apart by
    three widths), written to a flattened cache: the same bits as `index_copy_`, and nothing
    else written."""
    heads, dim, rows = 6, 64, 4
    width = heads * dim
    generator = torch.Generator().manual_seed(11)
    fused = torch.randn(rows, 3 * width, generator=generator).to(DEVICE, torch.float16)
    _, k, v = (part.view(rows, heads, dim) for part in fused.chunk(3, dim=-1))
    index = torch.tensor([17, 3, 40, 0], device=DEVICE)
    caches = [torch.full((64, heads, dim), -1.0, device=DEVICE, dtype=torch.float16) for _ in range(4)]
    assert kv_cache._rows_of_heads(k, caches[0])  # what `write_positions` asks of the kernel's inputs
    kv_cache.write_positions_kernel(caches[0], caches[1], index, k, v)
    caches[2].index_copy_(0, index, k)
    caches[3].index_copy_(0, index, v)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert not torch.equal(caches[0], caches[1])
