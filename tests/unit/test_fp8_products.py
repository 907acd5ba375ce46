"""bench.fp8_products' scales: each block of the shape asked for has its own, its largest
magnitude maps to E4M3's largest value, and the values dequantize back to within FP8's step."""

from __future__ import annotations

import pytest
import torch

from bench import fp8_products


@pytest.mark.parametrize("scale_shape", [(64, 1), (1, 1), (64, 4), (2, 4)])
def test_each_block_has_its_own_scale_and_dequantizes_back(scale_shape):
    torch.manual_seed(0)
    x = torch.randn(128, 512)
    x[:, 7] *= 50  # one column of outliers: its blocks' scales must be larger than the others'
    values, scales = fp8_products.quantize(x, scale_shape)
    assert values.dtype == fp8_products.FP8 and scales.shape == scale_shape
    rows, cols = x.shape[0] // scale_shape[0], x.shape[1] // scale_shape[1]
    for i in range(scale_shape[0]):
        for j in range(scale_shape[1]):
            block = x[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]
            assert scales[i, j] == pytest.approx(block.abs().max().item() / fp8_products.FP8_MAX, rel=1e-6)
    back = fp8_products.dequantized(values, scales)
    # each value's scale, and half of E4M3's steps: 1/16 of a normal value (3 bits of
    # mantissa), 2^-10 of the scale for the smallest (subnormal) ones
    scale = fp8_products.dequantized(torch.ones_like(x).to(fp8_products.FP8), scales)
    assert ((back - x).abs() <= x.abs() / 16 + scale * 2.0**-10).all()
