"""int8 on the CPU (`whisper-triton serve --quantize int8`): close to float32, which stays
the exact default, and refused where it cannot run, naming the problem."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import launch_server
from reference import clips, normalize, word_error_rate
from torch import nn

from clients.api import Protocol, WhisperClient
from python_backend_lib.apps import preflight, triton_environment, triton_installation
from python_backend_lib.apps.server import ServerSettings, TritonServer, packaged_model_repository
from python_backend_lib.apps.triton_installation import ServerError
from python_backend_lib.checkpoints.weights import load_checkpoint
from python_backend_lib.core.quantization import Quantization
from python_backend_lib.engine import cpu_int8
from python_backend_lib.engine.model import Whisper
from python_backend_lib.serving.settings import QUANTIZE_ENV, ModelSettings
from python_backend_lib.serving.whisper_pipeline import load_pipeline
from whisper_triton.cli import build_parser

# A few clips, 80 words in all: a speech, read prose and spoken card names.
CLIPS = {c.file: c for c in clips()}
SERVED_CLIPS = [CLIPS[name] for name in (
    "jfk.wav", "sense_and_sensibility_01_austen_64kb-0870.wav", "sense_and_sensibility_01_austen_64kb-0880.wav",
    "sense_and_sensibility_01_austen_64kb-0920.wav", "cards_005.wav",
)]  # fmt: skip
# How much worse int8's word error rate may be than float32's on them: two words.
WER_MARGIN = 2 / sum(len(normalize(c.transcript)) for c in SERVED_CLIPS)


def triton_config(**parameters: str) -> str:
    return json.dumps({"name": "whisper", "max_batch_size": 64,
                       "parameters": {k: {"string_value": v} for k, v in parameters.items()}})  # fmt: skip


# ----------------------------------------------------------------- the option


def test_quantize_is_read_from_the_config_then_the_environment():
    assert ModelSettings.from_triton(triton_config(), environ={}).quantization is Quantization.NONE
    assert ModelSettings.from_triton(triton_config(quantize="int8"), environ={}).quantization is Quantization.INT8
    overridden = ModelSettings.from_triton(triton_config(quantize="int8"), environ={QUANTIZE_ENV: "none"})
    assert overridden.quantization is Quantization.NONE


@pytest.mark.parametrize(
    ("config", "environ", "source"),
    [(triton_config(quantize="int4"), {}, "config parameter 'quantize'"),
     (triton_config(), {QUANTIZE_ENV: "int4"}, f"environment variable {QUANTIZE_ENV}")],
)  # fmt: skip
def test_a_bad_quantize_value_is_refused_naming_where_it_was_set(config, environ, source):
    message = f"model 'whisper': {source} must be 'auto' or one of ['fp8', 'int8', 'none'], got 'int4'"
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelSettings.from_triton(config, environ=environ)


def test_int8_on_a_gpu_instance_is_refused_before_anything_loads():
    settings = ModelSettings.from_triton(triton_config(quantize="int8"), environ={})
    expected = ("model 'whisper': int8 quantization runs on the CPU only, not on cuda:1; serve it on the CPU "
                "(`whisper-triton serve --gpus none`, or kind: KIND_CPU in its config.pbtxt), or set quantize to none")  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(expected)):
        load_pipeline(settings, device="cuda:1")


@pytest.fixture(scope="module")
def checkpoint():
    return load_checkpoint("default")


@pytest.mark.parametrize(
    ("device", "dtype", "message"),
    [("cuda", torch.float16, "int8 quantization runs on the CPU only, not on cuda"),
     ("cpu", torch.bfloat16, "int8 quantization keeps the rest of the model in float32, not torch.bfloat16")],
)  # fmt: skip
def test_the_engine_refuses_int8_where_it_cannot_run(checkpoint, device, dtype, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Whisper.from_checkpoint(checkpoint, device=torch.device(device), dtype=dtype, quantization=Quantization.INT8)


def test_serve_refuses_int8_on_gpus_in_one_line(tmp_path):
    repository = packaged_model_repository()
    expected = "--quantize int8 runs on the CPU only, and this server would run its whisper engines on 2 GPUs: " \
               "add --gpus none to serve on the CPU"  # fmt: skip
    assert preflight.quantization_problem(Quantization.INT8, repository, gpus=2) == expected
    assert preflight.quantization_problem(Quantization.INT8, repository, gpus=0) is None
    assert preflight.quantization_problem(Quantization.NONE, repository, gpus=2) is None
    on_cpu = tmp_path / "repository"
    shutil.copytree(repository, on_cpu, ignore=shutil.ignore_patterns("__pycache__"))
    whisper = on_cpu / "whisper" / "config.pbtxt"
    whisper.write_text(whisper.read_text().replace("kind: KIND_AUTO", "kind: KIND_CPU"))
    assert preflight.quantization_problem(Quantization.INT8, on_cpu, gpus=2) is None  # its owner put it there
    settings = ServerSettings(model_repository=repository, gpus="0", quantization=Quantization.INT8)
    with pytest.raises(ServerError, match="runs on the CPU only"):
        TritonServer(settings).start()


def test_serve_passes_quantize_to_the_models_and_refuses_an_unknown_value(tmp_path, monkeypatch):
    monkeypatch.delenv(QUANTIZE_ENV, raising=False)
    installation = triton_installation.TritonInstallation(binary=tmp_path / "tritonserver", backend_directory=tmp_path)
    for flags, expected in (([], None), (["--quantize", "int8"], "int8"), (["--quantize", "none"], "none")):
        args = build_parser().parse_args(["serve", *flags])
        settings = ServerSettings(model_repository=tmp_path, quantization=args.quantize)
        assert triton_environment.server_environment(installation, settings).get(QUANTIZE_ENV) == expected
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantize", "int4"])


# ----------------------------------------------------------------- the engine


# int8's products differ from float32's by a few percent of the result's size (its
# 7-bit inputs, its 8-bit weights per row); a wrong scale or layout would be off by
# about the size of the result itself.
RELATIVE_ERROR = 0.05


def test_an_int8_layer_is_close_to_its_float32_product(checkpoint):
    """Real layers of tiny.en, on inputs of a layer's scale."""
    torch.manual_seed(0)
    for name in ("encoder.layers.0.fc1", "decoder.layers.3.fc2", "decoder.layers.1.self_attn.k_proj"):
        weight = checkpoint.state_dict[f"{name}.weight"]
        bias = checkpoint.state_dict.get(f"{name}.bias")
        x = torch.randn(64, weight.shape[1])
        expected = F.linear(x, weight, bias)
        got = cpu_int8.int8_linear(x, cpu_int8.pack(weight, bias))
        assert got.dtype == torch.float32 and got.shape == expected.shape
        assert (got - expected).norm() / expected.norm() < RELATIVE_ERROR, name


