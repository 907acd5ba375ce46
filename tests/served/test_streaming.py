"""Streamed results for files, against the real server: Triton's `transcribe_stream`
over gRPC's stream_infer, the client's `stream`, `transcribe --verbose` as a
subprocess, and the gateway's server-sent events through the `openai` client.

The reference is the batch path: the same file through `transcribe`."""

from __future__ import annotations

import dataclasses
import io
import struct
import subprocess
import threading

import grpc
import numpy as np
import openai
import pytest
import soundfile
from conftest import AUDIO_DIR, RunningServer, whisper_triton_command
from tritonclient.grpc import service_pb2, service_pb2_grpc

from clients.api import TranscriptionError, WhisperClient, new_request_id
from clients.streaming import EMPTY_FINAL_RESPONSE, is_final, verbose_line
from python_backend_lib.contract import tensor_names
from python_backend_lib.core.options import LongFormMode
from python_backend_lib.text.formats import Document, segments_from_json

pytestmark = [pytest.mark.server, pytest.mark.slow]

# 53 s read in three windows: long enough that the first window's segments come
# while the rest is still being decoded.
SONNET = AUDIO_DIR / "sonnet1_longform.wav"
JFK = AUDIO_DIR / "jfk.wav"
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def grpc_client(server: RunningServer):
    with WhisperClient(server.grpc_url, "grpc") as client:
        yield client


@pytest.fixture(scope="module")
def sonnet_batch(grpc_client):
    """The sonnet through the batch `transcribe`, in verbose_json: the reference."""
    return grpc_client.outputs(SONNET, response_format="verbose_json")


@pytest.mark.parametrize("mode", list(LongFormMode))
def test_streamed_segments_make_the_batch_transcript(grpc_client, mode):
    options = {"response_format": "verbose_json", "long_form": mode.value}
    batch = grpc_client.outputs(SONNET, **options)
    updates = list(grpc_client.stream(SONNET, **options))
    # The segments, as they came, are the batch transcript's, in order, and the last
    # update is the batch answer itself.
    streamed = [segment for update in updates for segment in update.new_segments]
    assert tuple(streamed) == updates[-1].segments
    assert updates[-1].final and not any(update.final for update in updates[:-1])
    last = updates[-1].outputs
    assert (last.text, last.segments) == (batch.text, batch.segments)
    assert_same_document(Document.from_verbose_json(last.formatted), Document.from_verbose_json(batch.formatted))
    # They came window by window: the first segments before the last one was decoded.
    assert len(updates) >= 2
    assert streamed[-1] not in updates[0].segments and streamed[0] in updates[0].segments


def test_a_window_streams_each_segment_as_the_decoder_ends_it(grpc_client):
    """jfk.wav is one window of two segments: the first comes in a response of its own,
    before the window is decoded, and the last response is the batch answer."""
    batch = grpc_client.outputs(JFK, response_format="verbose_json")
    updates = list(grpc_client.stream(JFK, response_format="verbose_json"))
    assert len(segments_from_json(batch.segments)) == 2
    first, last = updates[0], updates[-1]
    assert not first.final and first.segments == last.segments[:1], [u.segments for u in updates]
    assert last.final and (last.outputs.text, last.outputs.segments) == (batch.text, batch.segments)


def assert_same_document(streamed: Document, batch: Document) -> None:
    """Equal, but for the last bits of each window's probabilities (its log-probability,
    and its no-speech probability: 0.38465434 against 0.38465402 once, on a busy
    machine): batched windows share the engine's batch in varying company, as on the
    batch path run twice."""
    assert len(streamed.segments) == len(batch.segments)
    for ours, theirs in zip(streamed.segments, batch.segments):
        assert ours.avg_logprob == pytest.approx(theirs.avg_logprob, rel=1e-5)
        assert ours.no_speech_prob == pytest.approx(theirs.no_speech_prob, rel=1e-5)
        probabilities = dict(avg_logprob=0.0, no_speech_prob=0.0)
        assert dataclasses.replace(ours, **probabilities) == dataclasses.replace(theirs, **probabilities)
    assert dataclasses.replace(streamed, segments=()) == dataclasses.replace(batch, segments=())


