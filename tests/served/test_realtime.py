"""The gateway's live transcription session (/v1/realtime?intent=transcription): a real
WebSocket client (`websockets`) streams real recordings, in chunks and at about the
speed of speech, to the real gateway in front of the real server."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import difflib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
import soxr
from conftest import AUDIO_DIR, RunningServer, _log_tail, _stop, free_port, whisper_triton_command
from reference import clips, normalize
from test_faults import scrape, settled, wait_for

from gateway.workers import STARTUP_S
from loadtest.processes import child_pids, cmdline, state
from python_backend_lib.serving.metrics import PUBLISH_INTERVAL_S

websockets = pytest.importorskip("websockets")
openai = pytest.importorskip("openai")
from websockets.asyncio.client import connect  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

RATE = 24_000  # what the Realtime API takes
CHUNK_S = 0.1
KNOWN = {clip.file: clip.transcript for clip in clips()}
EVENT_TIMEOUT_S = 120  # a generous bound for one event on a busy 2-core CPU
COMPLETED = "conversation.item.input_audio_transcription.completed"
DELTA = "conversation.item.input_audio_transcription.delta"
CANCELLED = 'whisper_requests_total{outcome="cancelled"}'
MANUAL = {"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
    "format": {"type": "audio/pcm", "rate": RATE}, "transcription": {"model": "whisper-1", "language": "en"},
    "turn_detection": None}}}}


def pcm24(*parts: str | float) -> np.ndarray:
    """Recordings (file names) and silences (seconds) one after another, as 24 kHz int16."""
    pieces = []
    for part in parts:
        if isinstance(part, str):
            audio, rate = soundfile.read(AUDIO_DIR / part, dtype="float32")
            pieces.append(soxr.resample(audio, rate, RATE))
        else:
            pieces.append(np.zeros(int(part * RATE), np.float32))
    return (np.clip(np.concatenate(pieces), -1, 1) * 32767).round().astype("<i2")


def at_16k(audio: np.ndarray) -> np.ndarray:
    """What the session turns the 24 kHz audio into, in one go."""
    return soxr.resample(audio.astype(np.float32) / 32768.0, RATE, 16_000)


def offline(client, audio16: np.ndarray, tmp_path: Path) -> str:
    """The transcript of 16 kHz audio as a file, through the gateway's batch endpoint: a
    float WAV, so that the file holds the very samples the live session sends (pcm_f32le)."""
    path = tmp_path / f"turn-{time.monotonic_ns()}.wav"
    soundfile.write(path, audio16, 16_000, subtype="FLOAT")
    with path.open("rb") as audio:
        text = client.audio.transcriptions.create(model="whisper-1", file=audio, response_format="text", language="en")
    return text.strip()


@dataclass
class Recorder:
    """A session's server events, in order, and when each came relative to what was sent."""

    socket: object
    events: list[dict] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # time.monotonic() when each event came
    sent_all_at: int | None = None  # how many events had come when the last audio was sent

    async def next(self, kind: str | None = None) -> dict:
        while True:
            event = json.loads(await asyncio.wait_for(self.socket.recv(), EVENT_TIMEOUT_S))
            self.add(event)
            if kind is None or event["type"] == kind:
                return event

    async def until(self, kind: str, count: int = 1) -> None:
        while sum(e["type"] == kind for e in self.events) < count:
            await self.next()

    def add(self, event: dict) -> None:
        self.events.append(event)
        self.times.append(time.monotonic())

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]


async def stream(recorder: Recorder, audio: np.ndarray, speed: float = 1.0) -> None:
    """Appends `audio` in CHUNK_S chunks at `speed` times real time, reading events as they come."""
    step = int(CHUNK_S * RATE)
    start = time.monotonic()
    for index, offset in enumerate(range(0, len(audio), step)):
        chunk = audio[offset:offset + step].tobytes()
        await recorder.socket.send(json.dumps({"type": "input_audio_buffer.append",
                                               "audio": base64.b64encode(chunk).decode()}))
        due = start + (index + 1) * CHUNK_S / speed
        while (wait := due - time.monotonic()) > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                recorder.add(json.loads(await asyncio.wait_for(recorder.socket.recv(), wait)))
    recorder.sent_all_at = len(recorder.events)


