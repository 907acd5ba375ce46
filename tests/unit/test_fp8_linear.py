"""`--quantize fp8` without a GPU: the quantization's definition (the PyTorch path the GPU
kernel is compared with in tests/gpu/test_gpu_fp8.py), FP8 products through PyTorch's
CPU `_scaled_mm`, which layers the model quantizes, and where the option is refused."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import torch.nn.functional as F

from python_backend_lib.apps import preflight
from python_backend_lib.apps.server import packaged_model_repository
from python_backend_lib.checkpoints.weights import load_checkpoint
from python_backend_lib.core.quantization import Quantization, device_problem
from python_backend_lib.engine import fp8_linear
from python_backend_lib.engine.loading import default_dtype
from python_backend_lib.engine.model import EncoderLayer, Whisper

CPU = torch.device("cpu")


def test_rows_quantize_to_their_own_scale_and_back_within_e4m3s_precision():
    torch.manual_seed(0)
    x = torch.randn(6, 384) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 0.0, 5.0])[:, None]
    values, scales = fp8_linear.quantize_rows_reference(x)
    assert values.dtype == fp8_linear.FP8 and scales.shape == (6, 1)
    assert not values[4].float().any() and scales[4] == fp8_linear.MIN_SCALE  # a silent row: no division by zero
    assert (values.float().abs().amax(dim=1)[[0, 1, 2, 3, 5]] == fp8_linear.FP8_MAX).all()  # each row's range used
    back = values.float() * scales
    # E4M3 keeps 3 bits of mantissa: at most half a step, 1/16 of the value, off (or a subnormal's step)
    assert ((back - x).abs() <= x.abs() / 16 + scales * 2.0**-9).all()


@pytest.mark.parametrize(("cols", "blocks"), [(5120, (4096, 1024)), (1280, (1024, 256)), (384, (256, 128)),
                                            (1536, (1024, 512)), (512, (512, 16)), (1, (1, 16))])
def test_a_row_is_held_as_two_blocks_of_powers_of_two(cols, blocks):
    assert fp8_linear.row_blocks(cols) == blocks
    head, tail = blocks
    assert head <= cols <= head + tail  # the first block wholly inside the row, the second covering the rest


def test_a_weight_quantizes_with_one_scale_per_output_channel():
    weight = torch.randn(8, 64) * torch.arange(1, 9)[:, None]
    values, scales = fp8_linear.quantize_weight(weight)
    assert scales.shape == (1, 8)
    torch.testing.assert_close(scales[0], weight.abs().amax(dim=1) / fp8_linear.FP8_MAX)
    assert ((values.float() * scales.T - weight).abs() <= weight.abs() / 16 + 1e-6).all()


def test_an_fp8_product_is_close_to_the_bfloat16_one_and_each_row_its_own():
    torch.manual_seed(1)
    linear = torch.nn.Linear(384, 1536, dtype=torch.bfloat16)
    x = torch.randn(2, 300, 384, dtype=torch.bfloat16)
    quantized = fp8_linear.Fp8Linear.of(linear)
    got, want = quantized(x), F.linear(x, linear.weight, linear.bias)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 0.05
    torch.testing.assert_close(quantized(x[1:]), got[1:], rtol=0, atol=0)  # no neighbour moves a row
    torch.testing.assert_close(quantized(fp8_linear.QuantizedInput.of(x)), got, rtol=0, atol=0)
    gelu = quantized.of_gelu(x)  # GELU's bfloat16 rounding moves some values one FP8 step
    assert ((gelu.float() - quantized(F.gelu(x)).float()).norm() / gelu.float().norm()).item() < 0.03


class _Sdpa:
    """The encoder attention of `attention.SdpaAttention`, without a KV pool."""

    @staticmethod
    def encoder_attention(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def test_a_quantized_encoder_layer_computes_what_its_separate_steps_do():
    torch.manual_seed(3)
    layer = EncoderLayer(384, 6).to(torch.bfloat16)
    for norm in (layer.self_attn_layer_norm, layer.final_layer_norm):  # not the identity of a fresh LayerNorm
        torch.nn.init.normal_(norm.weight, 1.0, 0.2), torch.nn.init.normal_(norm.bias, 0.0, 0.2)
    layer.self_attn.quantize_fp8()
    layer.fc1, layer.fc2 = fp8_linear.Fp8Linear.of(layer.fc1), fp8_linear.Fp8Linear.of(layer.fc2)
    x = torch.randn(2, 150, 384, dtype=torch.bfloat16)

    q, k, v = layer.self_attn.qkv(layer.self_attn_layer_norm(x), 6)
    after_attention = x + layer.self_attn.out_proj(_Sdpa.encoder_attention(q, k, v).flatten(-2))
    branch = layer.fc2.of_gelu(layer.fc1(layer.final_layer_norm(after_attention)))
    got, got_branch = layer(x, None, _Sdpa())
    torch.testing.assert_close(got, after_attention, rtol=0, atol=0)
    torch.testing.assert_close(got_branch, branch, rtol=0, atol=0)
    # The next layer adds that branch in its first norm: its input is the layer's output.
    then, _ = layer(got, got_branch, _Sdpa())
    torch.testing.assert_close(then, layer(after_attention + branch, None, _Sdpa())[0], rtol=0, atol=0)


def test_the_quantized_encoder_adds_each_layers_fc2_in_the_next_layers_norm_and_the_last_before_its_own():
    """The encoder's layers hand each fc2 output on unadded; the whole pass must still be
    the layers applied one after the other, each output summed (the last one too)."""
    checkpoint = load_checkpoint("random:tiny:0")
    with torch.device("meta"):
        model = Whisper(checkpoint.config.dims)
    model.load_state_dict({k: v for k, v in checkpoint.state_dict.items() if k != "proj_out.weight"}, assign=True)
    model = model.to(torch.bfloat16)
    model.quantize_fp8(keep_encoder_layers=frozenset({2}))  # a float layer among them takes the sum too
    encoder = model.encoder
    mel = torch.randn(1, checkpoint.config.dims.n_mels, 3000, dtype=torch.bfloat16)

    x = F.gelu(encoder.conv1(mel))
    x = (F.gelu(encoder.conv2(x)).transpose(1, 2) + encoder.embed_positions.weight).contiguous()
    for layer in encoder.layers:
        if isinstance(layer.fc2, fp8_linear.Fp8Linear):
            _, normed = fp8_linear.norm_quantize(x, layer.self_attn_layer_norm)
            q, k, v = layer.self_attn.qkv(normed, layer.n_heads)
            attended = layer.self_attn.out_proj(_Sdpa.encoder_attention(q, k, v).flatten(-2))
            x, normed = fp8_linear.norm_quantize(x, layer.final_layer_norm, attended)
            x = x + layer.fc2.of_gelu(layer.fc1(normed))
        else:
            q, k, v = layer.self_attn.qkv(layer.self_attn_layer_norm(x), layer.n_heads)
            x = x + layer.self_attn.out_proj(_Sdpa.encoder_attention(q, k, v).flatten(-2))
            x = x + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(x))))
    torch.testing.assert_close(model.encode(mel, _Sdpa()), encoder.layer_norm(x), rtol=0, atol=0)


def test_norm_quantize_adds_the_residual_then_quantizes_the_layer_norm():
    torch.manual_seed(4)
    norm = torch.nn.LayerNorm(384, dtype=torch.bfloat16)
    x, residual = torch.randn(2, 7, 384, dtype=torch.bfloat16), torch.randn(2, 7, 384, dtype=torch.bfloat16)
    total, quantized = fp8_linear.norm_quantize(x, norm, residual)
    torch.testing.assert_close(total, x + residual, rtol=0, atol=0)
    values, scales = fp8_linear.quantize_rows_reference(norm(x + residual).reshape(14, 384))
    assert quantized.shape == x.shape
    assert torch.equal(quantized.values.float(), values.float()) and torch.equal(quantized.scales, scales)
    alone, quantized = fp8_linear.norm_quantize(x, norm)
    assert alone is x and torch.equal(quantized.values.float(), fp8_linear.quantize_rows_reference(
        norm(x).reshape(14, 384))[0].float())


def test_the_model_quantizes_the_products_over_the_encoders_positions_only():
    checkpoint = load_checkpoint("random:tiny:0")
    with torch.device("meta"):
        model = Whisper(checkpoint.config.dims)
    model.load_state_dict({k: v for k, v in checkpoint.state_dict.items() if k != "proj_out.weight"}, assign=True)
    model = model.to(torch.bfloat16)
    model.quantize_fp8()
    fp8 = fp8_linear.Fp8Linear
    for layer in model.encoder.layers:
        assert isinstance(layer.self_attn.fp8_qkv, fp8) and isinstance(layer.self_attn.out_proj, fp8)
        assert isinstance(layer.fc1, fp8) and isinstance(layer.fc2, fp8)
    for layer in model.decoder.layers:
        assert isinstance(layer.encoder_attn.k_proj, fp8) and isinstance(layer.encoder_attn.v_proj, fp8)
        per_token = [layer.self_attn.q_proj, layer.self_attn.out_proj, layer.encoder_attn.q_proj,
                     layer.encoder_attn.out_proj, layer.fc1, layer.fc2]
        assert all(type(p) is torch.nn.Linear for p in per_token)  # the decoder's own products stay bfloat16


@pytest.mark.parametrize(
    ("device", "dtype", "message"),
    [("cpu", torch.bfloat16, "fp8 quantization runs on a CUDA GPU, not on cpu"),
     ("cuda", torch.float16, "fp8 quantization keeps the rest of the model in bfloat16, not torch.float16")],
)  # fmt: skip
def test_the_engine_refuses_fp8_where_it_cannot_run(device, dtype, message):
    checkpoint = load_checkpoint("random:tiny:0")
    with pytest.raises(ValueError, match=re.escape(message)):
        Whisper.from_checkpoint(checkpoint, device=torch.device(device), dtype=dtype, quantization=Quantization.FP8)


def test_fp8_runs_the_model_in_bfloat16_on_a_gpu():
    assert default_dtype(torch.device("cuda"), Quantization.FP8) == torch.bfloat16
    assert default_dtype(torch.device("cuda")) == torch.float16
    assert default_dtype(CPU, Quantization.FP8) == torch.float32  # and the engine refuses it there
    assert device_problem(Quantization.FP8, "cpu") == "fp8 quantization runs on a CUDA GPU only, not on cpu"
    assert device_problem(Quantization.FP8, "cuda:0") is None


def test_serve_refuses_fp8_on_the_cpu_in_one_line(tmp_path):
    repository = packaged_model_repository()
    expected = ("--quantize fp8 runs on a GPU with FP8 tensor cores only, and this server would run its whisper "
                "engines on the CPU")  # fmt: skip
    assert preflight.quantization_problem(Quantization.FP8, repository, gpus=0) == expected
    assert preflight.quantization_problem(Quantization.FP8, repository, gpus=2) is None
    on_cpu = tmp_path / "repository"
    shutil.copytree(repository, on_cpu, ignore=shutil.ignore_patterns("__pycache__"))
    whisper = on_cpu / "whisper" / "config.pbtxt"
    whisper.write_text(whisper.read_text().replace("kind: KIND_AUTO", "kind: KIND_CPU"))
    assert preflight.quantization_problem(Quantization.FP8, on_cpu, gpus=2) == expected


def test_the_accuracy_bench_sets_each_systems_kernels_and_puts_the_shipped_ones_back():
    from bench import fp8_accuracy

    assert {name: system.gelu for name, system in fp8_accuracy.SYSTEMS.items() if system.gelu} == {
        "fp8, libdevice's erf": "LIBDEVICE_ERF", "fp8, polynomial erf": "POLYNOMIAL_ERF", "fp8, tanh GELU": "TANH",
        "fp8, tanh by the GPU's approximation": "TANH_APPROX", "fp8, tanh GELU as a sigmoid": "SIGMOID",
        "fp8, tanh GELU as a sigmoid, fast division": "SIGMOID_FAST_DIVIDE"}
    shipped = fp8_linear.GeluForm.TANH
    assert fp8_linear.GELU is shipped
    with fp8_accuracy.kernels_of("fp8, libdevice's erf"):
        assert fp8_linear.GELU is fp8_linear.GeluForm.LIBDEVICE_ERF
    with fp8_accuracy.kernels_of("fp8, polynomial erf"):
        assert fp8_linear.GELU is fp8_linear.GeluForm.POLYNOMIAL_ERF
    with fp8_accuracy.kernels_of("fp8, tanh GELU"):
        assert fp8_linear.GELU is fp8_linear.GeluForm.TANH
    with fp8_accuracy.kernels_of("fp8"):
        assert fp8_linear.GELU is shipped and not fp8_linear.fast_accumulation(384)
    with fp8_accuracy.kernels_of("fp8, fast accumulation"):
        assert fp8_linear.GELU is shipped
        assert fp8_linear.fast_accumulation(1280) and not fp8_linear.fast_accumulation(5120)
    assert fp8_linear.GELU is shipped and not fp8_linear.fast_accumulation(1280)


@pytest.mark.parametrize("form", list(fp8_linear.GeluForm))
def test_each_gelu_form_of_the_quantization_kernel_is_the_gelu_it_names(form):
    """`_gelu` in Triton's interpreter, in float32 (compiled, and quantized, in
    tests/gpu/test_gpu_fp8.py): the erf forms F.gelu's, the tanh form
    F.gelu(approximate="tanh")'s; 0 stays 0 (the padding rows), large inputs finite."""
    if fp8_linear.triton is None:
        pytest.skip("Triton is not installed")
    if form.ptx:
        pytest.skip("a PTX instruction, which Triton's interpreter cannot run: tests/gpu/test_gpu_fp8.py compiles it")
    import triton
    import triton.language as tl

    @triton.jit
    def gelu_kernel(x_ptr, out_ptr, n, FORM: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offsets, mask=offsets < n)
        tl.store(out_ptr + offsets, fp8_linear._gelu(x, FORM), mask=offsets < n)

    x = torch.cat([torch.linspace(-12, 12, 4001), torch.tensor([0.0, -100.0, 100.0, -1e4, 1e4])])
    out = torch.empty_like(x)
    gelu_kernel[(triton.cdiv(len(x), 1024),)](x, out, len(x), FORM=int(form), BLOCK=1024)
    wanted = F.gelu(x.double(), approximate="tanh" if form.tanh_form else "none")
    assert torch.isfinite(out).all() and out[-5] == 0
    # GELU is x/2 (1 + erf or tanh): an error e in those is x/2 e in GELU, plus float32's
    # rounding of the output. erf's polynomial is within 1.5e-7, float32's own step 1.2e-7.
    error = (out.double() - wanted).abs() - 2.4e-7 * wanted.abs()
    assert (error <= 3e-7 * x.double().abs() / 2).all()


def test_the_accuracy_bench_emulates_fp8_on_the_cpu_only_inside_its_context():
    """`bench.fp8_accuracy --device cpu` loads an FP8 model on the CPU; outside its
    context the library refuses it there again (the server never emulates)."""
    from bench import fp8_accuracy

    checkpoint, cpu = load_checkpoint("random:tiny:0"), torch.device("cpu")
    with fp8_accuracy.fp8_emulated_on("cpu"):
        model = Whisper.from_checkpoint(checkpoint, device=cpu, dtype=torch.bfloat16, quantization=Quantization.FP8)
        assert isinstance(model.encoder.layers[0].fc2, fp8_linear.Fp8Linear)
        assert device_problem(Quantization.FP8, "cpu") is None
    assert device_problem(Quantization.FP8, "cpu") is not None
    with pytest.raises(ValueError, match="CUDA GPU"):
        Whisper.from_checkpoint(checkpoint, device=cpu, dtype=torch.bfloat16, quantization=Quantization.FP8)
