"""Faults through the real server: a request that breaks a decoder step fails alone,
one that breaks the engine loop fails and the engine restarts, an engine that keeps
failing is refused fast and replaced, a cancelled request frees its slot, SIGTERM
finishes the requests in flight, and the whisper_* metrics on Triton's metrics
port follow what happened.

The session server runs with the engine's fault hooks armed for two prompts
(`conftest.SESSION_FAULTS`): every decoder step holding a request with
`FAULT_PROMPT` raises, as a bug triggered by one request would; with
`ENGINE_FAULT_PROMPT` the engine's handling of that failure raises too.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import soundfile
import tritonclient.grpc
import tritonclient.http
from conftest import (
    AUDIO_DIR,
    ENGINE_FAULT_PROMPT,
    FAULT_PROMPT,
    RunningServer,
    _log_tail,
    launch_server,
    model_repository_with,
)
from pbtxt import load, one
from reference import clips
from tritonclient.utils import InferenceServerException

from clients.api import LogMel
from python_backend_lib.apps.server import (
    STOP_GRACE_S,
    Activity,
    packaged_model_repository,
)
from python_backend_lib.apps.server_watch import DRAIN_QUIET_S, HEALTH_POLL_S
from python_backend_lib.apps.triton_environment import EXIT_TIMEOUT_S
from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.contract import tensor_names
from python_backend_lib.core import geometry
from python_backend_lib.engine.scheduler import MAX_CONSECUTIVE_RESTARTS
from python_backend_lib.serving.metrics import PUBLISH_INTERVAL_S
from python_backend_lib.serving.parent_watch import CHECK_INTERVAL_S
from python_backend_lib.serving.preprocessing_metrics import HISTOGRAMS as PREPROCESSING_HISTOGRAMS
from python_backend_lib.serving.settings import ENGINE_FAULT_PROMPT_ENV, STALL_PROMPT_ENV, STALL_TIMEOUT_ENV
from python_backend_lib.serving.stall_watch import CHECK_INTERVAL_S as STALL_CHECK_S
from python_backend_lib.serving.stall_watch import Beat, StallClock, kernel_waits

# loadtest/ is a folder of the checkout, not part of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from whisper_calls import decoded_text, library_log_mel, whisper_inputs

from loadtest.metrics import ENGINE_LABELS
from loadtest.processes import stub_processes, tritonserver_pid

PROTOCOLS = ("http", "grpc")
TRITON = {"http": tritonclient.http, "grpc": tritonclient.grpc}
INTERNAL = {"http": "500", "grpc": "StatusCode.INTERNAL"}
UNAVAILABLE = {"http": "503", "grpc": "StatusCode.UNAVAILABLE"}
JFK = (AUDIO_DIR / "jfk.wav").read_bytes()
SONNET = (AUDIO_DIR / "sonnet1_longform.wav").read_bytes()
CARDS = (AUDIO_DIR / "cards_001.wav").read_bytes()  # 1.1 s: one short window
METRICS_SETTLE_S = 15.0  # whisper_* metrics are published every second
# A request not answered by then hangs: the test fails instead of waiting with it.
REQUEST_TIMEOUT_S = 120.0
RESTARTS = "whisper_engine_restarts_total"


def transcribe(url: str, protocol: str, audio: bytes = JFK, **parameters):
    """TEXT of the reply, or the InferenceServerException (a hang is one too, after REQUEST_TIMEOUT_S).
    The client is closed either way: the exception's traceback would keep it, and an HTTP
    connection left open makes Triton's stop wait out its exit timeout."""
    triton = TRITON[protocol]
    tensor = triton.InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[audio]], dtype=np.object_))
    if protocol == "http":
        client = tritonclient.http.InferenceServerClient(url, network_timeout=REQUEST_TIMEOUT_S)
        options = {}
    else:
        client = tritonclient.grpc.InferenceServerClient(url)
        options = {"client_timeout": REQUEST_TIMEOUT_S}
    try:
        reply = client.infer(tensor_names.ENSEMBLE_NAME, [tensor], parameters=parameters, **options)
    except InferenceServerException as error:
        return error
    finally:
        client.close()
    return reply.as_numpy(tensor_names.TEXT).reshape(-1)[0].decode("utf-8")


def is_ready(server: RunningServer) -> bool:
    """Triton's readiness (/v2/health/ready); False too when nothing answers any more."""
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


# Every whisper_* sample of a one-engine server's whisper model carries these labels: its
# device (cpu, or a GPU's index where tests/gpu's runner starts these tests) and its
# instance; the streamed path's engine (whisper_stream) has series of its own, left out.
ENGINE = (re.compile(r'gpu="(cpu|\d+)"'), re.compile(r'instance="whisper_0_0"'))
STREAM_ENGINE = 'instance="whisper_stream_0_0"'