async def manual_session(socket) -> Recorder:
    """A new session's recorder, once the session commits turns by hand (turn_detection null)."""
    recorder = Recorder(socket)
    await recorder.next("session.created")
    await socket.send(json.dumps(MANUAL))
    await recorder.next("session.updated")
    return recorder


async def append_at_once(socket, *recordings: str) -> None:
    """Whole recordings, one after another, in one append."""
    audio = base64.b64encode(pcm24(*recordings).tobytes()).decode()
    await socket.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))


def realtime_url(gateway: str) -> str:
    return gateway.replace("http://", "ws://") + "/realtime?intent=transcription"


def check_deltas(recorder: Recorder, item_id: str, transcript: str) -> None:
    """The item's deltas only add text; joined, they hold every word of the turn's transcript in
    its place (none lost), and differ from it only where two sure hypotheses misread a stretch
    that the whole turn reads otherwise: on real hypotheses up to 1.8% of the words committed early
    (docs/benchmarks/live-agreement, tests/unit/test_local_agreement.py), here at most one in ten."""
    deltas = [e["delta"] for e in recorder.of(DELTA) if e["item_id"] == item_id]
    assert deltas, "no delta for the item"
    assert all(d.strip() for d in deltas)
    said, heard = normalize("".join(deltas)), normalize(transcript)
    opcodes = difflib.SequenceMatcher(a=said, b=heard, autojunk=False).get_opcodes()
    lost = [heard[j1:j2] for op, _, _, j1, j2 in opcodes if op == "insert"]
    assert not lost, f"the deltas {said} lost {lost} of the transcript {heard}"
    misread = sum(i2 - i1 for op, i1, i2, _, _ in opcodes if op != "equal")
    assert misread <= max(1, len(heard) // 10), f"the deltas {said} misread the transcript {heard}"


@pytest.fixture(scope="module")
def client(gateway: str):
    with openai.OpenAI(base_url=gateway, api_key="unused", max_retries=0) as openai_client:
        yield openai_client


def test_a_committed_turn_shows_text_while_speaking_and_ends_with_the_offline_transcript(gateway, client, tmp_path):
    audio = pcm24("jfk.wav")

    async def session() -> Recorder:
        async with connect(realtime_url(gateway)) as socket:
            recorder = Recorder(socket)
            created = await recorder.next()
            assert created["type"] == "session.created"
            assert created["session"]["type"] == "transcription"
            await socket.send(json.dumps(MANUAL))
            updated = await recorder.next("session.updated")
            assert updated["session"]["audio"]["input"]["turn_detection"] is None
            started = time.monotonic()
            await stream(recorder, audio)
            sent = time.monotonic()
            # Text of the turn before it ends: hypotheses of the growing audio (however slow the CPU).
            await recorder.until(DELTA)
            committed = time.monotonic()
            await socket.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await recorder.until(COMPLETED)
            first_delta = recorder.times[[e["type"] for e in recorder.events].index(DELTA)]
            print(f"first delta {first_delta - started:.1f} s after the audio began; "
                  f"{sum(e['type'] == DELTA for e in recorder.events[:recorder.sent_all_at])} deltas while it was sent "
                  f"({sent - started:.1f} s); "
                  f"completed {recorder.times[-1] - committed:.1f} s after the commit")
            return recorder

    recorder = asyncio.run(session())
    kinds = [e["type"] for e in recorder.events]
    assert kinds[:2] == ["session.created", "session.updated"]
    assert set(kinds) == {"session.created", "session.updated", DELTA, "input_audio_buffer.committed", COMPLETED}
    committed, completed = recorder.of("input_audio_buffer.committed")[0], recorder.of(COMPLETED)[0]
    item_id = committed["item_id"]
    assert completed["item_id"] == item_id and all(e["item_id"] == item_id for e in recorder.of(DELTA))
    assert kinds.index(COMPLETED) == len(kinds) - 1
    # Text came before the turn was committed.
    assert kinds.index(DELTA) < kinds.index("input_audio_buffer.committed")
    check_deltas(recorder, item_id, completed["transcript"])
    assert completed["transcript"] == offline(client, at_16k(audio), tmp_path)
    assert normalize(completed["transcript"]) == normalize(KNOWN["jfk.wav"])
    assert completed["usage"]["type"] == "duration"
    assert completed["usage"]["seconds"] == pytest.approx(len(audio) / RATE, abs=0.01)


def test_server_vad_cuts_turns_at_the_silences(gateway, client, tmp_path):
    first, second = "input_2_16k.wav", "sense_and_sensibility_01_austen_64kb-0930.wav"
    audio = pcm24(1.0, first, 1.5, second, 1.5)
    vad = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 700}

    async def session() -> Recorder:
        async with connect(realtime_url(gateway)) as socket:
            recorder = Recorder(socket)
            await recorder.next("session.created")
            await socket.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {
                "input": {"transcription": {"model": "tiny.en", "language": "en"}, "turn_detection": vad}}}}))
            updated = await recorder.next("session.updated")
            assert updated["session"]["audio"]["input"]["turn_detection"] == vad
            await stream(recorder, audio, speed=2.0)
            await recorder.until(COMPLETED, 2)
            return recorder

    recorder = asyncio.run(session())
    per_item = {}
    for event in recorder.events:
        if "item_id" in event:
            per_item.setdefault(event["item_id"], []).append(event["type"])
    assert len(per_item) == 2
    for kinds in per_item.values():
        without_deltas = [k for k in kinds if k != DELTA]
        assert without_deltas == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                                  "input_audio_buffer.committed", COMPLETED]
    starts, stops = recorder.of("input_audio_buffer.speech_started"), recorder.of("input_audio_buffer.speech_stopped")
    audio16 = at_16k(audio)
    for clip, start, stop, completed in zip((first, second), starts, stops, recorder.of(COMPLETED)):
        assert normalize(completed["transcript"]) == normalize(KNOWN[clip])
        turn = audio16[start["audio_start_ms"] * 16:stop["audio_end_ms"] * 16]
        assert completed["transcript"] == offline(client, turn, tmp_path)
        check_deltas(recorder, completed["item_id"], completed["transcript"])
    # The turns lie where the recordings are: the first starts within its leading second of silence.
    assert 0.5 <= starts[0]["audio_start_ms"] / 1000 <= 1.0
    assert recorder.of("input_audio_buffer.committed")[1]["previous_item_id"] == recorder.of(COMPLETED)[0]["item_id"]