def test_every_format_streams_the_batch_answer(grpc_client):
    for response_format in ("text", "srt", "vtt", "json"):
        *_, last = grpc_client.stream(JFK, response_format=response_format)
        assert last.outputs.formatted == grpc_client.formatted(JFK, response_format)


def _raw_stream(server: RunningServer, audio: bytes, cancel_after_first: bool = False) -> list:
    """Every message of one `transcribe_stream` request on gRPC's stream_infer, through
    tritonclient's own protocol stubs: what any client, in any language, receives
    (tritonclient's stream callback drops an error response's parameters)."""
    request = service_pb2.ModelInferRequest(model_name=tensor_names.STREAM_ENSEMBLE_NAME)
    tensor = request.inputs.add(name=tensor_names.AUDIO, datatype="BYTES")
    tensor.shape.extend([1, 1])
    request.raw_input_contents.append(struct.pack("<I", len(audio)) + audio)
    request.parameters[EMPTY_FINAL_RESPONSE].bool_param = True
    request_id = new_request_id()
    request.parameters["request_id"].string_param = request_id
    stop = threading.Event()

    def requests():
        yield request
        stop.wait(TIMEOUT_S)  # the stream stays open until the last response

    channel = grpc.insecure_channel(server.grpc_url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    messages = []
    try:
        for message in stub.ModelStreamInfer(requests(), timeout=TIMEOUT_S):
            messages.append(message)
            if is_final(message.infer_response.parameters):
                break
            if cancel_after_first:
                with WhisperClient(server.grpc_url, "grpc") as canceller:
                    canceller.cancel(request_id)
                cancel_after_first = False
    finally:
        stop.set()
        channel.close()
    return messages


def test_a_stream_ends_with_the_final_flag(server):
    messages = _raw_stream(server, SONNET.read_bytes())
    assert [is_final(m.infer_response.parameters) for m in messages] == [False] * (len(messages) - 1) + [True]
    assert all(m.error_message == "" for m in messages)


def test_a_stream_ends_with_the_final_flag_after_an_error(server):
    (message,) = _raw_stream(server, b"this is not audio")
    assert "not a decodable audio file" in message.error_message
    assert is_final(message.infer_response.parameters)


def test_a_stream_ends_with_the_final_flag_after_a_cancel(server):
    messages = _raw_stream(server, SONNET.read_bytes(), cancel_after_first=True)
    assert messages[0].error_message == "" and not is_final(messages[0].infer_response.parameters)
    assert "cancelled" in messages[-1].error_message and is_final(messages[-1].infer_response.parameters)


def test_vad_filter_streams_the_batch_answer_on_the_recordings_timeline(grpc_client):
    """Speech between faint noise: streamed with vad_filter, the segments are the batch
    answer's, timed on the whole recording (preprocessing's spans reach postprocessing
    through whisper_stream's responses), not on the speech alone."""
    rng = np.random.default_rng(7)
    noise = [(rng.standard_normal(round(seconds * 16_000)) * 0.003).astype(np.float32) for seconds in (6.0, 9.0, 4.0)]
    jfk, _ = soundfile.read(JFK, dtype="float32")
    forward, _ = soundfile.read(AUDIO_DIR / "goforward.wav", dtype="float32")
    audio = np.concatenate([noise[0], jfk, noise[1], forward, noise[2]])
    data = io.BytesIO()
    soundfile.write(data, audio, 16_000, format="WAV", subtype="PCM_16")
    options = {"response_format": "verbose_json", "vad_filter": True}
    batch = grpc_client.outputs(data.getvalue(), **options)
    updates = list(grpc_client.stream(data.getvalue(), **options))
    assert updates[-1].final
    last = updates[-1].outputs
    assert (last.text, last.segments) == (batch.text, batch.segments)
    assert_same_document(Document.from_verbose_json(last.formatted), Document.from_verbose_json(batch.formatted))
    segments = Document.from_verbose_json(last.formatted).segments
    forward_starts = 6.0 + len(jfk) / 16_000 + 9.0
    assert segments[0].start >= 6.0 - 1.0 and segments[-1].start >= forward_starts - 1.0, segments


def test_the_clients_stream_raises_the_servers_error(grpc_client, server):
    with pytest.raises(TranscriptionError, match="not a decodable audio file"):
        list(grpc_client.stream(b"this is not audio"))
    with WhisperClient(server.http_url) as http_client, pytest.raises(TranscriptionError, match="gRPC only"):
        list(http_client.stream(JFK))


def test_transcribe_verbose_prints_segments_as_openai_whisper_does(server, sonnet_batch, tmp_path):
    command = whisper_triton_command() + ["transcribe", str(SONNET), "--verbose", "--url", f"grpc://{server.grpc_url}"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    document = Document.from_verbose_json(sonnet_batch.formatted)
    # The lines on stderr; the transcript alone on stdout, as without --verbose.
    assert run.stderr.splitlines() == [verbose_line(s) for s in document.segments]
    assert run.stderr.startswith("[00:00.000 --> ")
    assert run.stdout.strip() == sonnet_batch.text
    # With --output-dir the lines go to stdout, as openai-whisper prints them.
    run = subprocess.run(command + ["-o", str(tmp_path), "-f", "srt"], capture_output=True, text=True,
                         timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[:-1] == [verbose_line(s) for s in document.segments] and lines[-1].endswith("sonnet1_longform.srt")


def test_transcribe_verbose_needs_grpc(server):
    command = whisper_triton_command() + ["transcribe", str(JFK), "--verbose", "--url", server.http_url]
    run = subprocess.run(command, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert run.returncode == 2 and "--verbose streams segments over gRPC only" in run.stderr


# ------------------------------------------------------------------ the gateway


@pytest.fixture(scope="module")
def openai_client(gateway: str):
    with openai.OpenAI(base_url=gateway, api_key="unused", max_retries=0) as client:
        yield client


def test_gateway_streams_openais_events(openai_client):
    with open(SONNET, "rb") as audio:
        events = list(openai_client.audio.transcriptions.create(model="whisper-1", file=audio, stream=True))
    with open(SONNET, "rb") as audio:
        whole = openai_client.audio.transcriptions.create(model="whisper-1", file=audio)
    *deltas, done = events
    assert len(deltas) >= 2 and {e.type for e in deltas} == {"transcript.text.delta"}
    assert done.type == "transcript.text.done"
    assert "".join(e.delta for e in deltas) == done.text == whole.text
    assert (done.usage.type, done.usage.seconds) == (whole.usage.type, whole.usage.seconds)


def test_gateway_streams_a_windows_segments_one_by_one(openai_client):
    """Each of jfk.wav's two segments is a delta of its own, though the file is one window."""
    with open(JFK, "rb") as audio:
        *deltas, done = openai_client.audio.transcriptions.create(model="whisper-1", file=audio, stream=True)
    with open(JFK, "rb") as audio:
        whole = openai_client.audio.transcriptions.create(model="whisper-1", file=audio)
    assert len(deltas) == 2 and "".join(e.delta for e in deltas) == done.text == whole.text
    assert deltas[0].delta.strip() and whole.text.startswith(deltas[0].delta)


def test_gateway_streams_text_format_too(openai_client):
    with open(JFK, "rb") as audio:
        events = list(openai_client.audio.transcriptions.create(
            model="whisper-1", file=audio, stream=True, response_format="text"))
    assert "country" in events[-1].text and events[-1].type == "transcript.text.done"


@pytest.mark.parametrize("response_format", ["srt", "vtt", "verbose_json"])
def test_gateway_refuses_to_stream_timed_formats(openai_client, response_format):
    with open(JFK, "rb") as audio, pytest.raises(openai.BadRequestError) as caught:
        openai_client.audio.transcriptions.create(model="whisper-1", file=audio, stream=True,
                                                  response_format=response_format)
    body = caught.value.body
    assert body["param"] == "response_format" and response_format in body["message"]
    assert body["message"].startswith("stream=true sends the text as it is decoded")


def test_gateway_stream_of_bad_audio_is_a_400(openai_client, tmp_path):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"this is not audio")
    with open(bad, "rb") as audio, pytest.raises(openai.BadRequestError, match="not a decodable audio file"):
        list(openai_client.audio.transcriptions.create(model="whisper-1", file=audio, stream=True))
