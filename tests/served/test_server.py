"""The served path, end to end: `whisper-triton serve` answers exactly as the library does."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc
import tritonclient.http
from conftest import AUDIO_DIR, RunningServer, _stop, launch_server, whisper_triton_command
from tritonclient.utils import InferenceServerException

from clients.api import TranscriptionError, TranscriptionResult, WhisperClient
from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.contract import tensor_names
from python_backend_lib.core.options import DecodingOptions
from python_backend_lib.text.formats import TimedText

# loadtest/ is a folder of the checkout, not part of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from whisper_calls import library_log_mel

from loadtest.processes import stub_processes

pytestmark = pytest.mark.server

PROTOCOLS = ("http", "grpc")
CLIPS = sorted(AUDIO_DIR.glob("*.wav"))
JFK = AUDIO_DIR / "jfk.wav"
JFK_TEXT = "And so my fellow Americans, ask not what your country can do for you, ask what you can do for your country."
TRITON = {"http": tritonclient.http, "grpc": tritonclient.grpc}
MODELS = (
    tensor_names.PREPROCESSING_NAME,
    tensor_names.WHISPER_NAME,
    tensor_names.POSTPROCESSING_NAME,
    tensor_names.ENSEMBLE_NAME,
)


@pytest.fixture(scope="session")
def pipeline():
    from python_backend_lib.transcription.pipeline import Pipeline

    pipe = Pipeline.load("default")
    yield pipe
    pipe.close()


@pytest.fixture(scope="session")
def expected(pipeline):
    """The library's own transcript of a clip."""
    cache: dict[tuple[Path, bool], TranscriptionResult] = {}

    def transcript(clip: Path, timestamps: bool) -> TranscriptionResult:
        if (clip, timestamps) not in cache:
            result = pipeline.transcribe(clip.read_bytes(), DecodingOptions(timestamps=timestamps))
            segments = tuple(TimedText(start=s.start, end=s.end, text=s.text) for s in result.segments)
            cache[clip, timestamps] = TranscriptionResult(text=result.text, segments=segments)
        return cache[clip, timestamps]

    return transcript


def raw_client(server: RunningServer, protocol: str):
    return TRITON[protocol].InferenceServerClient(server.url(protocol))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_server_and_models_are_ready(server, protocol):
    client = raw_client(server, protocol)
    assert client.is_server_live() and client.is_server_ready()
    for model in MODELS:
        assert client.is_model_ready(model), model


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_transcribe_metadata(server, protocol):
    metadata = raw_client(server, protocol).get_model_metadata(tensor_names.ENSEMBLE_NAME)
    if protocol == "grpc":
        from google.protobuf.json_format import MessageToDict

        metadata = MessageToDict(metadata, preserving_proto_field_name=True)
    tensors = {(t["name"], t["datatype"], tuple(int(d) for d in t["shape"])) for t in metadata["inputs"]}
    assert tensors == {(tensor_names.AUDIO, "BYTES", (-1, 1))}
    tensors = {(t["name"], t["datatype"], tuple(int(d) for d in t["shape"])) for t in metadata["outputs"]}
    outputs = (tensor_names.TEXT, tensor_names.SEGMENTS, tensor_names.FORMATTED)
    assert tensors == {(name, "BYTES", (-1, 1)) for name in outputs}


# Every clip in both formats, each pair through one protocol, the two alternating, so that
# each protocol carries every format and half the clips in each: what a protocol changes
# (how the audio and the answer travel) does not depend on what the clip says, and each
# decode costs the server as much as the library's reference does.
SERVED_CASES = [
    pytest.param(clip, PROTOCOLS[(index + timestamps) % 2], timestamps,
                 id=f"{clip.name}-{PROTOCOLS[(index + timestamps) % 2]}-{'timestamps' if timestamps else 'text'}")
    for index, clip in enumerate(CLIPS) for timestamps in (False, True)
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("clip, protocol, timestamps", SERVED_CASES)
def test_served_transcript_equals_the_library(server, expected, clip, protocol, timestamps):
    with WhisperClient(server.url(protocol), protocol) as client:
        result = client.transcribe(clip, timestamps=timestamps)
    assert result == expected(clip, timestamps)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    "parameters",
    [{"response_format": "verbose_json"}, {"response_format": "srt", "word_timestamps": True},
     {"response_format": "vtt", "long_form": "batched", "timestamps": False}],
    ids=["verbose_json", "srt-words", "vtt-batched"],
)
def test_the_three_models_called_in_turn_answer_as_the_ensemble(server, protocol, parameters):
    """preprocessing, whisper and postprocessing, each called on its own with the
    answer of the one before, give exactly what `transcribe` gives; and whisper takes
    a log-mel the client computed itself with the library."""
    clip = AUDIO_DIR / "sonnet1_longform.wav" if "long_form" in parameters else JFK
    with WhisperClient(server.url(protocol), protocol) as client:
        ensemble = client.outputs(clip, **parameters)
        log_mel = client.preprocess(clip)
        assert log_mel.log_mel.dtype == np.float32 and log_mel.log_mel.shape[0] == 80
        assert log_mel.samples == len(decode_audio(clip.read_bytes()))
        assert client.postprocess(client.decode(log_mel, **parameters), **parameters) == ensemble
        own = library_log_mel(decode_audio(clip.read_bytes()))
        np.testing.assert_array_equal(own.log_mel, log_mel.log_mel)
        assert client.postprocess(client.decode(own, **parameters), **parameters) == ensemble


