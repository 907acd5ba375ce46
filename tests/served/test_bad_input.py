"""Garbage in, a clear error out: bad requests through the real server, over HTTP and gRPC.

Each bad request gets its own INVALID_ARG (HTTP 400) whose message names the
problem; odd but valid audio (other rates, stereo, 24-bit, float, silence, a
tenth of a second) is transcribed; well-formed requests sent in the same burst
succeed, and the server stays ready. `test_server.py` covers an unknown
parameter, a value of the wrong type and bytes that are not audio.
"""

from __future__ import annotations

import io
import queue
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pytest
import soundfile
import soxr
import tritonclient.grpc
import tritonclient.http
from conftest import AUDIO_DIR, RunningServer
from tritonclient.utils import InferenceServerException
from whisper_calls import library_log_mel, whisper_inputs

from clients.api import Decoded, LogMel, TranscriptionError, WhisperClient
from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.contract import tensor_names
from python_backend_lib.core.options import MAX_PROMPT_TOKENS

pytestmark = pytest.mark.server

PROTOCOLS = ("http", "grpc")
TRITON = {"http": tritonclient.http, "grpc": tritonclient.grpc}
INVALID_ARG = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}
JFK, JFK_RATE = soundfile.read(AUDIO_DIR / "jfk.wav", dtype="float32")
REQUEST_TIMEOUT_S = 120


def wav(samples: np.ndarray, rate: int = JFK_RATE, subtype: str = "PCM_16", fmt: str = "WAV") -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def with_data_size(data: bytes, size: int) -> bytes:
    """A WAV whose data chunk declares `size` bytes, whatever follows."""
    damaged = bytearray(data)
    at = damaged.index(b"data") + 4
    damaged[at : at + 4] = size.to_bytes(4, "little")
    return bytes(damaged)


@dataclass(frozen=True)
class Request:
    audio: bytes | np.ndarray
    parameters: dict = field(default_factory=dict)
    datatype: str = "BYTES"
    model: str = tensor_names.ENSEMBLE_NAME


def send(server: RunningServer, protocol: str, request: Request):
    """TEXT of the reply, or the InferenceServerException."""
    triton = TRITON[protocol]
    client = triton.InferenceServerClient(server.url(protocol))
    array = request.audio if isinstance(request.audio, np.ndarray) else np.array([[request.audio]], dtype=np.object_)
    tensor = triton.InferInput(tensor_names.AUDIO, list(array.shape), request.datatype)
    tensor.set_data_from_numpy(array)
    try:
        reply = client.infer(request.model, [tensor], parameters=request.parameters)
    except InferenceServerException as error:
        return error
    return reply.as_numpy(tensor_names.TEXT).reshape(-1)[0].decode("utf-8")


def limit_seconds(server: RunningServer) -> float:
    """The served preprocessing model's max_audio_seconds, from Triton's own view of its config."""
    config = tritonclient.http.InferenceServerClient(server.http_url).get_model_config(tensor_names.PREPROCESSING_NAME)
    return float(config["parameters"]["max_audio_seconds"]["string_value"])


def too_long_wav(seconds: float) -> bytes:
    """Silence longer than `seconds`, as small as a WAV gets: 8-bit samples at 1 kHz."""
    return wav(np.zeros(int((seconds + 1) * 1000), np.float32), rate=1000, subtype="PCM_U8")


JFK_WAV = wav(JFK)
LONG_PROMPT = " ".join(["word"] * (MAX_PROMPT_TOKENS + 50))