BAD_EVENTS = [
    ("not json", "invalid_json"),
    (json.dumps(["a list"]), "invalid_event"),
    (json.dumps({"type": "response.create", "event_id": "mine"}), "invalid_event"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": "%%%"}), "invalid_value"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()}), "invalid_value"),
    (json.dumps({"type": "input_audio_buffer.commit"}), "input_audio_buffer_commit_empty"),
    (json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 16000}}}}}), "unsupported_value"),
    (json.dumps({"type": "session.update", "session": {"audio": {"input": {"transcription": {
        "model": "gpt-4o-transcribe"}}}}}), "model_not_found"),
    (json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "server_vad", "threshold": 2}}}}}), "invalid_value"),
    (json.dumps({"type": "transcription_session.update", "session": {"input_audio_format": "g711_ulaw"}}),
     "invalid_value"),
]


def test_a_bad_event_gets_an_error_and_the_session_goes_on(gateway):
    clip = "cards_001.wav"

    async def session() -> tuple[list[dict], Recorder]:
        async with connect(realtime_url(gateway)) as socket:
            recorder = Recorder(socket)
            await recorder.next("session.created")
            await socket.send(json.dumps({"type": "transcription_session.update", "session": {
                "input_audio_format": "pcm16", "input_audio_transcription": {"model": "whisper-1", "language": "en"},
                "turn_detection": None}}))
            updated = await recorder.next()
            assert updated["type"] == "transcription_session.updated"
            assert updated["session"]["input_audio_format"] == "pcm16"
            assert updated["session"]["turn_detection"] is None
            errors = []
            for message, _ in BAD_EVENTS:
                await socket.send(message)
                errors.append(await recorder.next())
            await stream(recorder, pcm24(clip), speed=4.0)
            await socket.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await recorder.until(COMPLETED)
            return errors, recorder

    errors, recorder = asyncio.run(session())
    for error, (message, code) in zip(errors, BAD_EVENTS):
        assert error["type"] == "error", message
        assert error["error"]["type"] == "invalid_request_error"
        assert error["error"]["code"] == code, (message, error)
        assert error["error"]["message"]
    assert errors[2]["error"]["event_id"] == "mine"
    assert normalize(recorder.of(COMPLETED)[0]["transcript"]) == normalize(KNOWN[clip])