def scrape(server: RunningServer) -> dict[str, float]:
    """Every sample on the metrics port: 'name{labels}' -> value, whisper_* samples
    keyed without their engine's labels, which each must carry."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            if name.startswith("whisper_"):
                if STREAM_ENGINE in name:
                    continue
                assert all(label.search(name) for label in ENGINE), f"{name} lacks its engine's labels"
                name = ENGINE_LABELS.sub("", name).replace(",}", "}").removesuffix("{}")
            samples[name] = float(value)
    return samples


# Counters that move whenever a request finishes anywhere in the server.
FINISHED_COUNTERS = ("nv_inference_request_success", "nv_inference_request_failure", "whisper_requests_total")
# A request given up by gRPC alone still runs to its end (server#6739), and may still be
# in preprocessing while the whisper model reports nothing in flight.
SETTLE_TIMEOUT_S = 120.0


def settled(server: RunningServer) -> dict[str, float]:
    """The metrics once the server has been quiet for two of the whisper model's publish
    intervals: nothing pending or in flight, and no request finished meanwhile. One read
    of zero in flight is not enough: the count is published once an interval, so it may
    predate requests that reached the model since."""
    quiet_for = 2 * PUBLISH_INTERVAL_S + 0.5
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    samples = scrape(server)
    quiet_since = time.monotonic()
    while True:
        latest = scrape(server)
        if not is_idle(latest) or finished(latest) != finished(samples):
            quiet_since = time.monotonic()
        samples = latest
        if time.monotonic() - quiet_since >= quiet_for or time.monotonic() > deadline:
            return samples
        time.sleep(0.25)


def is_idle(samples: dict[str, float]) -> bool:
    pending = (value for name, value in samples.items() if name.startswith("nv_inference_pending_request_count"))
    return samples["whisper_requests_in_flight"] == 0 and not any(pending)


def finished(samples: dict[str, float]) -> dict[str, float]:
    return {name: value for name, value in samples.items() if name.startswith(FINISHED_COUNTERS)}


def summed(samples: dict[str, float], name: str) -> float:
    """A metric's samples summed over their labels (every instance of a model)."""
    return sum(value for key, value in samples.items() if key == name or key.startswith(name + "{"))


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


@pytest.mark.server
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_engine_loop_failure_fails_its_request_and_the_engine_restarts(server, protocol):
    """The engine's own failure handling raises: the loop fails what it holds with
    INTERNAL and starts again, so the next request is served as before."""
    url = server.url(protocol)
    reference = transcribe(url, protocol)
    before = settled(server)
    error = transcribe(url, protocol, prompt=ENGINE_FAULT_PROMPT)
    assert isinstance(error, InferenceServerException), error
    assert error.status() == INTERNAL[protocol]
    assert "internal error: InjectedFault: injected fault while dropping the prompt" in error.message()
    assert "Traceback" not in error.message()
    assert transcribe(url, protocol) == reference
    after = wait_for(server, lambda s: s[RESTARTS] > before[RESTARTS])
    assert after[RESTARTS] == before[RESTARTS] + 1
    assert after["whisper_engine_healthy"] == 1
    assert is_ready(server)


# A refusal by an engine that gave up takes no decoding: well under a second,
# even on a busy 2-core machine (it takes about 0.1 s here).
FAST_REFUSAL_S = 0.5
# The launcher reads the engines' health every HEALTH_POLL_S, then drains until
# nothing was answered for DRAIN_QUIET_S before stopping Triton.
GIVE_UP_TO_NOT_READY_S = PUBLISH_INTERVAL_S + HEALTH_POLL_S + DRAIN_QUIET_S + 20.0