def test_every_linear_layer_and_the_output_projection_run_in_int8(checkpoint):
    model = Whisper.from_checkpoint(checkpoint, device=torch.device("cpu"), dtype=torch.float32,
                                    quantization=Quantization.INT8)  # fmt: skip
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    dims = checkpoint.config.dims
    # Per encoder layer q, k, v, out, fc1, fc2; per decoder layer those and the cross attention's four.
    assert sum(isinstance(m, cpu_int8.Int8Linear) for m in model.modules()) == 6 * dims.n_audio_layer + 10 * dims.n_text_layer
    hidden = torch.randn(3, dims.n_text_state)
    expected = hidden @ checkpoint.state_dict["decoder.embed_tokens.weight"].T
    logits = model.logits(hidden)
    assert logits.dtype == torch.float32 and (logits - expected).norm() / expected.norm() < RELATIVE_ERROR


# ----------------------------------------------------------------- served


@pytest.fixture(scope="module")
def int8_server(tmp_path_factory):
    with launch_server(tmp_path_factory.mktemp("int8-server"), arguments=("--quantize", "int8")) as launched:
        yield launched.server


def served_wer(url: str) -> tuple[float, dict[str, str]]:
    """The word error rate over SERVED_CLIPS and each clip's text. The clips are sent one
    after another: int8's words depend on which recordings share its batch (each product
    quantizes the whole batch's input with one scale), and alone they are always the same."""
    client = WhisperClient(url, Protocol.GRPC)
    texts = {clip.file: client.transcribe(clip.read()).text for clip in SERVED_CLIPS}
    errors = words = 0
    for clip in SERVED_CLIPS:
        reference = normalize(clip.transcript)
        errors += word_error_rate(normalize(texts[clip.file]), reference) * len(reference)
        words += len(reference)
    return errors / words, texts


@pytest.mark.server
def test_the_int8_server_transcribes_as_well_as_float32(int8_server, server):
    """The same clips through the float32 session server and one started with --quantize int8."""
    float32_wer, float32_texts = served_wer(server.grpc_url)
    int8_wer, int8_texts = served_wer(int8_server.grpc_url)
    assert int8_wer <= float32_wer + WER_MARGIN, (int8_wer, float32_wer, int8_texts, float32_texts)
    log = int8_server.log.read_text()
    # Both engines, the whisper model's and the streamed path's, said how they multiply.
    assert len(re.findall(r"with sdpa, int8 quantization", log)) == 2, log
    assert "with sdpa, none quantization" in server.log.read_text()  # the default: exact float32