def test_clear_drops_the_buffered_audio(gateway):
    async def session() -> Recorder:
        async with connect(realtime_url(gateway)) as socket:
            recorder = await manual_session(socket)
            await stream(recorder, pcm24("cards_003.wav"), speed=8.0)
            await socket.send(json.dumps({"type": "input_audio_buffer.clear"}))
            await recorder.next("input_audio_buffer.cleared")
            await stream(recorder, pcm24("cards_001.wav"), speed=8.0)
            await socket.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await recorder.until(COMPLETED)
            return recorder

    recorder = asyncio.run(session())
    (completed,) = recorder.of(COMPLETED)
    assert normalize(completed["transcript"]) == normalize(KNOWN["cards_001.wav"])
    assert {e["item_id"] for e in recorder.of(DELTA)} <= {completed["item_id"]}


@dataclass(frozen=True)
class OwnGateway:
    url: str  # its base URL
    log: Path
    pid: int


def _answers(port: int) -> bool:
    """Whether a gateway on `port` answers /v1/models."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1):
            return True
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@contextlib.contextmanager
def own_gateway(server: RunningServer, folder: Path, *arguments: str):
    """A gateway of this test's own in front of the session server: yields an `OwnGateway`."""
    port = free_port()
    log = folder / "gateway.log"
    command = whisper_triton_command() + ["gateway", f"--triton-url={server.grpc_url}", f"--port={port}", *arguments]
    with log.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 60
        while not _answers(port):
            assert process.poll() is None and time.monotonic() < deadline, _log_tail(log)
            time.sleep(0.2)
        yield OwnGateway(base_url, log, process.pid)
    finally:
        _stop(process, "whisper-triton gateway", log)


