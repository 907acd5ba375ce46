"""bench.encoder_attention's FP8 inputs on the CPU: one scale per head, values within
E4M3's range, and values times scale the input to FP8's precision (what it hands
FlashInfer's FP8 kernels as q, k and v with their scales)."""

import torch

from bench.encoder_attention import per_head_fp8, relative_error
from python_backend_lib.engine.fp8_linear import FP8_MAX


def test_each_head_is_scaled_to_fp8s_range_and_back_within_its_precision():
    torch.manual_seed(0)
    x = torch.randn(300, 4, 64) * torch.tensor([0.01, 1.0, 30.0, 500.0])[None, :, None]
    values, scale = per_head_fp8(x)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (4,)
    assert torch.equal(values.float().abs().amax(dim=(0, 2)), torch.full((4,), FP8_MAX))
    back = values.float() * scale[None, :, None]
    # E4M3 keeps 3 mantissa bits: within 1/16 of each value, or of the head's scale near zero.
    assert ((back - x).abs() <= torch.maximum(x.abs() / 16, scale[None, :, None] / 2**6)).all()
    assert relative_error(back, x) < 0.05


def test_a_head_of_zeros_stays_zeros():
    values, scale = per_head_fp8(torch.zeros(10, 2, 8))
    assert not values.float().any() and (scale > 0).all()
