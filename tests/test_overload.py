"""A flood at twice the server's capacity: every request gets a correct transcript
or a clean UNAVAILABLE refusal, none is lost, and latency comes back afterwards.

The capacity is measured first (short clips, as many concurrent clients as the
engine has decoding slots); then requests are sent open-loop at twice that rate
for FLOOD_S seconds. Without a bound, the excess would wait inside the engine
ever longer; the whisper model's request limit (slots + max_queued_requests)
refuses it at once instead.
"""

from __future__ import annotations

import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest
import tritonclient.grpc
from conftest import AUDIO_DIR, RunningServer
from tritonclient.utils import InferenceServerException

from python_backend_lib.serving import tensor_names

pytestmark = [pytest.mark.server, pytest.mark.slow]

CLIP = (AUDIO_DIR / "cards_001.wav").read_bytes()  # 1.1 s: one short window
MEASURE_S = 8.0
FLOOD_S = 20.0
OVERLOAD = 2.0  # times the measured capacity
REQUEST_TIMEOUT_S = 120.0  # a request not answered by then counts as lost
LATENCY_SAMPLES = 5
UNAVAILABLE = "StatusCode.UNAVAILABLE"


@dataclass(frozen=True)
class Outcome:
    seconds: float
    text: str | None = None
    error: InferenceServerException | None = None


def audio_input() -> list:
    tensor = tritonclient.grpc.InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[CLIP]], dtype=np.object_))
    return [tensor]


def transcribe(client) -> Outcome:
    started = time.monotonic()
    try:
        reply = client.infer(tensor_names.ENSEMBLE_NAME, audio_input(), client_timeout=REQUEST_TIMEOUT_S)
    except InferenceServerException as error:
        return Outcome(time.monotonic() - started, error=error)
    return Outcome(time.monotonic() - started, text=reply.as_numpy(tensor_names.TEXT).reshape(-1)[0].decode())


def decoding_slots(server: RunningServer) -> int:
    """The engine's slot count, from its whisper_decoding_slots gauge."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("whisper_decoding_slots{"):  # one series per device: {gpu="cpu"} here
                return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError("no whisper_decoding_slots on the metrics port")


def median_latency(server: RunningServer) -> float:
    client = tritonclient.grpc.InferenceServerClient(server.grpc_url)
    return statistics.median(transcribe(client).seconds for _ in range(LATENCY_SAMPLES))


def capacity(server: RunningServer, concurrency: int) -> float:
    """Requests answered per second by `concurrency` clients sending back to back."""
    deadline = time.monotonic() + MEASURE_S
    answered = []

    def client_loop() -> None:
        client = tritonclient.grpc.InferenceServerClient(server.grpc_url)
        while time.monotonic() < deadline:
            outcome = transcribe(client)
            assert outcome.error is None, outcome.error
            answered.append(outcome)

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for future in [pool.submit(client_loop) for _ in range(concurrency)]:
            future.result()
    return len(answered) / (time.monotonic() - started)


def flood(server: RunningServer, rate: float, seconds: float) -> tuple[int, list[Outcome]]:
    """Send requests open-loop at `rate` per second for `seconds`; wait for every answer.
    Returns (requests sent, their outcomes)."""
    client = tritonclient.grpc.InferenceServerClient(server.grpc_url)
    inputs = audio_input()
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    all_answered = threading.Event()
    sent = 0

    def answered(started: float, result, error) -> None:
        outcome = Outcome(time.monotonic() - started, error=error)
        if error is None:
            outcome = Outcome(outcome.seconds, text=result.as_numpy(tensor_names.TEXT).reshape(-1)[0].decode())
        with lock:
            outcomes.append(outcome)
            if len(outcomes) == sent and stop_sending.is_set():
                all_answered.set()

    stop_sending = threading.Event()
    begin = time.monotonic()
    while time.monotonic() - begin < seconds:
        time.sleep(max(0.0, begin + sent / rate - time.monotonic()))
        started = time.monotonic()
        with lock:
            sent += 1
        client.async_infer(
            tensor_names.ENSEMBLE_NAME, inputs, callback=lambda result, error, s=started: answered(s, result, error),
            client_timeout=REQUEST_TIMEOUT_S,
        )
    with lock:
        stop_sending.set()
        if len(outcomes) == sent:
            all_answered.set()
    all_answered.wait(REQUEST_TIMEOUT_S + 10)
    with lock:
        return sent, list(outcomes)


def test_a_flood_at_twice_capacity_is_answered_or_refused_cleanly_and_the_server_recovers(server):
    client = tritonclient.grpc.InferenceServerClient(server.grpc_url)
    expected = transcribe(client).text
    assert expected
    baseline = median_latency(server)
    slots = decoding_slots(server)
    measured = capacity(server, concurrency=slots)

    sent, outcomes = flood(server, rate=OVERLOAD * measured, seconds=FLOOD_S)

    assert len(outcomes) == sent, f"{sent - len(outcomes)} of {sent} requests were never answered"
    succeeded = [o for o in outcomes if o.error is None]
    refused = [o for o in outcomes if o.error is not None]
    assert all(o.text == expected for o in succeeded), {o.text for o in succeeded}
    for outcome in refused:  # the request limit, or Triton's own queue policy
        assert outcome.error.status() == UNAVAILABLE, outcome.error
        message = outcome.error.message()
        assert "server overloaded" in message or "queue" in message.lower(), message
    assert refused, f"no request was refused at {OVERLOAD * measured:.1f}/s (capacity {measured:.1f}/s)"
    assert succeeded
    # Refusals are fast: quicker than the answers admitted during the flood.
    assert statistics.median(o.seconds for o in refused) < statistics.median(o.seconds for o in succeeded)

    recovered = median_latency(server)
    report = (
        f"capacity {measured:.1f}/s at {slots} clients; flood {sent} requests at {OVERLOAD * measured:.1f}/s: "
        f"{len(succeeded)} answered (median {statistics.median(o.seconds for o in succeeded):.2f} s, "
        f"max {max(o.seconds for o in succeeded):.2f} s), {len(refused)} refused "
        f"(median {statistics.median(o.seconds for o in refused):.2f} s); "
        f"latency before {baseline:.2f} s, after {recovered:.2f} s"
    )
    print(report)
    assert recovered <= 2 * baseline + 0.5, report
