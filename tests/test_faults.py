"""Faults through the real server: a request that breaks the engine fails alone, a
cancelled request frees its slot, SIGTERM finishes the requests in flight, and
the whisper_* metrics on Triton's metrics port follow what happened.

The session server runs with the engine's fault hook armed for one prompt
(`conftest.FAULT_PROMPT`, via WHISPER_TRITON_FAULT_PROMPT): every decoder step
holding a request with that prompt raises, as a bug triggered by one request would.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile
import tritonclient.grpc
import tritonclient.http
from conftest import (
    AUDIO_DIR,
    FAULT_PROMPT,
    RunningServer,
    _log_tail,
    _wait_until_ready,
    free_port,
    whisper_triton_command,
)
from tritonclient.utils import InferenceServerException

from python_backend_lib.apps.server import Activity
from python_backend_lib.serving import tensor_names
from python_backend_lib.serving.metrics import PUBLISH_INTERVAL_S

PROTOCOLS = ("http", "grpc")
TRITON = {"http": tritonclient.http, "grpc": tritonclient.grpc}
INTERNAL = {"http": "500", "grpc": "StatusCode.INTERNAL"}
JFK = (AUDIO_DIR / "jfk.wav").read_bytes()
SONNET = (AUDIO_DIR / "sonnet1_longform.wav").read_bytes()
METRICS_SETTLE_S = 15.0  # whisper_* metrics are published every second


def transcribe(url: str, protocol: str, audio: bytes = JFK, **parameters):
    """TEXT of the reply, or the InferenceServerException."""
    triton = TRITON[protocol]
    tensor = triton.InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[audio]], dtype=np.object_))
    try:
        reply = triton.InferenceServerClient(url).infer(tensor_names.ENSEMBLE_NAME, [tensor], parameters=parameters)
    except InferenceServerException as error:
        return error
    return reply.as_numpy(tensor_names.TEXT).reshape(-1)[0].decode("utf-8")


# Every whisper_* sample of a CPU server carries this label (one engine per device).
CPU_LABEL = 'gpu="cpu"'


def scrape(server: RunningServer) -> dict[str, float]:
    """Every sample on the metrics port: 'name{labels}' -> value, whisper_* samples
    keyed without their `gpu` label, which each must carry."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            if name.startswith("whisper_"):
                assert CPU_LABEL in name, f"{name} lacks its device label"
                name = re.sub(r"\{\}$", "", name.replace(CPU_LABEL + ",", "").replace("," + CPU_LABEL, "").replace(CPU_LABEL, ""))
            samples[name] = float(value)
    return samples


def settled(server: RunningServer) -> dict[str, float]:
    """The metrics once nothing is in flight and the last answers have been published."""
    wait_for(server, lambda s: s["whisper_requests_in_flight"] == 0)
    time.sleep(2 * PUBLISH_INTERVAL_S + 0.5)
    return scrape(server)


def wait_for(server: RunningServer, condition, timeout: float = METRICS_SETTLE_S) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(server)
        if condition(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.25)


# --------------------------------------------------------------------------- faults


@pytest.mark.server
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_engine_failure_fails_only_its_request(server, protocol):
    url = server.url(protocol)
    reference = transcribe(url, protocol)
    failed_steps = settled(server)["whisper_failed_steps_total"]
    with ThreadPoolExecutor(max_workers=7) as pool:
        good = [pool.submit(transcribe, url, protocol) for _ in range(6)]
        faulty = pool.submit(transcribe, url, protocol, prompt=FAULT_PROMPT)
        outcomes = [f.result(timeout=300) for f in good]
        error = faulty.result(timeout=300)
    assert isinstance(error, InferenceServerException), error
    assert "internal error: InjectedFault: injected fault for the prompt" in error.message()
    assert "Traceback" not in error.message()
    assert error.status() == INTERNAL[protocol]
    assert outcomes == [reference] * 6
    assert TRITON[protocol].InferenceServerClient(url).is_server_ready()
    samples = wait_for(server, lambda s: s["whisper_failed_steps_total"] > failed_steps)
    assert samples["whisper_failed_steps_total"] > failed_steps


# -------------------------------------------------------------------------- metrics


@pytest.mark.server
def test_metrics_follow_the_requests(server):
    before = settled(server)
    success = 'whisper_requests_total{outcome="success"}'
    client_errors = 'whisper_requests_total{outcome="client"}'
    for protocol in PROTOCOLS:
        assert isinstance(transcribe(server.url(protocol), protocol), str)
    assert isinstance(transcribe(server.http_url, "http", b"not audio at all"), InferenceServerException)
    bad_waveform = tritonclient.http.InferInput(tensor_names.WAVEFORM, [1, 16000], "FP32")
    bad_waveform.set_data_from_numpy(np.full((1, 16000), np.nan, np.float32))
    with pytest.raises(InferenceServerException):  # refused by the whisper model itself
        tritonclient.http.InferenceServerClient(server.http_url).infer(tensor_names.WHISPER_NAME, [bad_waveform])

    after = wait_for(server, lambda s: s[success] >= before[success] + 2 and s[client_errors] > before[client_errors])
    jfk_seconds = soundfile.info(AUDIO_DIR / "jfk.wav").duration
    assert after[success] == before[success] + 2
    assert after[client_errors] == before[client_errors] + 1
    assert after["whisper_audio_seconds_total"] == pytest.approx(before["whisper_audio_seconds_total"] + 2 * jfk_seconds)
    for histogram in ("whisper_request_duration_seconds", "whisper_real_time_factor", "whisper_queue_wait_seconds"):
        assert after[f"{histogram}_count"] >= before[f"{histogram}_count"] + 2, histogram
    assert after['whisper_decode_steps_total{path="eager"}'] > before['whisper_decode_steps_total{path="eager"}']
    assert after['whisper_decode_steps_total{path="cuda_graph"}'] == 0  # no GPU here
    assert after["whisper_decoding_slots"] >= 1
    assert after["whisper_request_limit"] >= after["whisper_decoding_slots"]
    idle = wait_for(server, lambda s: s["whisper_running_batch_size"] == 0 and s["whisper_requests_in_flight"] == 0)
    assert idle["whisper_running_batch_size"] == idle["whisper_requests_in_flight"] == idle["whisper_waiting_windows"] == 0
    # Triton's own metrics are on the same port.
    assert after['nv_inference_request_success{model="transcribe",version="1"}'] >= 2