@pytest.mark.slow
def test_concurrent_requests_of_mixed_lengths(server, expected):
    jobs = [(CLIPS[i % len(CLIPS)], PROTOCOLS[i % 2], i % 3 == 0) for i in range(16)]

    def run(job):
        clip, protocol, timestamps = job
        with WhisperClient(server.url(protocol), protocol) as client:  # one client per thread
            return client.transcribe(clip.read_bytes(), timestamps=timestamps)

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (clip, _, timestamps), result in zip(jobs, results):
        assert result == expected(clip, timestamps), clip.name


@pytest.mark.slow
def test_two_engines_answer_as_the_library_from_a_copy_gone_after_the_stop(tmp_path, expected):
    """`serve --engines 2`: two whisper processes on this device, each its own engine,
    served from a copy of the repository that the launcher removes when it stops."""
    with launch_server(tmp_path, {"TMPDIR": str(tmp_path)}, ("--engines", "2")) as launched:
        (copy,) = tmp_path.glob("whisper-triton-repository-*")
        port = int(launched.server.grpc_url.rsplit(":", 1)[1])
        assert [stub.model for stub in stub_processes(port)].count(tensor_names.WHISPER_NAME) == 2
        jobs = [CLIPS[i % len(CLIPS)] for i in range(12)]

        def run(clip: Path) -> TranscriptionResult:
            with WhisperClient(launched.server.url("grpc"), "grpc") as client:
                return client.transcribe(clip.read_bytes())

        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            results = list(pool.map(run, jobs))
        for clip, result in zip(jobs, results):
            assert result == expected(clip, True), clip.name
        with urllib.request.urlopen(launched.server.metrics_url, timeout=10) as reply:
            metrics = reply.read().decode()
        engines = set(re.findall(r'^whisper_decoding_slots\{.*instance="(\w+)"', metrics, flags=re.M))
        # Each engine its own series; the streamed path keeps its one engine.
        assert engines == {"whisper_0_0", "whisper_0_1", "whisper_stream_0_0"}
        _stop(launched.process, "whisper-triton serve --engines 2", launched.server.log)
    assert not copy.exists()


def test_raw_pcm_equals_the_file(server, expected):
    import soundfile

    samples, sample_rate = soundfile.read(JFK, dtype="float32")
    with WhisperClient(server.http_url) as client:
        result = client.transcribe(
            samples.astype("<f4").tobytes(), input_format="pcm_f32le", sample_rate=sample_rate, timestamps=False
        )
        assert result == expected(JFK, False)
        by_default = client.transcribe(samples.astype("<f4").tobytes(), input_format="pcm_f32le", sample_rate=sample_rate)
    assert by_default == expected(JFK, True)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    ("parameters", "audio", "message"),
    [
        ({"beam_width": 5}, JFK.read_bytes(), "unknown request parameter 'beam_width'"),
        ({"timestamps": "yes"}, JFK.read_bytes(), "'timestamps' must be bool"),
        ({}, b"certainly not audio", "not a decodable audio file"),
    ],
    ids=["unknown-parameter", "wrong-type", "not-audio"],
)
def test_a_bad_request_gets_a_clear_invalid_arg_and_the_server_stays_ready(
    server, expected, protocol, parameters, audio, message
):
    client = raw_client(server, protocol)
    tensor = TRITON[protocol].InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[audio]], dtype=np.object_))
    with pytest.raises(InferenceServerException) as caught:
        client.infer(tensor_names.ENSEMBLE_NAME, [tensor], parameters=parameters)
    assert message in caught.value.message()
    assert "Traceback" not in caught.value.message()
    assert caught.value.status() == ("400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT")
    assert client.is_server_ready()
    with WhisperClient(server.url(protocol), protocol) as whisper:
        assert whisper.transcribe(JFK, timestamps=False) == expected(JFK, False)


def test_client_raises_the_servers_message(server):
    with WhisperClient(server.http_url) as client, pytest.raises(TranscriptionError, match="'beam_width'"):
        client.transcribe(JFK, beam_width=5)


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z' ]", " ", text.lower()).split()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_cli_prints_the_jfk_transcript(server, expected, protocol):
    command = whisper_triton_command() + [
        "transcribe", str(JFK), f"--url={server.url(protocol)}", f"--protocol={protocol}"
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout == expected(JFK, True).text + "\n"  # timestamps on by default, as openai-whisper
    without = subprocess.run(command + ["--no-timestamps"], capture_output=True, text=True, timeout=120)
    assert without.returncode == 0, without.stderr
    assert without.stdout == expected(JFK, False).text + "\n"
    # The packaged tiny.en decoded greedily places its commas differently from the
    # reference (faster-whisper on the same weights agrees with us): compare the words.
    assert words(completed.stdout) == words(JFK_TEXT)


def test_cli_writes_subtitles_with_timestamps(server, tmp_path):
    command = whisper_triton_command() + [
        "transcribe", str(JFK), str(CLIPS[0]), f"--url={server.http_url}", "--format=srt",
        f"--output-dir={tmp_path}",
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    srt = (tmp_path / "jfk.srt").read_text()
    assert srt.startswith("1\n00:00:0")
    assert srt.count(" --> ") >= 2  # timestamps were asked for: more than one segment
    assert (tmp_path / f"{CLIPS[0].stem}.srt").exists()