# id -> (request, what the error message must contain)
BAD = {
    "empty": (Request(b""), "audio is empty"),
    "not-audio": (Request(b"GIF89a" + bytes(range(256)) * 8), "not a decodable audio file"),
    "truncated-wav": (Request(JFK_WAV[: len(JFK_WAV) // 2]), "WAV file is truncated"),
    "truncated-flac": (Request(wav(JFK, fmt="FLAC")[:20_000]), "damaged or truncated"),
    "lying-header": (
        Request(with_data_size(JFK_WAV, 0x40000000)),
        "data chunk declares 1073741824 bytes of samples, only 352000 follow",
    ),
    "nan": (Request(wav(np.where(np.arange(JFK.size) % 1000 == 7, np.nan, JFK), subtype="FLOAT")), "NaN or infinite"),
    "inf": (Request(wav(np.where(np.arange(JFK.size) == 99, np.inf, JFK), subtype="FLOAT")), "NaN or infinite"),
    "wrong-dtype": (Request(np.array([[1, 2, 3]], dtype=np.int32), datatype="INT32"), "data-type is 'INT32', but model 'transcribe' expects 'BYTES'"),
    "two-clips": (Request(np.array([[JFK_WAV], [JFK_WAV]], dtype=np.object_)), "AUDIO must hold exactly one clip"),
    "wrong-shape": (Request(np.array([[JFK_WAV, JFK_WAV]], dtype=np.object_)), "unexpected shape for input 'AUDIO'"),
    "unknown-language": (Request(JFK_WAV, {"language": "zz"}), "'zz'"),
    "prompt-too-long": (Request(JFK_WAV, {"prompt": LONG_PROMPT}), f"the model allows at most {MAX_PROMPT_TOKENS}"),
    # Each fallback temperature is a whole decode: 1,001 of them held the engine for minutes, and on after the client left.
    "fallback-ladder-too-long": (Request(JFK_WAV, {"temperature_increment": 0.001}), "at most 11 are allowed"),
    "pcm-ragged": (
        Request(b"\0" * 7, {"input_format": "pcm_f32le", "sample_rate": 16000}),
        "raw PCM is 7 bytes, not a multiple of 4",
    ),
}


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", BAD)
def test_a_bad_request_is_refused_naming_the_problem(server, protocol, case):
    request, message = BAD[case]
    outcome = send(server, protocol, request)
    assert isinstance(outcome, InferenceServerException), f"{case} was answered: {outcome!r}"
    assert message in outcome.message(), outcome.message()
    assert "Traceback" not in outcome.message()
    assert outcome.status() == INVALID_ARG[protocol]
    assert TRITON[protocol].InferenceServerClient(server.url(protocol)).is_server_ready()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_audio_above_the_configured_maximum_names_the_limit(server, protocol):
    limit = limit_seconds(server)
    outcome = send(server, protocol, Request(too_long_wav(limit)))
    assert isinstance(outcome, InferenceServerException)
    assert f"audio is {limit + 1:.1f} s long; the limit is {limit:g} s" in outcome.message()
    assert outcome.status() == INVALID_ARG[protocol]


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z' ]", " ", text.lower()).split()


def word_errors(text: str, reference: str) -> int:
    """Edit distance in words."""
    a, b = words(text), words(reference)
    row = list(range(len(b) + 1))
    for i, word in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, other in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (word != other))
    return row[-1]


# id -> (the file, word errors allowed against the 16 kHz transcript)
ODD_BUT_VALID = {
    "44.1khz": (wav(soxr.resample(JFK, JFK_RATE, 44_100), rate=44_100), 0),
    "8khz": (wav(soxr.resample(JFK, JFK_RATE, 8_000), rate=8_000), 1),  # telephone band: "America" for "Americans"
    "stereo": (wav(np.stack([JFK, 0.5 * JFK], axis=1)), 0),
    "24-bit": (wav(JFK, subtype="PCM_24"), 0),
    "float": (wav(JFK, subtype="FLOAT"), 0),
}


@pytest.fixture(scope="module")
def jfk_transcript(server):
    """The 16 kHz mono WAV's transcript, by protocol, sent once each."""
    transcripts = {}

    def transcript(protocol: str) -> str:
        if protocol not in transcripts:
            transcripts[protocol] = send(server, protocol, Request(JFK_WAV))
        return transcripts[protocol]

    return transcript


@pytest.mark.slow
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("case", ODD_BUT_VALID)
def test_other_rates_channels_and_sample_formats_are_transcribed(server, jfk_transcript, protocol, case):
    data, allowed = ODD_BUT_VALID[case]
    reference = jfk_transcript(protocol)
    text = send(server, protocol, Request(data))
    assert isinstance(text, str), text
    assert word_errors(text, reference) <= allowed, (text, reference)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_silence_is_an_empty_transcript_not_an_error(server, protocol):
    assert send(server, protocol, Request(wav(np.zeros(3 * JFK_RATE, np.float32)))) == ""


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_tenth_of_a_second_is_transcribed(server, protocol):
    assert isinstance(send(server, protocol, Request(wav(JFK[: JFK_RATE // 10]))), str)


@pytest.mark.slow
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_bad_requests_fail_alone_among_good_ones_sent_at_once(server, protocol):
    """Every bad request of BAD and six good ones, all in flight together, so that
    the models' batches mix them: each bad one gets its own error, each good one
    the transcript it gets alone."""
    reference = send(server, protocol, Request(JFK_WAV))
    jobs = [(case, *BAD[case]) for case in BAD] + [(f"good-{i}", Request(JFK_WAV), None) for i in range(6)]
    outcomes: queue.Queue = queue.Queue()
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        for case, request, message in jobs:
            pool.submit(lambda *job: outcomes.put((job, send(server, protocol, job[1]))), case, request, message)
    assert outcomes.qsize() == len(jobs)  # nothing lost
    while not outcomes.empty():
        (case, _, message), outcome = outcomes.get()
        if message is None:
            assert outcome == reference, case
        else:
            assert isinstance(outcome, InferenceServerException) and message in outcome.message(), (case, outcome)
    assert TRITON[protocol].InferenceServerClient(server.url(protocol)).is_server_ready()


JFK_LOG_MEL = library_log_mel(decode_audio(JFK_WAV))


@pytest.mark.parametrize(
    ("log_mel", "message"),
    [
        (LogMel(np.full((80, 100), np.nan, np.float32), 16000), "LOG_MEL contains NaN or infinite values"),
        (LogMel(np.zeros((80, 100), np.float32), 0), "SAMPLES must be at least 1, got 0"),
        (LogMel(np.zeros((128, 100), np.float32), 16000), r"LOG_MEL must be float32 [80, frames] with 1 to 3000 frames"),
        (LogMel(np.zeros((80, 4000), np.float32), 16000), "got float32 [80, 4000]"),
    ],
    ids=["nan", "no-samples", "bins", "frames"],
)
def test_the_whisper_model_checks_what_it_is_sent_directly(server, log_mel, message):
    client = tritonclient.grpc.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as caught:
        client.infer(tensor_names.WHISPER_NAME, whisper_inputs(tritonclient.grpc, log_mel), client_timeout=REQUEST_TIMEOUT_S)
    assert message in caught.value.message()
    assert caught.value.status() == INVALID_ARG["grpc"]


def test_the_postprocessing_model_checks_what_it_is_sent_directly(server):
    """Its inputs must hold together: a client's own tensors that do not are refused, naming them."""
    client = WhisperClient(server.grpc_url, "grpc")
    decoded = client.decode(JFK_LOG_MEL)
    assert client.postprocess(decoded).text == send(server, "grpc", Request(JFK_WAV))
    short = dict(decoded.arrays)
    short[tensor_names.TOKENS] = short[tensor_names.TOKENS][:-1]
    with pytest.raises(TranscriptionError, match=r"WINDOWS counts \d+ tokens and 0 alignment rows, but TOKENS has"):
        client.postprocess(Decoded(short, decoded.samples))
    with pytest.raises(TranscriptionError, match="SAMPLES must be at least 1"):
        client.postprocess(Decoded(decoded.arrays, 0))