def test_the_session_limit_refuses_one_more_and_a_client_that_leaves_frees_its_slot(server, tmp_path):
    before = settled(server)
    with own_gateway(server, tmp_path, "--max-live-sessions=1") as gateway:
        base_url, url = gateway.url, realtime_url(gateway.url)

        async def refused() -> tuple[dict, int]:
            async with connect(url) as socket:
                event = json.loads(await socket.recv())
                with pytest.raises(websockets.ConnectionClosed):
                    await socket.recv()
                return event, socket.close_code

        async def sessions() -> None:
            first = await connect(url)
            await manual_session(first)
            event, code = await refused()
            assert event["type"] == "error" and event["error"]["code"] == "session_limit_reached"
            assert code == 1013
            # A recording at once: the client leaves while the server decodes a hypothesis of it.
            # It must outlast what the test takes to see it in flight (the metrics are published
            # every second): 107 s of speech, decoded in about 9 s on two cores, where JFK's 11 s
            # took under one and sometimes finished before the client left.
            await append_at_once(first, "sonnet1_longform.wav", "sonnet1_longform.wav")
            decoding = await asyncio.to_thread(wait_for, server, lambda s: s["whisper_requests_in_flight"] >= 1)
            assert decoding["whisper_requests_in_flight"] >= 1, "no hypothesis was decoded"
            first.transport.abort()  # gone without a closing handshake
            deadline = time.monotonic() + 30
            while True:
                async with connect(url) as again:
                    event = json.loads(await again.recv())
                    if event["type"] == "session.created":
                        break
                    assert event["error"]["code"] == "session_limit_reached"
                    assert time.monotonic() < deadline, "the slot of the client that left was never freed"
                await asyncio.sleep(0.2)

        asyncio.run(sessions())

        async def wrong_intent() -> tuple[dict, int]:
            async with connect(base_url.replace("http://", "ws://") + "/realtime?model=gpt-4o-realtime") as socket:
                event = json.loads(await socket.recv())
                with pytest.raises(websockets.ConnectionClosed):
                    await socket.recv()
                return event, socket.close_code

        event, code = asyncio.run(wrong_intent())
        assert event["error"]["code"] == "invalid_intent" and code == 1008
    # The hypothesis in flight when the client left was cancelled on the server, and nothing is left running.
    after = wait_for(server, lambda s: s[CANCELLED] > before[CANCELLED] and s["whisper_requests_in_flight"] == 0)
    assert after[CANCELLED] == before[CANCELLED] + 1
    assert after["whisper_requests_in_flight"] == 0


def worker_pids(gateway_pid: int) -> set[int]:
    """The worker processes of a gateway started with --workers: its spawned children (not
    multiprocessing's resource tracker), less any reaped since they were listed."""
    return {pid for pid in child_pids(gateway_pid) if any("spawn_main" in a for a in cmdline(pid))}


def connection_owner(client_port: int, pids: set[int]) -> int:
    """Which of `pids` holds the server's end of the TCP connection from our `client_port`."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[2].rsplit(":", 1)[1], 16) == client_port:  # the remote end is ours
                inodes.add(f"socket:[{fields[9]}]")
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if os.readlink(fd) in inodes:
                    return pid
    raise AssertionError(f"no worker of {sorted(pids)} holds the connection from port {client_port}")


def test_gateway_workers_keep_one_session_limit_and_a_dead_one_is_replaced(server, tmp_path):
    """--workers 2 --max-live-sessions 2: with a session on each worker, one more is refused
    wherever it lands (the limit is the gateway's, not each worker's). A worker killed with
    its session is started again, and that session's slot is free again."""
    with own_gateway(server, tmp_path, "--workers=2", "--max-live-sessions=2") as gateway:
        ready, url = time.monotonic(), realtime_url(gateway.url)
        deadline = ready + 60
        while len(workers := worker_pids(gateway.pid)) < 2:
            assert time.monotonic() < deadline, _log_tail(gateway.log)
            time.sleep(0.2)

        async def opened() -> tuple[Any, dict]:
            socket = await connect(url)
            return socket, json.loads(await socket.recv())

        async def sessions() -> None:
            first, event = await opened()
            assert event["type"] == "session.created"
            first_owner = connection_owner(first.local_address[1], workers)
            for _ in range(100):  # until a session lands on the other worker
                second, event = await opened()
                if event["type"] == "session.created" and connection_owner(second.local_address[1],
                                                                           workers) != first_owner:
                    break
                await second.close()  # on the same worker, or refused while a closed one's slot was still held
                await asyncio.sleep(0.05)
            else:
                pytest.fail("every session went to the same worker")
            for _ in range(4):
                third, event = await opened()
                assert event["type"] == "error" and event["error"]["code"] == "session_limit_reached"
                await third.close()
            # A worker that dies as it starts stops the gateway; one that served for a while is replaced.
            await asyncio.sleep(max(0.0, ready + STARTUP_S + 1 - time.monotonic()))
            os.kill(first_owner, signal.SIGKILL)
            with pytest.raises(websockets.ConnectionClosed):
                await asyncio.wait_for(first.recv(), EVENT_TIMEOUT_S)
            deadline = time.monotonic() + 60
            while len(now := worker_pids(gateway.pid)) < 2 or first_owner in now:
                assert time.monotonic() < deadline, "the killed worker was not replaced"
                await asyncio.sleep(0.1)
            again, event = await opened()  # the second session holds one slot of two
            assert event["type"] == "session.created", event
            await again.close()
            await second.close()

        asyncio.run(sessions())
    assert "ended with exit code -9: starting another" in gateway.log.read_text()


