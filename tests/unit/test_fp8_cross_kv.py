"""An FP8 cross-attention K/V cache (`EngineSetup.fp8_cross_kv`, `KVSlotPool(cross_dtype=...)`)
without a GPU: what the pool stores (E4M3, saturated, no scale), that beams' copies and
every reader see those values in the model's dtype, the slots it leaves room for, and
where it is refused. tests/gpu/test_gpu_fp8.py checks FlashInfer's kernels on it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from python_backend_lib.checkpoints.configs import load_config
from python_backend_lib.checkpoints.weights import load_checkpoint
from python_backend_lib.core.quantization import Quantization
from python_backend_lib.engine import kv_cache
from python_backend_lib.engine.attention import SdpaAttention, StepLayout
from python_backend_lib.engine.fp8_linear import FP8, FP8_MAX
from python_backend_lib.engine.kv_cache import PAGE_SIZE, KVSlotPool, PoolShape, slots_for_memory, stored_cross
from python_backend_lib.engine.loading import EngineSetup, LoadTimes, build_batch
from python_backend_lib.engine.model import Whisper
from python_backend_lib.transcription.alignment import Aligner

CPU = torch.device("cpu")
SHAPE = PoolShape(n_slots=3, n_layers=2, n_heads=2, head_dim=4, text_ctx=8, audio_ctx=20)


def layer_kv(seed: int, batch: int, scale: float = 3.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, SHAPE.audio_ctx, SHAPE.n_heads, SHAPE.head_dim)
    return [(torch.randn(shape, generator=generator) * scale, torch.randn(shape, generator=generator) * scale)
            for _ in range(SHAPE.n_layers)]


def test_stored_values_are_saturated_then_rounded_to_e4m3():
    values = torch.tensor([1000.0, 448.0, 449.0, -3000.0, 0.3, 1e-4, 17.0])
    stored = stored_cross(values, FP8)
    assert stored.dtype == FP8
    assert stored.float().tolist()[:4] == [FP8_MAX, FP8_MAX, FP8_MAX, -FP8_MAX]  # no NaN for a large value
    # Round to nearest: within half a step of E4M3's 3-bit mantissa (or of its smallest subnormal).
    finite = values.abs() <= FP8_MAX
    error = (stored.float() - values).abs()[finite]
    assert (error <= values.abs()[finite] / 16 + 2.0**-10).all()
    assert torch.equal(stored_cross(values, torch.float32), values)  # the model's dtype: as it is


def test_a_pool_keeps_cross_kv_in_fp8_and_self_kv_in_the_models_dtype():
    pool = KVSlotPool(SHAPE, device=CPU, dtype=torch.float32, cross_dtype=FP8)
    assert pool.cross_dtype == FP8 and pool.cross_k[0].dtype == FP8 and pool.self_k[0].dtype == torch.float32
    kv = layer_kv(0, 2, scale=200.0)  # some values past 448
    pool.write_cross(torch.tensor([2, 3]), kv)
    for layer, (k, v) in enumerate(kv):
        assert torch.equal(pool.cross_k[layer][2:4].view(torch.uint8), stored_cross(k, FP8).view(torch.uint8))
        assert torch.equal(pool.cross_v[layer][2:4].view(torch.uint8), stored_cross(v, FP8).view(torch.uint8))
        assert not pool.cross_k[layer][1].float().any()  # other slots untouched
    pool.copy_cross(torch.tensor([3]), torch.tensor([1]))  # a beam taking its request's audio
    assert torch.equal(pool.cross_k[1][1].view(torch.uint8), pool.cross_k[1][3].view(torch.uint8))
    with pytest.raises(ValueError, match="model's dtype or"):
        KVSlotPool(SHAPE, device=CPU, dtype=torch.float32, cross_dtype=torch.float16)


def test_the_gpu_copy_kernel_saturates_and_rounds_as_the_pool_does():
    """`_copy_rows` in Triton's interpreter (compiled on a GPU in tests/gpu/test_gpu_fp8.py,
    where it must equal `stored_cross` bit for bit). The interpreter's own conversion to
    E4M3 keeps the exponent of a value that rounds up to the next power of two (31.6
    becomes 16, not 32): those values are left to the GPU test."""
    if kv_cache.triton is None:
        pytest.skip("Triton is not installed")
    storage = torch.zeros(4, SHAPE.n_heads, SHAPE.audio_ctx, SHAPE.head_dim, dtype=FP8)  # heads first
    values = layer_kv(1, 2, scale=200.0)[0][0]  # positions first
    kv_cache._copy_into_slots(values, storage, torch.tensor([3, 1]))
    for got, wanted in ((storage[3].transpose(0, 1), values[0]), (storage[1].transpose(0, 1), values[1])):
        expected = stored_cross(wanted, FP8).float()
        same_binade = torch.floor(torch.log2(expected.abs())) == torch.floor(torch.log2(wanted.abs()))
        assert same_binade.float().mean() > 0.8
        assert torch.equal(got.float()[same_binade], expected[same_binade])
        assert (got.float().abs() <= FP8_MAX).all() and (got.float().sign() == wanted.sign()).all()
    assert not storage[[0, 2]].float().any()


def test_sdpa_cross_attention_reads_the_fp8_values_as_a_float_pool_holding_them():
    """The same query over an FP8 pool and over a float32 pool that holds the FP8 values:
    the same attention, bit for bit (the reader only casts back)."""
    fp8_pool = KVSlotPool(SHAPE, device=CPU, dtype=torch.float32, cross_dtype=FP8)
    float_pool = KVSlotPool(SHAPE, device=CPU, dtype=torch.float32)
    kv = layer_kv(2, 3)
    slots = torch.tensor([1, 2, 3])
    fp8_pool.write_cross(slots, kv)
    float_pool.write_cross(slots, [(stored_cross(k, FP8).float(), stored_cross(v, FP8).float()) for k, v in kv])
    layout = StepLayout(slots=torch.tensor([3, 1]), query_lens=(1, 2), cached_lens=(0, 4))
    q = torch.randn(3, SHAPE.n_heads, SHAPE.head_dim, generator=torch.Generator().manual_seed(3))
    for in_place in (True, False):  # the CPU's loop over slots, and the gathered rows a GPU runs
        outputs = []
        for pool in (fp8_pool, float_pool):
            attention = SdpaAttention(pool)
            attention._in_place = in_place
            attention.begin_step(layout)
            outputs.append(attention.cross_attention(1, q))
        assert torch.equal(*outputs), in_place


def test_word_alignment_reads_a_kept_fp8_slot_in_the_models_dtype():
    checkpoint = load_checkpoint("random:tiny:0")
    model = Whisper.from_checkpoint(checkpoint, device=CPU, dtype=torch.float32)
    pool = KVSlotPool(PoolShape.for_model(checkpoint.config.dims, 2), device=CPU, dtype=torch.float32, cross_dtype=FP8)
    features = torch.randn(1, checkpoint.config.dims.n_mels, 3000, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        pool.write_cross(torch.tensor([2]), model.cross_kv(model.encode(features, SdpaAttention(pool))))
    aligner = Aligner(model, checkpoint.config, tokenizer=None, pool=pool)
    audio = aligner.window_audio(None, audio_slot=2)
    assert len(audio) == checkpoint.config.dims.n_text_layer
    for layer, (k, v) in enumerate(audio):
        assert k.dtype == v.dtype == torch.float32 and k.shape[0] == 1
        assert torch.equal(k, pool.cross_k[layer][2:3].float())


def test_fp8_cross_kv_leaves_room_for_more_slots():
    dims = load_config("random:large-v3").dims  # the shapes alone: no weights drawn
    one = PoolShape.for_model(dims, 1)
    half = one.bytes_per_slot(torch.bfloat16, FP8)
    whole = one.bytes_per_slot(torch.bfloat16)
    self_positions = one.self_pages_per_slot * PAGE_SIZE
    cross_share = one.audio_ctx / (one.audio_ctx + self_positions)
    assert half == pytest.approx(whole * (1 - cross_share / 2))
    budget = 40 * whole
    assert slots_for_memory(dims, torch.bfloat16, budget, 256, FP8) > slots_for_memory(dims, torch.bfloat16, budget, 256)


def test_an_fp8_cross_cache_comes_with_fp8_quantization_only():
    checkpoint = load_checkpoint("random:tiny:0")
    setup = dataclasses.replace(EngineSetup(slots=2), fp8_cross_kv=True)
    assert setup.quantization is Quantization.NONE
    with pytest.raises(ValueError, match="FP8 quantization only"):
        build_batch(checkpoint, CPU, torch.float32, setup, LoadTimes())


def test_fp8_quantization_keeps_the_cross_cache_in_fp8_unless_told_not_to():
    fp8 = EngineSetup(quantization=Quantization.FP8)
    assert fp8.cross_kv_in_fp8
    assert not dataclasses.replace(fp8, fp8_cross_kv=False).cross_kv_in_fp8
    assert not EngineSetup().cross_kv_in_fp8 and not EngineSetup(quantization=Quantization.INT8).cross_kv_in_fp8
