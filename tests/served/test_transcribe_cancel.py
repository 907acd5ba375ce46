"""Ctrl-C on `whisper-triton transcribe`, and cancels by request id, through the real server.

Triton 2.51 passes no client cancel into a running step of the `transcribe`
ensemble (server#6739): the command names each request (`request_id`) and, on
Ctrl-C, sends the whisper model a cancel naming it (`serving.cancellation`).
These tests send SIGINT to the command as a subprocess and read on the server
that the request was dropped and its decoding slot freed.
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import numpy as np
import openai
import pytest
import soundfile
import tritonclient.grpc
from conftest import launch_server, whisper_triton_command
from test_faults import JFK, STREAM_ENGINE, is_ready, settled, transcribe, wait_for
from test_gateway import start_gateway

from clients.api import TimedOut, TranscriptionError, WhisperClient, new_request_id
from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.contract import tensor_names
from python_backend_lib.core import geometry

pytestmark = pytest.mark.server

CANCELLED = 'whisper_requests_total{outcome="cancelled"}'
# The requirement: Ctrl-C ends the command, and the server's decoding of it, within a second.
WITHIN_S = 1.0
STORM = 40  # cancelled requests back to back (triton-inference-server/server#7368: a crash under load)


def long_wav(folder, minutes: float):
    """JFK repeated for `minutes`, as a WAV file: windows enough to take every slot in batched mode."""
    samples = decode_audio(JFK)
    repeats = int(np.ceil(minutes * 60 * geometry.SAMPLE_RATE / len(samples)))
    path = folder / f"jfk-{minutes:g}-minutes.wav"
    soundfile.write(path, np.tile(samples, repeats), geometry.SAMPLE_RATE)
    return path


@pytest.fixture(scope="module")
def quiet_server(tmp_path_factory):
    """A server of these tests alone. On the session's shared server, in the whole suite,
    a request of an earlier test was still in flight minutes later (not found yet), and
    the signal must reach the command while its own request, and only it, runs."""
    with launch_server(tmp_path_factory.mktemp("quiet-server")) as launched:
        yield launched.server


@pytest.mark.parametrize(("protocol", "sigint_ignored"), [("http", False), ("grpc", False), ("http", True)],
                         ids=["http", "grpc", "http-started-with-sigint-ignored"])
def test_ctrl_c_exits_within_a_second_and_the_server_stops_decoding(quiet_server, tmp_path, protocol, sigint_ignored):
    """SIGINT to the command while the server decodes five minutes: the command exits
    with 130 and one line, without a traceback, within a second. It says "cancelled"
    only once the server has answered the request as cancelled, which the whisper
    model does once the engine has dropped it and freed its slot; the metrics then
    count it cancelled, and nothing is left in flight."""
    server = quiet_server
    before = settled(server)
    assert before["whisper_requests_in_flight"] == 0, "requests still in flight before the command starts"
    url = server.http_url if protocol == "http" else f"grpc://{server.grpc_url}"
    command = whisper_triton_command() + ["transcribe", str(long_wav(tmp_path, 5)), "--url", url]
    # A child inherits an ignored SIGINT (a script's background job): the command listens anyway.
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               preexec_fn=ignore)
    try:
        running = wait_for(server, lambda s: s["whisper_requests_in_flight"] >= 1 and s["whisper_running_batch_size"] >= 1)
        assert running["whisper_requests_in_flight"] >= 1 and running["whisper_running_batch_size"] >= 1, running
        process.send_signal(signal.SIGINT)
        interrupted_at = time.monotonic()
        status = process.wait(timeout=30)
        exited_after = time.monotonic() - interrupted_at
    finally:
        process.kill()
    stdout, stderr = process.stdout.read().decode(), process.stderr.read().decode()
    print(f"{protocol}: exited {exited_after:.2f} s after SIGINT")
    assert status == 130 and stdout == ""
    assert stderr == "whisper-triton transcribe: interrupted; cancelled 1 request on the server\n"
    assert exited_after < WITHIN_S
    after = settled(server)
    assert after[CANCELLED] == before[CANCELLED] + 1
    assert after["whisper_requests_in_flight"] == after["whisper_running_batch_size"] == 0


def test_a_cancel_before_the_request_reaches_the_whisper_model_still_stops_it(server, tmp_path):
    """A cancel may come while the audio is still being decoded: the id waits on the
    board, and the request is dropped when it arrives. An id that names no request is
    no error; a cancel sent to `transcribe` is refused, naming where it goes."""
    before = settled(server)
    request_id = new_request_id()
    with WhisperClient(server.grpc_url, "grpc") as client:
        client.cancel(request_id)
        client.cancel(new_request_id())  # nobody's: answered like any other
        with pytest.raises(TranscriptionError, match="cancelled"):
            client.transcribe(long_wav(tmp_path, 2), request_id=request_id)
        with pytest.raises(TranscriptionError, match="a cancel request goes to the 'whisper' model"):
            client.transcribe(JFK, cancel=request_id)
        assert "country" in client.transcribe(JFK, request_id=new_request_id()).text
    assert settled(server)[CANCELLED] == before[CANCELLED] + 1


def test_a_storm_of_grpc_cancels_leaves_the_server_serving(server, tmp_path):
    """STORM requests over gRPC, eight at a time, each given up after a moment with a
    cancel request, as the command does; every other one has its gRPC call cancelled
    right after too, as the command's call is when the server does not confirm in
    time. Then eight short ones cancelled by gRPC alone (the server decodes those to
    their end: server#6739). The server answers every one, stays ready, frees every
    slot, and transcribes as before."""
    audio = long_wav(tmp_path, 1).read_bytes()
    reference = transcribe(server.grpc_url, "grpc")
    before = settled(server)
    random.seed(27)
    client = tritonclient.grpc.InferenceServerClient(server.grpc_url)
    canceller = WhisperClient(server.grpc_url, "grpc")
    answers: list = []

    def send(data: bytes) -> tuple:
        request_id = new_request_id()
        tensor = tritonclient.grpc.InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[data]], dtype=np.object_))
        call = client.async_infer(
            tensor_names.ENSEMBLE_NAME, [tensor], parameters={"request_id": request_id},
            callback=lambda result, error: answers.append(error),
        )  # fmt: skip
        return call, request_id

    for _ in range(STORM // 8):
        calls = [send(audio) for _ in range(8)]
        time.sleep(random.uniform(0.2, 1.0))
        for i, (call, request_id) in enumerate(calls):
            canceller.cancel(request_id)
            if i % 2:
                call.cancel()
    calls = [send(JFK) for _ in range(8)]
    time.sleep(0.5)
    for call, _ in calls:
        call.cancel()
    deadline = time.monotonic() + 60
    while len(answers) < STORM + 8 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(answers) == STORM + 8, f"{len(answers)} of {STORM + 8} answered"
    assert all(error is not None for error in answers[:STORM])  # cancelled, every one
    assert is_ready(server)
    after = settled(server)
    assert after["whisper_requests_in_flight"] == after["whisper_running_batch_size"] == 0
    assert after[CANCELLED] >= before[CANCELLED] + STORM // 2
    assert transcribe(server.grpc_url, "grpc") == reference
    assert "country" in transcribe(server.http_url, "http").lower()
    canceller.close()
    client.close()


def test_a_gateway_client_that_hangs_up_has_its_transcription_cancelled(server, gateway, tmp_path):
    """An OpenAI client that goes away while the server decodes three minutes: the gateway
    notices the closed connection and sends the server a cancel naming the request, so
    the engine drops it and frees its slot, long before it could have finished."""
    boundary = "hangup"
    audio = long_wav(tmp_path, 3).read_bytes()  # under the test gateway's upload limit
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="long.wav"\r\n\r\n').encode()
    body += audio + f"\r\n--{boundary}--\r\n".encode()
    address = urllib.parse.urlsplit(gateway)
    before = settled(server)
    with socket.create_connection((address.hostname, address.port), timeout=30) as connection:
        connection.sendall(
            f"POST {address.path}/audio/transcriptions HTTP/1.1\r\nHost: {address.netloc}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
        )
        running = wait_for(server, lambda s: s["whisper_running_batch_size"] >= 1)
        assert running["whisper_running_batch_size"] >= 1, running
    hung_up_at = time.monotonic()
    freed = wait_for(server, lambda s: s["whisper_requests_in_flight"] == 0 and s[CANCELLED] > before[CANCELLED])
    print(f"freed {time.monotonic() - hung_up_at:.2f} s after the client hung up")
    assert freed[CANCELLED] == before[CANCELLED] + 1
    assert freed["whisper_requests_in_flight"] == freed["whisper_running_batch_size"] == 0


# A client's timeout: far shorter than the two minutes of audio take to decode on the CPU.
CLIENT_TIMEOUT_S = 1.0


def cancelled(server, streamed: bool) -> float:
    """The requests answered as cancelled by the whisper engine, or by the streamed path's."""
    if not streamed:
        return settled(server)[CANCELLED]
    settled(server)
    with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    (line,) = [ln for ln in lines if ln.startswith("whisper_requests_total{") and STREAM_ENGINE in ln
               and 'outcome="cancelled"' in ln]
    return float(line.rpartition(" ")[2])


@pytest.mark.parametrize("call", ["http", "grpc", "grpc-stream"])
def test_a_request_past_the_clients_timeout_is_cancelled_on_the_server(server, tmp_path, call):
    """Triton 2.51 decodes on when a client's timeout passes (its gRPC deadline, its HTTP
    socket's): WhisperClient with a timeout gives each request an id and, past the
    timeout, cancels it by that id, so the engine drops it and counts it cancelled; the
    call raises TimedOut saying so, not that the server was unreachable."""
    streamed = call == "grpc-stream"  # the streamed path's own engine
    before = cancelled(server, streamed)
    url = server.http_url if call == "http" else f"grpc://{server.grpc_url}"
    audio = long_wav(tmp_path, 2)
    with WhisperClient(url, timeout_s=CLIENT_TIMEOUT_S) as client, pytest.raises(TimedOut) as caught:
        if streamed:
            list(client.stream(audio))
        else:
            client.transcribe(audio)
    assert f"within this client's timeout of {CLIENT_TIMEOUT_S:g} s; cancelled on the server" in str(caught.value)
    assert cancelled(server, streamed) == before + 1
    assert settled(server)["whisper_requests_in_flight"] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_transcription_past_the_gateways_timeout_is_a_504_and_cancelled_on_the_server(server, tmp_path, stream):
    """The gateway's `--timeout` to Triton: past it, the OpenAI client gets a 504 (streamed,
    an error event saying so: the aio client raised gRPC's own error for the stream's
    deadline, which broke the response off), and the gateway cancels the request by its
    id, so the server does not decode on."""
    process, base_url = start_gateway(server.grpc_url, tmp_path, [f"--timeout={CLIENT_TIMEOUT_S:g}"])
    before = cancelled(server, stream)
    try:
        with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            with pytest.raises(openai.APIError) as caught:
                events = client.audio.transcriptions.create(
                    model="whisper-1", file=long_wav(tmp_path, 2).open("rb"), stream=stream
                )
                if stream:
                    list(events)
            assert caught.value.body["code"] == "timeout", caught.value.body
            assert stream or isinstance(caught.value, openai.APIStatusError) and caught.value.status_code == 504
        assert cancelled(server, stream) == before + 1
        assert settled(server)["whisper_requests_in_flight"] == 0
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0