@pytest.mark.server
def test_an_engine_that_keeps_failing_is_refused_fast_reported_and_the_server_exits(tmp_path):
    """After MAX_CONSECUTIVE_RESTARTS failures in a row the engine gives up: new
    requests get UNAVAILABLE at once, whisper_engine_healthy says 0, Triton stops
    being ready and `whisper-triton serve` exits with status 1, so that Docker or
    Kubernetes replaces the server. Every wait is bounded."""
    with launch_server(tmp_path, {ENGINE_FAULT_PROMPT_ENV: ENGINE_FAULT_PROMPT}, streamed_path=False) as launched:
        server = launched.server
        assert isinstance(transcribe(server.grpc_url, "grpc", CARDS), str)
        for _ in range(MAX_CONSECUTIVE_RESTARTS):
            error = transcribe(server.grpc_url, "grpc", CARDS, prompt=ENGINE_FAULT_PROMPT)
            assert isinstance(error, InferenceServerException) and error.status() == INTERNAL["grpc"], error
        for protocol in PROTOCOLS:
            started = time.monotonic()
            refusal = transcribe(server.url(protocol), protocol, CARDS)
            seconds = time.monotonic() - started
            assert isinstance(refusal, InferenceServerException), refusal
            assert refusal.status() == UNAVAILABLE[protocol]
            message = refusal.message()
            assert "server unavailable: the engine is unhealthy and refuses new work: InjectedFault" in message
            assert message.endswith("retry on another server"), message
            assert seconds < FAST_REFUSAL_S, f"refused after {seconds:.2f} s"
        reported = wait_for(server, lambda s: s["whisper_engine_healthy"] == 0)
        assert reported["whisper_engine_healthy"] == 0
        assert reported[RESTARTS] == MAX_CONSECUTIVE_RESTARTS

        deadline = time.monotonic() + GIVE_UP_TO_NOT_READY_S
        while is_ready(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not is_ready(server), f"still ready {GIVE_UP_TO_NOT_READY_S:.0f} s after the engine gave up"
        status = launched.process.wait(timeout=STOP_GRACE_S + 30)
    log = server.log.read_text()
    assert status == 1, _log_tail(server.log)
    assert "a whisper engine failed repeatedly or stalled, and refuses new requests" in log
    assert f"the engine failed {MAX_CONSECUTIVE_RESTARTS} times in a row and gives up" in log


def test_a_stall_is_held_work_without_progress_for_the_bound():
    clock = StallClock(bound_s=10.0, now=0.0)
    assert clock.stalled_for(Beat(progress=5, held=2), now=1.0) is None  # the first reading starts the clock
    assert clock.stalled_for(Beat(progress=5, held=2), now=10.9) is None
    assert clock.stalled_for(Beat(progress=5, held=2), now=11.0) == 10.0
    assert clock.stalled_for(Beat(progress=6, held=2), now=12.0) is None  # progress restarts it
    assert clock.stalled_for(Beat(progress=6, held=2), now=21.0) is None
    assert clock.stalled_for(Beat(progress=6, held=0), now=30.0) is None  # idle is never a stall
    assert clock.stalled_for(Beat(progress=6, held=1), now=39.0) is None  # ... and restarts it too
    assert clock.stalled_for(Beat(progress=6, held=1), now=40.0) == 10.0


def test_kernel_waits_name_a_thread_blocked_writing_a_full_pipe(tmp_path):
    """What a stall's log says of threads outside Python's view: here a thread of this
    process blocked writing a pipe no one reads, as Triton's logger would be behind a
    stalled reader of its output."""
    reader, writer = os.pipe()

    def fill() -> None:
        try:
            while True:
                os.write(writer, bytes(65_536))
        except OSError:  # the reader closed: the test is over
            os.close(writer)

    blocked = threading.Thread(target=fill, name="filler", daemon=True)
    blocked.start()
    deadline = time.monotonic() + 10
    while "pipe_write" not in (waits := kernel_waits(os.getpid())) and time.monotonic() < deadline:
        time.sleep(0.05)
    if all(key.endswith(" -") for key in re.findall(r"x ([^,]+)", waits)):
        pytest.skip(f"this kernel names no wait channels in /proc: {waits}")
    assert re.search(r"1 x \S+ S \S*pipe_write", waits), waits
    os.close(reader)  # the writer then fails, and the thread ends
    blocked.join(timeout=10)

    # Read from /proc's files alone: a thread's name, state and channel, like ones counted together.
    for tid, (name, state, channel) in {"7": ("tritonserver", "S", "futex_wait_queue"),
                                        "8": ("tritonserver", "S", "futex_wait_queue"),
                                        "9": ("grpc", "R", "0")}.items():
        task = tmp_path / "42" / "task" / tid
        task.mkdir(parents=True)
        (task / "comm").write_text(f"{name}\n")
        (task / "stat").write_text(f"{tid} ({name}) {state} 1 2 3\n")
        (task / "wchan").write_text(channel)
    assert kernel_waits(42, proc=tmp_path) == "2 x tritonserver S futex_wait_queue, 1 x grpc R -"
    assert kernel_waits(43, proc=tmp_path) == ""


STALL_DUMP = Path(__file__).resolve().parents[2] / "scripts" / "stall_dump.sh"


def test_the_stall_dumper_writes_each_thread_of_triton_once_a_verdict_is_logged(tmp_path):
    """scripts/stall_dump.sh, beside a GPU benchmark, waits for a stall verdict in the
    server's log and then writes every thread of each tritonserver process with its state
    and kernel wait channel; before the verdict it writes nothing."""
    log = tmp_path / "serve.log"
    log.write_text("I1130 whisper instance whisper_0_0 on 0 is ready\n")
    stand_in = subprocess.Popen(["bash", "-c", "exec -a /opt/x/bin/tritonserver sleep 60"])
    dumper = subprocess.Popen(["bash", str(STALL_DUMP), str(log), str(tmp_path / "dump")])
    try:
        time.sleep(3)  # longer than the dumper's poll
        assert dumper.poll() is None and not (tmp_path / "dump").exists()
        with log.open("a") as out:
            out.write("E1130 whisper instance whisper_0_0 on 0 made no progress for 60 s while holding 3 requests\n")
        assert dumper.wait(timeout=30) == 0
        text = (tmp_path / "dump" / f"{stand_in.pid}.txt").read_text()
        assert text.startswith(f"== {stand_in.pid} /opt/x/bin/tritonserver 60")
        assert re.search(rf"^-- {stand_in.pid} sleep S \S*", text, re.MULTILINE), text
    finally:
        dumper.kill()
        stand_in.kill()


STALL_PROMPT = "this request's decoder step never returns"
STALL_BOUND_S = 10.0  # well above one loop turn of a first request on a busy 2-core machine


@pytest.mark.server
def test_a_stalled_engine_fails_what_it_holds_within_its_bound_and_the_server_exits(tmp_path):
    """A decoder step that never returns (the test-only stall prompt: as a stuck device
    call would) leaves no thread of the engine to answer. Within the stall bound every
    request the instance holds, the stuck one and one that came after it, fails with
    INTERNAL naming the instance and where its engine thread stands; the metrics say
    stalled; and `whisper-triton serve` exits with status 1, every thread's stack in
    its log, so that the server is replaced (the launcher stops Triton at once, so new
    requests are refused by the engine in test_engine.py's test instead)."""
    environ = {STALL_PROMPT_ENV: STALL_PROMPT, STALL_TIMEOUT_ENV: str(STALL_BOUND_S)}
    # --engines 1 on a GPU too: one instance holds both
    with launch_server(tmp_path, environ, ("--engines", "1"), streamed_path=False) as launched:
        server = launched.server
        assert isinstance(transcribe(server.grpc_url, "grpc", CARDS), str)
        # The launcher stops Triton within seconds of the verdict: its metrics are read meanwhile.
        stalled_seen = threading.Event()
        unread: list[AssertionError] = []  # a sample the reader could not read, kept for the test to show

        def read_metrics() -> None:
            while launched.process.poll() is None and not stalled_seen.is_set():
                try:
                    samples = scrape(server)
                    if samples.get("whisper_engine_stalled") == 1 and samples.get("whisper_engine_healthy") == 0:
                        stalled_seen.set()
                except (urllib.error.URLError, ConnectionError, KeyError):
                    pass
                except AssertionError as error:
                    unread.append(error)
                    return
                time.sleep(0.2)

        reader = threading.Thread(target=read_metrics, daemon=True)
        reader.start()
        with ThreadPoolExecutor(2) as pool:
            started = time.monotonic()
            stuck = pool.submit(transcribe, server.grpc_url, "grpc", CARDS, prompt=STALL_PROMPT)
            time.sleep(1.0)
            behind = pool.submit(transcribe, server.http_url, "http", JFK)
            answers = [stuck.result(), behind.result()]
            seconds = time.monotonic() - started
        for answer, protocol in zip(answers, ("grpc", "http")):
            assert isinstance(answer, InferenceServerException), answer
            assert answer.status() == INTERNAL[protocol], answer
            message = answer.message()
            assert re.search(r"whisper instance whisper_0_0 on (cpu|\d+) made no progress for", message), message
            assert "while holding 2 requests; its engine thread is at faults.py" in message, message
        assert seconds < STALL_BOUND_S + 2 * STALL_CHECK_S + 10.0, f"answered after {seconds:.1f} s"
        status = launched.process.wait(timeout=GIVE_UP_TO_NOT_READY_S + STOP_GRACE_S + 30)
    reader.join(timeout=10)
    assert not unread, f"the metrics could not be read: {unread[0]}"
    assert stalled_seen.is_set(), "the metrics never said whisper_engine_stalled 1 and whisper_engine_healthy 0"
    log = server.log.read_text()
    assert status == 1, _log_tail(server.log)
    assert "a whisper engine failed repeatedly or stalled, and refuses new requests" in log
    assert "Every thread's stack" in log and "thread whisper-engine" in log
    assert re.search(r"Its parent's \(tritonserver, pid \d+\): \d+ x tritonserver ", log), _log_tail(server.log)


# Short bounds, but well above one loop turn of a first request on a busy 2-core machine:
# the stub's own stall watch reads the same bound.
FROZEN_BOUND_S = 10.0


@pytest.mark.server
def test_a_frozen_whisper_process_is_found_and_the_server_exits(tmp_path):
    """A whisper stub stopped outright (SIGSTOP: none of its threads runs, its stall watch
    neither, as with its interpreter lock held for good) stops publishing its metrics
    heartbeat. Triton fails the request it was handed (the stub does not answer its
    health check). The launcher finds the process within the stall bound and two
    publishes, names it, kills it and exits with status 1, without draining for the
    requests the frozen process's last publish still counts (Triton's own short exit
    timeout then covers the request it never releases)."""
    with launch_server(tmp_path, {STALL_TIMEOUT_ENV: str(FROZEN_BOUND_S)}, ("--engines", "1"), streamed_path=False) as launched:
        server = launched.server
        assert isinstance(transcribe(server.grpc_url, "grpc", CARDS), str)
        grpc_port = int(server.grpc_url.rpartition(":")[2])
        (stub,) = [s for s in stub_processes(grpc_port) if s.model == tensor_names.WHISPER_NAME]
        os.kill(stub.pid, signal.SIGSTOP)
        try:
            frozen_at = time.monotonic()
            held = transcribe(server.grpc_url, "grpc", CARDS)
            status = launched.process.wait(timeout=STOP_GRACE_S + 60)
            exited_s = time.monotonic() - frozen_at
        finally:
            if Path(f"/proc/{stub.pid}").exists():
                os.kill(stub.pid, signal.SIGKILL)
    assert isinstance(held, InferenceServerException) and held.status() == INTERNAL["grpc"], held
    assert "Stub process 'whisper_0_0' is not healthy" in held.message(), held.message()
    # Found within the bound, two publishes and a health poll; then Triton's stop.
    found_s = FROZEN_BOUND_S + 2 * PUBLISH_INTERVAL_S + HEALTH_POLL_S
    assert exited_s < found_s + EXIT_TIMEOUT_S + 10, f"exited {exited_s:.0f} s after the freeze"
    log = server.log.read_text()
    assert status == 1, _log_tail(server.log)
    assert 'instance="whisper_0_0"' in log and "published no metrics for over 12 s: its process is frozen" in log
    assert f"killed process {stub.pid}, so that the requests it held fail now" in log
    assert "waiting for 1 request in flight" not in log  # the drain left the killed process's requests out


def model_processes_gone(stubs: list, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{stub.pid}").exists() for stub in stubs) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not any(Path(f"/proc/{stub.pid}").exists() for stub in stubs)


# Every model's process checks for its parent every second (ParentWatch).
ORPHAN_EXIT_S = 2 * CHECK_INTERVAL_S + 5.0


def configured_instances() -> list[str]:
    """A model's name for each instance its config.pbtxt asks for (sorted): on this
    GPU-less host, whisper's KIND_AUTO group is one CPU instance."""
    names = []
    for config in packaged_model_repository().glob("*/config.pbtxt"):
        groups = load(config.parent.name).get("instance_group", [])
        names += [config.parent.name] * sum(one(group, "count") for group in groups)
    return sorted(names)


@pytest.mark.server
def test_no_model_process_outlives_a_killed_tritonserver(tmp_path):
    """tritonserver and the launcher killed at once (kill -9, nothing stops cleanly):
    every model's process ends by itself. Triton 2.51's own check leaves the whisper
    model's running once it has served a request; its ParentWatch ends it."""
    # The packaged repository as it is: every instance it asks for, not the tests' fewer.
    with launch_server(tmp_path, arguments=(f"--model-repository={packaged_model_repository()}",)) as launched:
        server = launched.server
        assert isinstance(transcribe(server.grpc_url, "grpc", CARDS), str)
        grpc_port = int(server.grpc_url.rpartition(":")[2])
        stubs = stub_processes(grpc_port)
        assert sorted(stub.model for stub in stubs) == configured_instances()
        launched.process.kill()
        os.kill(tritonserver_pid(grpc_port), signal.SIGKILL)
        launched.process.wait()
        assert model_processes_gone(stubs, ORPHAN_EXIT_S), [s for s in stubs if Path(f"/proc/{s.pid}").exists()]


# -------------------------------------------------------------------------- metrics


@pytest.mark.server
def test_metrics_follow_the_requests(server):
    before = settled(server)
    success = 'whisper_requests_total{outcome="success"}'
    client_errors = 'whisper_requests_total{outcome="client"}'
    for protocol in PROTOCOLS:
        assert isinstance(transcribe(server.url(protocol), protocol), str)
    assert isinstance(transcribe(server.http_url, "http", b"not audio at all"), InferenceServerException)
    bad = LogMel(np.full((80, 100), np.nan, np.float32), 16000)
    with pytest.raises(InferenceServerException):  # refused by the whisper model itself
        tritonclient.http.InferenceServerClient(server.http_url).infer(
            tensor_names.WHISPER_NAME, whisper_inputs(tritonclient.http, bad)
        )

    after = wait_for(server, lambda s: s[success] >= before[success] + 2 and s[client_errors] > before[client_errors])
    jfk_seconds = soundfile.info(AUDIO_DIR / "jfk.wav").duration
    assert after[success] == before[success] + 2
    assert after[client_errors] == before[client_errors] + 1
    assert after["whisper_audio_seconds_total"] == pytest.approx(before["whisper_audio_seconds_total"] + 2 * jfk_seconds)
    for histogram in ("whisper_request_duration_seconds", "whisper_real_time_factor", "whisper_queue_wait_seconds"):
        assert after[f"{histogram}_count"] >= before[f"{histogram}_count"] + 2, histogram
    # The two answers and the refusal were each sent once: their answer times follow, a publish
    # after their counts at most.
    count = "whisper_answer_seconds_count"
    answered = wait_for(server, lambda s: s[count] >= before[count] + 3)
    assert answered[count] >= before[count] + 3
    assert 0 < answered["whisper_answer_seconds_sum"] - before["whisper_answer_seconds_sum"] < 60
    assert after['whisper_decode_steps_total{path="eager"}'] > before['whisper_decode_steps_total{path="eager"}']
    assert after['whisper_decode_steps_total{path="cuda_graph"}'] == 0  # no GPU here
    assert after["whisper_decoding_slots"] >= 1
    assert after["whisper_request_limit"] >= after["whisper_decoding_slots"]
    idle = wait_for(server, lambda s: s["whisper_running_batch_size"] == 0 and s["whisper_requests_in_flight"] == 0)
    assert idle["whisper_running_batch_size"] == idle["whisper_requests_in_flight"] == idle["whisper_waiting_windows"] == 0
    # Each engine's process publishes its resident memory (whisper's and whisper_stream's
    # stubs here, summed), and, on the CPU, nothing of a GPU's.
    assert after["whisper_host_memory_bytes"] > 2 * 100 * 2**20, after["whisper_host_memory_bytes"]
    assert not [name for name in after if name.startswith("whisper_gpu_memory_bytes")]
    # Triton's own metrics are on the same port.
    assert after['nv_inference_request_success{model="transcribe",version="1"}'] >= 2
    # preprocessing's own, summed over its instances: both files' time after `execute`, in parts
    # (the file that is not audio failed before it had any). One publish flushes the four histograms.
    parts = [name for name, _ in PREPROCESSING_HISTOGRAMS.values()]
    grown = wait_for(server, lambda s: len({summed(s, f"{n}_count") - summed(before, f"{n}_count") for n in parts}) == 1
                     and summed(s, f"{parts[0]}_count") >= summed(before, f"{parts[0]}_count") + 2)
    seconds = {n: summed(grown, f"{n}_sum") - summed(before, f"{n}_sum") for n in parts}
    total, decode, log_mel, send = (seconds[PREPROCESSING_HISTOGRAMS[f][0]] for f in ("total", "decode", "log_mel", "send"))
    assert summed(grown, f"{parts[0]}_count") >= summed(before, f"{parts[0]}_count") + 2
    assert min(decode, log_mel, send) > 0 and decode + log_mel + send <= total * 1.0001 + 1e-6, seconds


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
    assert Activity.from_metrics(text) == Activity(busy=5, answered=11, unhealthy_engines=0, held=(("", 3.0),))
    engines = text + '\nwhisper_engine_healthy{gpu="0"} 1\nwhisper_engine_healthy{gpu="1"} 0'
    assert Activity.from_metrics(engines).unhealthy_engines == 1
    beats = text + ('\nwhisper_heartbeat_timestamp_seconds{gpu="0",instance="whisper_0_0"} 1000.5'
                    '\nwhisper_heartbeat_timestamp_seconds{gpu="1",instance="whisper_0_0"} 990')
    assert Activity.from_metrics(beats).frozen(now=1005.0, after_s=6.0) == ['{gpu="1",instance="whisper_0_0"}']
    assert Activity.from_metrics(beats).frozen(now=996.0, after_s=6.0) == []


def test_a_killed_frozen_instance_leaves_the_activity_that_the_drain_reads():
    one, other = '{gpu="0",instance="whisper_0_0"}', '{gpu="0",instance="whisper_0_1"}'
    text = "\n".join([
        f"whisper_requests_in_flight{one} 2", f"whisper_requests_in_flight{other} 1",
        f"whisper_process_id{one} 4321", f"whisper_process_id{other} 4322",
        f"whisper_heartbeat_timestamp_seconds{one} 900", f"whisper_heartbeat_timestamp_seconds{other} 1000",
        'nv_inference_pending_request_count{model="preprocessing",version="1"} 4',
    ])
    activity = Activity.from_metrics(text)
    assert activity.busy == 7 and dict(activity.pids) == {one: 4321, other: 4322}
    left = activity.without([one])
    assert left.busy == 5 and left.held == ((other, 1.0),) and left.frozen(now=1001.0, after_s=6.0) == []
    assert activity.without([]) is activity


# ----------------------------------------------------------------------- cancelling


def long_log_mel(minutes: float) -> LogMel:
    """LOG_MEL and SAMPLES as preprocessing writes them, for JFK repeated for `minutes`."""
    samples = decode_audio(JFK)
    return library_log_mel(np.tile(samples, int(np.ceil(minutes * 60 * geometry.SAMPLE_RATE / len(samples)))))


@pytest.mark.server
def test_a_cancelled_request_frees_its_slot(server):
    """A gRPC client cancels a 5-minute transcription (ten windows, decoded one after
    another) early: the engine drops it between decoder steps and the whisper model
    holds nothing any more, long before the transcription could have finished.

    The request goes to the whisper model directly: Triton 2.51's ensemble passes a
    cancellation only to steps not yet started (triton-inference-server/server#6739).
    """
    client = tritonclient.grpc.InferenceServerClient(server.grpc_url)
    inputs = whisper_inputs(tritonclient.grpc, long_log_mel(minutes=5))
    cancelled = 'whisper_requests_total{outcome="cancelled"}'
    before = settled(server)
    answers = []
    call = client.async_infer(tensor_names.WHISPER_NAME, inputs, callback=lambda *outcome: answers.append(outcome))
    running = wait_for(server, lambda s: s["whisper_requests_in_flight"] >= 1)
    assert running["whisper_requests_in_flight"] >= 1
    call.cancel()
    started = time.monotonic()
    freed = wait_for(server, lambda s: s["whisper_requests_in_flight"] == 0 and s[cancelled] > before[cancelled])
    assert freed["whisper_requests_in_flight"] == 0 and freed["whisper_running_batch_size"] == 0
    assert freed[cancelled] == before[cancelled] + 1
    assert time.monotonic() - started < METRICS_SETTLE_S
    assert isinstance(transcribe(server.grpc_url, "grpc"), str)  # and the server serves on


def whisper_call(client, log_mel: LogMel, answers: list, **parameters):
    """Send a log-mel to the whisper model directly; `answers` gets (seconds, result, error)."""
    started = time.monotonic()
    return client.async_infer(
        tensor_names.WHISPER_NAME, whisper_inputs(tritonclient.grpc, log_mel), parameters=parameters,
        callback=lambda result, error: answers.append((time.monotonic() - started, result, error)),
        client_timeout=REQUEST_TIMEOUT_S,
    )  # fmt: skip


def wait_for_answer(answers: list, timeout: float = REQUEST_TIMEOUT_S) -> tuple:
    deadline = time.monotonic() + timeout
    while not answers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert answers, f"no answer in {timeout:.0f} s"
    return answers[0]


FEW_SLOTS = 2


def decoder_steps(samples: dict[str, float]) -> float:
    """Decoder steps the whisper model has run, CUDA graphs and eager together."""
    return sum(value for name, value in samples.items() if name.startswith("whisper_decode_steps_total"))


def steps_the_recording_needs(log_mel: LogMel) -> int:
    """A floor on the decoder steps that decoding `log_mel` (JFK repeated) in batched mode
    takes on FEW_SLOTS slots: each 30 s window holds two whole JFK readings at least, a
    token a word at least, and FEW_SLOTS windows share a step."""
    jfk = next(clip for clip in clips() if clip.file == "jfk.wav")
    words_a_window = int(geometry.CHUNK_SECONDS // jfk.duration) * len(jfk.transcript.split())
    windows = log_mel.samples // geometry.N_SAMPLES
    return windows // FEW_SLOTS * words_a_window


@pytest.fixture(scope="module")
def few_slots_server(tmp_path_factory: pytest.TempPathFactory):
    """A server with FEW_SLOTS decoding slots and a drain of DRAIN_S: the cancelling test
    fills its slots, then the drain test stops it (one start for the two; neither
    setting touches what the other test checks)."""
    folder = tmp_path_factory.mktemp("few-slots-server")
    repository = model_repository_with(folder, "whisper", streamed_path=False, kv_slots=str(FEW_SLOTS))
    arguments = (f"--model-repository={repository}", "--drain-timeout", str(DRAIN_S))
    with launch_server(folder, arguments=arguments) as launched:
        yield launched


@pytest.mark.server
def test_cancelling_frees_a_full_servers_slots_for_the_request_behind_it(few_slots_server):
    """A server with FEW_SLOTS decoding slots, all held by one long recording
    decoded in batched mode (its twenty windows take every slot, the rest wait
    ahead of anything sent later). A short request waits behind it; the client
    cancels the recording, and the short request is admitted and answered, long
    before the recording could have been decoded.

    Counted in decoder steps, not seconds, so a busy machine cannot fail it: the
    recording ran fewer than half the steps its windows need. A server that
    kept the slots until the recording ended would run them all. That the engine drops
    a cancelled request between two steps is test_engine.py's and test_overlap.py's.
    """
    server = few_slots_server.server
    client = tritonclient.grpc.InferenceServerClient(server.grpc_url)
    assert settled(server)["whisper_decoding_slots"] == FEW_SLOTS
    short = library_log_mel(decode_audio(CARDS))
    alone = []  # twice: the first request of a fresh server warms it up
    for _ in range(2):
        answers = []
        before = decoder_steps(settled(server))
        whisper_call(client, short, answers)
        alone.append(wait_for_answer(answers))
    assert all(error is None for _, _, error in alone), alone
    steps_before = decoder_steps(settled(server))
    short_steps = steps_before - before
    reference = decoded_text(alone[-1][1], short.samples)
    assert reference and decoded_text(alone[0][1], short.samples) == reference

    long = long_log_mel(minutes=10)
    recording = []
    call = whisper_call(client, long, recording, long_form="batched")
    full = wait_for(server, lambda s: s["whisper_running_batch_size"] == FEW_SLOTS and s["whisper_waiting_windows"] > 0)
    assert full["whisper_running_batch_size"] == FEW_SLOTS and full["whisper_waiting_windows"] > 0, full
    waiting = []
    whisper_call(client, short, waiting)
    time.sleep(1.0)
    assert not waiting and not recording, "the slots were not all held"
    call.cancel()
    seconds, result, error = wait_for_answer(waiting)
    assert error is None, error
    assert decoded_text(result, short.samples) == reference
    idle = settled(server)
    assert idle['whisper_requests_total{outcome="cancelled"}'] == 1
    assert idle["whisper_running_batch_size"] == idle["whisper_waiting_windows"] == 0
    recording_steps = decoder_steps(idle) - steps_before - short_steps
    needs = steps_the_recording_needs(long)
    print(f"the recording ran {recording_steps:.0f} decoder steps; decoded whole, it needs {needs} at least")
    assert recording_steps < needs / 2


# ------------------------------------------------------------------------- shutdown


@pytest.mark.server
@pytest.mark.slow
def test_sigterm_answers_the_requests_in_flight(tmp_path):
    """`whisper-triton serve` waits for the requests in flight before stopping Triton
    (test_launcher.py checks an idle server stops cleanly). The drain may take as long
    as the machine needs: two 53 s clips may take more than the default 30 s on a busy
    2-core machine, and what a drain that runs out does is the next test's."""
    with launch_server(tmp_path, arguments=("--drain-timeout", "300"), streamed_path=False) as launched:
        server, process = launched.server, launched.process
        reference = transcribe(server.grpc_url, "grpc", SONNET)
        with ThreadPoolExecutor(max_workers=len(PROTOCOLS)) as pool:  # 53 s clips: two windows each, one after the other
            replies = [pool.submit(transcribe, server.url(p), p, SONNET) for p in PROTOCOLS]
            busy = wait_for(server, lambda s: s["whisper_requests_in_flight"] >= len(PROTOCOLS))
            assert busy["whisper_requests_in_flight"] >= len(PROTOCOLS)
            process.send_signal(signal.SIGTERM)
            outcomes = [reply.result(timeout=360) for reply in replies]
        assert outcomes == [reference] * len(PROTOCOLS), outcomes
        assert process.wait(timeout=90) == 0, _log_tail(server.log)
    said = server.log.read_text()
    assert re.search(r"stopping tritonserver", said)
    # Each model process's nanobind leak report (the triton package's) is not passed on,
    # nor Triton's routine lines glued to its end.
    assert "nanobind" not in said and "leaked" not in said and "live models" not in said, said[-3000:]


DRAIN_S = 2.0  # `serve --drain-timeout`: far shorter than the long request's decoding


def long_wav(minutes: float) -> bytes:
    """JFK repeated for `minutes`, as a 16 kHz WAV file."""
    samples = decode_audio(JFK)
    repeated = np.tile(samples, int(np.ceil(minutes * 60 * geometry.SAMPLE_RATE / len(samples))))
    out = io.BytesIO()
    soundfile.write(out, repeated, geometry.SAMPLE_RATE, format="WAV", subtype="PCM_16")
    return out.getvalue()


@pytest.mark.server
@pytest.mark.slow
def test_a_stop_answers_what_its_drain_could_not_finish(few_slots_server):
    """A request still decoding when the drain runs out fails at once with UNAVAILABLE
    naming the stop, and the server exits without waiting out Triton's own exit timeout
    (before, the client got no answer and the stop took the drain plus that timeout).
    The server is the cancelling test's (`serve --drain-timeout DRAIN_S`), stopped here."""
    server, process = few_slots_server.server, few_slots_server.process
    with ThreadPoolExecutor(max_workers=1) as pool:
        reply = pool.submit(transcribe, server.grpc_url, "grpc", long_wav(minutes=10))
        busy = wait_for(server, lambda s: s["whisper_requests_in_flight"] >= 1)
        assert busy["whisper_requests_in_flight"] >= 1
        stopped = time.monotonic()
        process.send_signal(signal.SIGTERM)
        error = reply.result(timeout=REQUEST_TIMEOUT_S)
        answered_s = time.monotonic() - stopped
    assert isinstance(error, InferenceServerException), error
    assert error.status() == UNAVAILABLE["grpc"], error
    assert "server unavailable: the server stopped before this request was transcribed" in error.message()
    assert answered_s < DRAIN_S + 10.0, f"answered {answered_s:.1f} s after SIGTERM"
    assert process.wait(timeout=DRAIN_S + 60.0) == 0, _log_tail(server.log)
    stopped_s = time.monotonic() - stopped
    said = server.log.read_text()
    assert "exit timeout" not in said, said[-3000:]
    assert stopped_s < DRAIN_S + 30.0, f"stopped {stopped_s:.1f} s after SIGTERM"