def test_the_hypothesis_cadence_is_the_gateways_option(server, tmp_path):
    """With `--live-hypothesis-every 30`, a turn of 11 s grows by less than that: it gets no
    hypothesis, and its only transcription is the final one at the commit, which brings every
    word in one delta. (With the default, appending the same audio at once starts a hypothesis:
    the session-limit test above waits for it.)"""
    with own_gateway(server, tmp_path, "--live-hypothesis-every=30") as gateway:
        base_url, before = gateway.url, settled(server)
        success = 'whisper_requests_total{outcome="success"}'

        async def session() -> Recorder:
            async with connect(realtime_url(base_url)) as socket:
                recorder = await manual_session(socket)
                await append_at_once(socket, "jfk.wav")
                await asyncio.sleep(2 * PUBLISH_INTERVAL_S)
                assert scrape(server)["whisper_requests_in_flight"] == 0, "a hypothesis was decoded"
                await socket.send(json.dumps({"type": "input_audio_buffer.commit"}))
                await recorder.next(COMPLETED)
                return recorder

        recorder = asyncio.run(session())
        after = settled(server)
    (completed,) = recorder.of(COMPLETED)
    deltas = [e["delta"] for e in recorder.of(DELTA)]
    assert len(deltas) == 1 and normalize(deltas[0]) == normalize(completed["transcript"])
    assert normalize(completed["transcript"]) == normalize(KNOWN["jfk.wav"])
    assert after.get(success, 0) == before.get(success, 0) + 1
    assert after.get(CANCELLED, 0) == before.get(CANCELLED, 0)  # no hypothesis was started and dropped


def test_a_cadence_of_no_time_is_refused_when_the_gateway_starts():
    completed = subprocess.run(whisper_triton_command() + ["gateway", "--live-hypothesis-every=0"],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
    assert completed.returncode == 2
    assert completed.stderr == ("whisper-triton gateway: a live hypothesis every 0 s: give more than 0 s "
                                "and at most 30 s (one 30 s window)\n")


def test_gateway_workers_stop_when_their_parent_is_killed(tmp_path):
    """No Triton needed: the workers serve /v1/models. With the parent gone (SIGKILL: it
    cannot stop them), they stop by themselves and the port is free again."""
    port, log = free_port(), tmp_path / "gateway.log"
    command = whisper_triton_command() + ["gateway", "--triton-url=localhost:1", f"--port={port}", "--workers=2"]
    with log.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while len(workers := worker_pids(process.pid)) < 2 or not _answers(port):
            assert process.poll() is None and time.monotonic() < deadline, _log_tail(log)
            time.sleep(0.2)
        process.kill()
        process.wait()
        deadline = time.monotonic() + 30
        while any(state(pid) not in ("", "Z") for pid in workers):
            assert time.monotonic() < deadline, f"workers outlived their parent:\n{_log_tail(log)}"
            time.sleep(0.2)
        assert not _answers(port)
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        for pid in workers:  # the parent's children no more: reparented once it died
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_worker_count_out_of_range_is_refused_when_the_gateway_starts():
    completed = subprocess.run(whisper_triton_command() + ["gateway", "--workers=0"],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
    assert completed.returncode == 2
    assert completed.stderr == "whisper-triton gateway: --workers must be between 1 and 64, got 0\n"