def test_activity_reads_what_is_in_flight_and_what_was_answered():
    text = "\n".join(
        [
            "# HELP whisper_requests_in_flight Requests held by the whisper model",
            "whisper_requests_in_flight 3",
            'nv_inference_pending_request_count{model="preprocessing",version="1"} 2',
            'nv_inference_request_success{model="transcribe",version="1"} 10',
            'nv_inference_request_failure{model="transcribe",reason="BACKEND",version="1"} 1',
            'nv_inference_count{model="transcribe",version="1"} 99',
        ]
    )
    assert Activity.from_metrics(text) == Activity(busy=5, answered=11, unhealthy_engines=0)
    engines = text + '\nwhisper_engine_healthy{gpu="0"} 1\nwhisper_engine_healthy{gpu="1"} 0'
    assert Activity.from_metrics(engines).unhealthy_engines == 1


# ----------------------------------------------------------------------- cancelling


def long_waveform(minutes: float) -> np.ndarray:
    """WAVEFORM as preprocessing writes it, for JFK repeated for `minutes`."""
    from python_backend_lib.audio.decode import decode_audio
    from python_backend_lib.core import geometry

    samples = decode_audio(JFK)
    return np.tile(samples, int(np.ceil(minutes * 60 * geometry.SAMPLE_RATE / len(samples))))


@pytest.mark.server
def test_a_cancelled_request_frees_its_slot(server):
    """A gRPC client cancels a 5-minute transcription (ten windows, decoded one after
    another) early: the engine drops it between decoder steps and the whisper model
    holds nothing any more, long before the transcription could have finished.

    The request goes to the whisper model directly: Triton 2.51's ensemble passes a
    cancellation only to steps not yet started (triton-inference-server/server#6739).
    """
    waveform = long_waveform(minutes=5)
    client = tritonclient.grpc.InferenceServerClient(server.grpc_url)
    audio = tritonclient.grpc.InferInput(tensor_names.WAVEFORM, [1, len(waveform)], "FP32")
    audio.set_data_from_numpy(waveform[None])
    cancelled = 'whisper_requests_total{outcome="cancelled"}'
    before = settled(server)
    answers = []
    call = client.async_infer(tensor_names.WHISPER_NAME, [audio], callback=lambda *outcome: answers.append(outcome))
    running = wait_for(server, lambda s: s["whisper_requests_in_flight"] >= 1)
    assert running["whisper_requests_in_flight"] >= 1
    call.cancel()
    started = time.monotonic()
    freed = wait_for(server, lambda s: s["whisper_requests_in_flight"] == 0 and s[cancelled] > before[cancelled])
    assert freed["whisper_requests_in_flight"] == 0 and freed["whisper_running_batch_size"] == 0
    assert freed[cancelled] == before[cancelled] + 1
    assert time.monotonic() - started < METRICS_SETTLE_S
    assert isinstance(transcribe(server.grpc_url, "grpc"), str)  # and the server serves on


# ------------------------------------------------------------------------- shutdown


@pytest.mark.server
@pytest.mark.slow
def test_sigterm_answers_the_requests_in_flight(tmp_path):
    """`whisper-triton serve` waits for the requests in flight before stopping Triton
    (test_launcher.py checks an idle server stops cleanly)."""
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    log = tmp_path / "serve.log"
    command = whisper_triton_command() + [
        "serve", f"--http-port={http_port}", f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}",
    ]
    with log.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        _wait_until_ready(process, http_port, log)
        server = RunningServer(
            f"localhost:{http_port}", f"localhost:{grpc_port}", f"http://localhost:{metrics_port}/metrics", log
        )
        reference = transcribe(server.grpc_url, "grpc", SONNET)
        with ThreadPoolExecutor(max_workers=8) as pool:  # 53 s clips: two windows each, one after the other
            replies = [pool.submit(transcribe, server.url(p), p, SONNET) for p in PROTOCOLS * 4]
            busy = wait_for(server, lambda s: s["whisper_requests_in_flight"] >= 4)
            assert busy["whisper_requests_in_flight"] >= 4
            process.send_signal(signal.SIGTERM)
            outcomes = [reply.result(timeout=120) for reply in replies]
        assert outcomes == [reference] * 8, outcomes
        assert process.wait(timeout=90) == 0, _log_tail(log)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert re.search(r"stopping tritonserver", log.read_text())
