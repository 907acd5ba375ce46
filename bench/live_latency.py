"""Live sessions' latency: from the end of a spoken word to the delta that shows it.

`--sessions` Realtime transcription sessions (/v1/realtime on the gateway) each
stream the same speech, 24 kHz pcm16 in 100 ms chunks at the speed of speech,
with server_vad turn detection: recordings of tests/data/audio with pauses
between them (STREAM). The sessions start spread over one second.

- Word latency: each recording is also transcribed as a file through the
  gateway, with word timestamps: those words, placed where the recording sits
  in the stream, are the reference. The words of a session's deltas are matched
  to them in order (difflib); a word's latency is when the delta carrying it
  came, less when its audio was sent (the stream's start plus the word's end).
- Turn latency: from the end of a turn's speech (speech_stopped's
  audio_end_ms) to its completed transcript.
- Keeping up: whether the sessions sent their audio on time (the largest lag
  of a chunk behind its due time) and whether latency grew along the stream
  (p50 of the first and of the second half of the words).
- `--batch-concurrency N` adds a last row: the last session count again, with
  batch load beside the sessions: N gRPC clients, in a process of their own,
  sending the same recordings to `transcribe` one after another; their RTFx is
  measured alone first, for as long as the stream, then beside the sessions.
  Each batch request has a timeout (BATCH_TIMEOUT_S); every one is counted as
  answered or failed with its reason, and every turn as completed or not.
- The sessions' side: the sessions run in processes of their own, at most
  SESSIONS_PER_PROCESS each, all started for one moment, so that one event loop
  is not what bounds many sessions; a session's start late past that moment
  counts as send lag.
- Per whisper instance: each instance's answered requests in the row and the
  instances that stalled, from the server's metrics, so that one stuck instance
  does not hide behind a healthy total.
- CPU: the gateway's processes' cores (`--gateway-workers`: how many it runs)
  and the sessions' processes' (in all, and the busiest one's), so that a row
  says which was busy.

The server is started here (`--checkpoint`, as `whisper-triton serve` takes it)
with a gateway in front, unless `--gateway` and `--triton-grpc` name running ones.

    python -m bench.live_latency --out docs/benchmarks/live-cpu
    python -m bench.live_latency --sessions 100 --batch-concurrency 64 --out DIR   # on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import contextlib
import dataclasses
import difflib
import json
import multiprocessing
import os
import random
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import soundfile
import soxr

from bench.clips import AUDIO_DIR
from bench.host import process_cpu_seconds
from bench.load import error_reason
from bench.server_process import ServeCommand, ServerProcess, free_port, whisper_triton
from gateway.local_agreement import comparison_key
from loadtest.metrics import per_instance
from loadtest.outcomes import status_name
from loadtest.processes import child_pids
from loadtest.provenance import commit_info, machine_info
from python_backend_lib.audio.encode import wav_bytes

RATE = 24_000  # what the Realtime API takes
CHUNK_S = 0.1
PAUSE_S = 1.5  # between recordings: server_vad cuts a turn after 0.7 s of it
STREAM = ("jfk.wav", "sense_and_sensibility_01_austen_64kb-0870.wav",
          "sense_and_sensibility_01_austen_64kb-0920.wav", "sense_and_sensibility_01_austen_64kb-0890.wav",
          "input_2_16k.wav", "sense_and_sensibility_01_austen_64kb-0930.wav")
VAD = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 700}
MODEL = "whisper-1"
EVENT_TIMEOUT_S = 300.0
# Sessions a process runs: one event loop carried 200 at 0.9 of a core, chunks then
# up to 0.9 s late (live run 14), so more spread over several stay far from a core each.
SESSIONS_PER_PROCESS = 50
# From the sessions' processes being asked to start to the moment their sessions begin:
# time for a spawned interpreter to import what a session needs.
SESSIONS_START_S = 5.0
# A batch request not answered by then is counted failed (DEADLINE_EXCEEDED) and the client sends the next.
BATCH_TIMEOUT_S = 60.0
STARTUP_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class ReferenceWord:
    key: str  # local_agreement.comparison_key
    end_s: float  # in the stream


@dataclass(frozen=True)
class Stream:
    pcm: np.ndarray  # 24 kHz int16
    words: tuple[ReferenceWord, ...]

    @property
    def seconds(self) -> float:
        return len(self.pcm) / RATE


def stream_audio(names: tuple[str, ...] = STREAM) -> tuple[np.ndarray, list[tuple[str, float, np.ndarray]]]:
    """The stream of these recordings at 24 kHz (float), and each recording: its name, its
    start in the stream, its 16 kHz audio."""
    pieces, placed, position = [np.zeros(int(PAUSE_S * RATE), np.float32)], [], PAUSE_S
    for name in names:
        audio, rate = soundfile.read(AUDIO_DIR / name, dtype="float32")
        placed.append((name, position, audio))
        resampled = soxr.resample(audio, rate, RATE)
        pieces += [resampled, np.zeros(int(PAUSE_S * RATE), np.float32)]
        position += len(resampled) / RATE + PAUSE_S
    return np.concatenate(pieces), placed


def reference_stream(gateway: str, names: tuple[str, ...] = STREAM) -> Stream:
    """The stream, and its words timed by transcribing each recording as a file."""
    import openai

    audio, placed = stream_audio(names)
    words = []
    with openai.OpenAI(base_url=gateway, api_key="unused", max_retries=0, timeout=600) as client:
        for name, start_s, recording in placed:
            reply = client.audio.transcriptions.create(
                model=MODEL, file=(name, wav_bytes(recording)), response_format="verbose_json",
                timestamp_granularities=["word"], language="en",
            )  # fmt: skip
            words += [ReferenceWord(comparison_key(w.word), start_s + w.end) for w in reply.words]
    pcm = (np.clip(audio, -1, 1) * 32767).round().astype("<i2")
    return Stream(pcm, tuple(w for w in words if w.key))


# ------------------------------------------------------------- one session


@dataclass
class SessionResult:
    word_latencies_s: list[float] = field(default_factory=list)  # in the order of the stream's words
    matched: int = 0
    reference_words: int = 0
    first_delta_s: float | None = None  # after the stream began
    turn_latencies_s: list[float] = field(default_factory=list)  # speech end to completed
    turns: int = 0
    max_send_lag_s: float = 0.0
    errors: list[str] = field(default_factory=list)


async def live_session(url: str, stream: Stream, begin: float) -> SessionResult:
    """One session, from `begin` (time.monotonic(), shared by every process of the host)."""
    from websockets.asyncio.client import connect

    await asyncio.sleep(max(0.0, begin - time.monotonic()))
    result = SessionResult(reference_words=len(stream.words))
    result.max_send_lag_s = max(0.0, time.monotonic() - begin)  # a process that started late
    deltas: list[tuple[float, str]] = []  # (arrival, text)
    stopped: dict[str, float] = {}  # item -> its speech's end, in the stream (s)
    completed: dict[str, float] = {}  # item -> arrival
    async with connect(url, max_size=None, open_timeout=60) as socket:
        await socket.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {
            "input": {"format": {"type": "audio/pcm", "rate": RATE},
                      "transcription": {"model": MODEL, "language": "en"}, "turn_detection": VAD}}}}))

        async def receive() -> None:
            async for message in socket:
                event, now = json.loads(message), time.monotonic()
                kind = event["type"]
                if kind == "conversation.item.input_audio_transcription.delta":
                    deltas.append((now, event["delta"]))
                elif kind == "input_audio_buffer.speech_stopped":
                    stopped[event["item_id"]] = event["audio_end_ms"] / 1000
                elif kind == "conversation.item.input_audio_transcription.completed":
                    completed[event["item_id"]] = now
                elif kind in ("error", "conversation.item.input_audio_transcription.failed"):
                    result.errors.append(json.dumps(event)[:300])

        receiver = asyncio.create_task(receive())
        step = int(CHUNK_S * RATE)
        started = time.monotonic()
        for index, offset in enumerate(range(0, len(stream.pcm), step)):
            due = started + index * CHUNK_S
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            result.max_send_lag_s = max(result.max_send_lag_s, time.monotonic() - due)
            chunk = stream.pcm[offset:offset + step].tobytes()
            await socket.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(chunk).decode()}))
        deadline = time.monotonic() + EVENT_TIMEOUT_S
        while (len(completed) < len(stopped) or not stopped) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        receiver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await receiver
    result.turns = len(stopped)
    result.turn_latencies_s = [completed[item] - (started + end) for item, end in stopped.items() if item in completed]
    if deltas:
        result.first_delta_s = deltas[0][0] - started
    result.word_latencies_s = word_latencies(deltas, stream.words, started)
    result.matched = len(result.word_latencies_s)
    return result


def word_latencies(deltas: list[tuple[float, str]], words: tuple[ReferenceWord, ...], started: float) -> list[float]:
    """For each reference word a delta carried (matched in order), when that delta came less
    when the word's end was sent: `started` plus its place in the stream."""
    said = [(arrival, comparison_key(word)) for arrival, text in deltas for word in text.split()]
    said = [(arrival, key) for arrival, key in said if key]
    matcher = difflib.SequenceMatcher(a=[k for _, k in said], b=[w.key for w in words], autojunk=False)
    return [said[block.a + k][0] - (started + words[block.b + k].end_s)
            for block in matcher.get_matching_blocks() for k in range(block.size)]


def session_shares(sessions: int, per_process: int) -> list[list[int]]:
    """The sessions' numbers each process runs: as few processes as hold `per_process`
    each, dealt round, so that each process's sessions begin spread over the same second."""
    processes = max(1, -(-sessions // per_process))
    return [list(range(first, sessions, processes)) for first in range(min(processes, sessions))]


def session_begin(index: int, sessions: int, start_at: float) -> float:
    """When session `index` of `sessions` begins: spread over one second after `start_at`."""
    return start_at + (random.Random(index).uniform(0, 1.0) if sessions > 1 else 0.0)


def _sessions_here(url: str, stream: Stream, indices: list[int], sessions: int,
                   start_at: float) -> tuple[list[SessionResult], float]:
    """In a process of the sessions' side: its sessions, and the cores it kept busy from
    their start to their end (its CPU seconds over that time)."""
    async def run() -> list[SessionResult]:
        return list(await asyncio.gather(*(live_session(url, stream, session_begin(i, sessions, start_at))
                                           for i in indices)))

    before = _own_cpu_s()
    results = asyncio.run(run())
    return results, (_own_cpu_s() - before) / max(time.monotonic() - start_at, 1e-3)


async def sessions_apart(
    url: str, stream: Stream, sessions: int, per_process: int = SESSIONS_PER_PROCESS
) -> tuple[list[SessionResult], list[float]]:
    """`sessions` live sessions in processes of their own (`session_shares`): every
    session's result, in session order, and each process's cores (`_sessions_here`)."""
    shares = session_shares(sessions, per_process)
    start_at = time.monotonic() + SESSIONS_START_S
    context = multiprocessing.get_context("spawn")  # no inherited event loop or gRPC threads
    loop = asyncio.get_running_loop()
    with concurrent.futures.ProcessPoolExecutor(len(shares), mp_context=context) as pool:
        done = await asyncio.gather(*(loop.run_in_executor(pool, _sessions_here, url, stream, share, sessions,
                                                           start_at) for share in shares))
    by_index = {i: result for share, (results, _) in zip(shares, done) for i, result in zip(share, results)}
    return [by_index[i] for i in range(sessions)], [cores for _, cores in done]


# ------------------------------------------------------------- batch load beside


@dataclass
class BatchLoad:
    """Every request sent is answered or failed: sent == answered + sum(failed.values())."""

    sent: int = 0
    answered: int = 0  # the last ones may be answered after the window
    failed: dict[str, int] = field(default_factory=dict)  # "STATUS: reason": requests that failed
    requests: int = 0  # answered inside the window: the RTFx's
    audio_s: float = 0.0  # of those


def failure_reason(error: Exception) -> str:
    """How a failed batch request is counted: Triton's status and message, or the exception's kind."""
    from tritonclient.utils import InferenceServerException

    if isinstance(error, InferenceServerException):
        return f"{status_name(error)}: {error_reason(str(error.message()))}"
    return f"{type(error).__name__}: {error_reason(str(error))}"


async def batch_load(triton_grpc: str, concurrency: int, seconds: float) -> BatchLoad:
    """`concurrency` clients sending the stream's recordings to `transcribe` for `seconds`."""
    import tritonclient.grpc.aio as triton

    from python_backend_lib.contract import tensor_names

    _, placed = stream_audio()
    files = [(wav_bytes(audio), len(audio) / 16_000) for _, _, audio in placed]
    load, stop = BatchLoad(), time.monotonic() + seconds
    client = triton.InferenceServerClient(triton_grpc)

    async def one_client(index: int) -> None:
        turn = index
        while time.monotonic() < stop:
            data, duration = files[turn % len(files)]
            turn += 1
            tensor = triton.InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[data]], dtype=np.object_))
            load.sent += 1
            try:
                await client.infer("transcribe", [tensor], parameters={"response_format": "text"},
                                   client_timeout=BATCH_TIMEOUT_S)
            except Exception as error:  # counted with its reason and reported: the load goes on
                reason = failure_reason(error)
                load.failed[reason] = load.failed.get(reason, 0) + 1
                continue
            load.answered += 1
            if time.monotonic() < stop:
                load.audio_s += duration
                load.requests += 1

    try:
        await asyncio.gather(*(one_client(i) for i in range(concurrency)))
    finally:
        await client.close()
    return load


def _batch_load_here(triton_grpc: str, concurrency: int, seconds: float) -> BatchLoad:
    return asyncio.run(batch_load(triton_grpc, concurrency, seconds))


async def batch_load_apart(triton_grpc: str, concurrency: int, seconds: float) -> BatchLoad:
    """`batch_load` in a process of its own, so that its clients and the live sessions do not
    share one interpreter (and what this process measures is the sessions' side alone)."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return await asyncio.get_running_loop().run_in_executor(
            pool, _batch_load_here, triton_grpc, concurrency, seconds)


# ------------------------------------------------------------- the run


@dataclass(frozen=True)
class Summary:
    sessions: int
    batch_concurrency: int
    stream_s: float
    words: int  # reference words, all sessions
    matched: int
    word_latency_p50_s: float | None
    word_latency_p90_s: float | None
    word_latency_max_s: float | None
    first_half_p50_s: float | None
    second_half_p50_s: float | None
    first_delta_p50_s: float | None
    turns: int
    completed_turns: int  # turns whose completed event came before the session gave up waiting
    turn_latency_p50_s: float | None
    turn_latency_max_s: float | None
    max_send_lag_s: float
    errors: int
    batch_rtfx_alone: float | None = None
    batch_rtfx_beside: float | None = None
    batch_answered: tuple[int, int] | None = None  # batch requests answered alone, and beside the sessions (all)
    batch_failed: dict[str, int] = field(default_factory=dict)  # "STATUS: reason": both phases' failed requests
    load_average: tuple[float, float] | None = None  # the host's 1-minute load average before and after
    hypothesis_every_s: float | None = None  # the gateway's --live-hypothesis-every (None: its default)
    gateway_cores: float | None = None  # the gateway's processes' CPU time over the row's wall time, in all
    gateway_workers: int = 1  # the gateway's --workers
    gateway_busiest_core: float | None = None  # the busiest gateway process's (1.0: bound by its interpreter lock)
    client_cores: float | None = None  # the sessions' processes', in all
    client_busiest_core: float | None = None  # the busiest sessions' process's (1.0: its event loop is the bound)
    answered_per_instance: dict[str, int] | None = None  # "gpuN/whisper_0_k": requests it answered in the row
    stalled_instances: list[str] = field(default_factory=list)  # instances whose engine stalled, by the row's end
    metrics_error: str | None = None  # why the server's metrics could not be read


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def summarize(results: list[SessionResult], stream: Stream, batch_concurrency: int) -> Summary:
    latencies = [x for r in results for x in r.word_latencies_s]
    halves = [(x, i < len(r.word_latencies_s) / 2) for r in results for i, x in enumerate(r.word_latencies_s)]
    turns = [x for r in results for x in r.turn_latencies_s]
    firsts = [r.first_delta_s for r in results if r.first_delta_s is not None]
    return Summary(
        sessions=len(results), batch_concurrency=batch_concurrency, stream_s=round(stream.seconds, 2),
        words=sum(r.reference_words for r in results), matched=sum(r.matched for r in results),
        word_latency_p50_s=_quantile(latencies, 0.5), word_latency_p90_s=_quantile(latencies, 0.9),
        word_latency_max_s=_quantile(latencies, 1.0),
        first_half_p50_s=_quantile([x for x, first in halves if first], 0.5),
        second_half_p50_s=_quantile([x for x, first in halves if not first], 0.5),
        first_delta_p50_s=_quantile(firsts, 0.5), turns=sum(r.turns for r in results),
        completed_turns=sum(len(r.turn_latencies_s) for r in results),
        turn_latency_p50_s=_quantile(turns, 0.5), turn_latency_max_s=_quantile(turns, 1.0),
        max_send_lag_s=round(max(r.max_send_lag_s for r in results), 3), errors=sum(len(r.errors) for r in results),
    )


async def measure(
    gateway: str, triton_grpc: str, stream: Stream, sessions: int, batch_concurrency: int
) -> tuple[Summary, list[float], list[float]]:
    """The summary, every matched word's latency, and each sessions' process's cores."""
    url = gateway.replace("http://", "ws://") + "/realtime?intent=transcription"
    alone = None
    if batch_concurrency:
        print(f"batch load alone: {batch_concurrency} clients for {stream.seconds:.0f} s", flush=True)
        alone = await batch_load_apart(triton_grpc, batch_concurrency, stream.seconds)
    print(f"{sessions} live session(s) streaming {stream.seconds:.0f} s of speech"
          + (f", {batch_concurrency} batch clients beside" if batch_concurrency else ""), flush=True)
    beside, load_before = None, os.getloadavg()[0]
    if batch_concurrency:
        (results, client_cores), beside = await asyncio.gather(
            sessions_apart(url, stream, sessions), batch_load_apart(triton_grpc, batch_concurrency, stream.seconds))
    else:
        results, client_cores = await sessions_apart(url, stream, sessions)
    summary = dataclasses.replace(summarize(list(results), stream, batch_concurrency),
                                  load_average=(round(load_before, 2), round(os.getloadavg()[0], 2)))
    if alone is not None and beside is not None:
        failed = {reason: alone.failed.get(reason, 0) + beside.failed.get(reason, 0)
                  for reason in {**alone.failed, **beside.failed}}
        summary = dataclasses.replace(summary, batch_rtfx_alone=round(alone.audio_s / stream.seconds, 1),
                                      batch_rtfx_beside=round(beside.audio_s / stream.seconds, 1),
                                      batch_answered=(alone.answered, beside.answered), batch_failed=failed)
        for reason, count in failed.items():
            print(f"  batch requests failed: {count} x {reason}", flush=True)
    for result in results:
        for error in result.errors[:3]:
            print("  error:", error, flush=True)
    return summary, [x for r in results for x in r.word_latencies_s], client_cores


@dataclass(frozen=True)
class Gateway:
    url: str  # its base URL, http://HOST:PORT/v1
    pid: int | None  # None: a gateway this run did not start
    workers: int = 1


@contextlib.contextmanager
def gateway_process(triton_grpc: str, log: Path, hypothesis_every_s: float | None = None, workers: int = 1,
                    extra_args: tuple[str, ...] | list[str] = ()):
    port = free_port()
    cadence = [] if hypothesis_every_s is None else [f"--live-hypothesis-every={hypothesis_every_s:g}"]
    with log.open("w") as out:
        process = subprocess.Popen([*whisper_triton(), "gateway", f"--triton-url={triton_grpc}", f"--port={port}",
                                    f"--model-id={MODEL}", "--max-live-sessions=1000", f"--workers={workers}",
                                    *cadence, *extra_args], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        import urllib.request

        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"the gateway did not start:\n{log.read_text()[-2000:]}") from None
                time.sleep(0.2)
        yield Gateway(url, process.pid, workers)
    finally:
        process.terminate()
        process.wait(timeout=60)


def gateway_cpu_s(gateway: Gateway) -> dict[int, float | None]:
    """CPU seconds so far of the gateway's process and of its children (its workers)."""
    if gateway.pid is None:
        return {}
    return {pid: process_cpu_seconds(pid) for pid in (gateway.pid, *child_pids(gateway.pid))}


@dataclass(frozen=True)
class CpuUse:
    gateway_cores: float | None
    gateway_busiest_core: float | None
    client_cores: float
    client_busiest_core: float


def cpu_use(before: dict[int, float | None], after: dict[int, float | None],
            client_cores: list[float], wall_s: float) -> CpuUse:
    """Between two `gateway_cpu_s` readings `wall_s` apart, and the sessions' processes' cores."""
    cores = [(after[p] - before[p]) / wall_s for p in before if before[p] is not None and after.get(p) is not None]
    return CpuUse(round(sum(cores), 2) if cores else None, round(max(cores), 2) if cores else None,
                  round(sum(client_cores), 2), round(max(client_cores, default=0.0), 2))


def _cores(total: float | None, busiest: float | None) -> str:
    if total is None:
        return "–"
    return f"{total}" if busiest is None or busiest == total else f"{total} ({busiest})"


@dataclass(frozen=True)
class InstanceReading:
    """The server's metrics at one moment: each whisper instance's answered requests so far,
    and the instances whose engine stalled."""

    answered: dict[str, float]
    stalled: list[str]


def read_instances(metrics_url: str) -> InstanceReading:
    answered = per_instance(metrics_url, "whisper_requests_total", outcome="success")
    stalled = per_instance(metrics_url, "whisper_engine_stalled")
    return InstanceReading(answered, sorted(name for name, value in stalled.items() if value))


def instance_fields(before: InstanceReading | str | None, after: InstanceReading | str | None) -> dict:
    """A row's per-instance fields from readings at its start and end (a str: why one failed;
    None: no metrics to read, a server not started here)."""
    if before is None or after is None:
        return {}
    if isinstance(before, str) or isinstance(after, str):
        return {"metrics_error": before if isinstance(before, str) else after}
    answered = {name: round(after.answered[name] - before.answered.get(name, 0.0)) for name in sorted(after.answered)}
    return {"answered_per_instance": answered, "stalled_instances": after.stalled}


def _reading(metrics_url: str | None) -> InstanceReading | str | None:
    if metrics_url is None:
        return None
    try:
        return read_instances(metrics_url)
    except OSError as error:  # a server that stopped, or stalled past the read's timeout: said in the row
        return f"{type(error).__name__}: {error}"


def _instances(r: Summary) -> str:
    if r.metrics_error is not None:
        return f"unread ({r.metrics_error[:60]})"
    if r.answered_per_instance is None:
        return "–"
    counts = r.answered_per_instance.values()
    low, high = min(counts, default=0), max(counts, default=0)
    text = f"{len(counts)}: {low:,}" + ("" if low == high else f" to {high:,}")
    return text + (f", **{len(r.stalled_instances)} stalled**" if r.stalled_instances else "")


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def markdown(rows: list[Summary], header: str) -> str:
    lines = [header, "",
             "| hypothesis every | sessions | batch clients | words matched | word → delta p50 | p90 | max | "
             "first half p50 | second half p50 | first delta p50 | turns completed | turn end → completed p50 | max | "
             "send lag max | errors | batch RTFx alone → beside | batch answered alone, beside (failed) | "
             "load average before → after | gateway workers | gateway cores (busiest process) | "
             "sessions' cores (busiest process) | whisper instances: answered in the row |",
             "|" + "---|" * 22]
    for r in rows:
        batch = f"{r.batch_rtfx_alone} → {r.batch_rtfx_beside}" if r.batch_rtfx_alone is not None else "–"
        answered = "–" if r.batch_answered is None else (
            f"{r.batch_answered[0]}, {r.batch_answered[1]} ({sum(r.batch_failed.values())})")
        every = "default" if r.hypothesis_every_s is None else f"{r.hypothesis_every_s:g} s"
        lines.append(
            f"| {every} | {r.sessions} | {r.batch_concurrency} | {r.matched}/{r.words} | **{r.word_latency_p50_s} s** | "
            f"{r.word_latency_p90_s} s | {r.word_latency_max_s} s | {r.first_half_p50_s} s | {r.second_half_p50_s} s | "
            f"{r.first_delta_p50_s} s | {r.completed_turns}/{r.turns} | {r.turn_latency_p50_s} s | "
            f"{r.turn_latency_max_s} s | {r.max_send_lag_s} s | {r.errors} | {batch} | {answered} | "
            f"{r.load_average[0]} → {r.load_average[1]} | "
            f"{r.gateway_workers} | {_cores(r.gateway_cores, r.gateway_busiest_core)} | "
            f"{_cores(r.client_cores, r.client_busiest_core)} | {_instances(r)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1], help="session counts to measure, in turn")
    parser.add_argument("--batch-concurrency", type=int, default=0,
                        help="a last row: the last session count beside this many batch clients")
    parser.add_argument("--checkpoint", help="as `whisper-triton serve --checkpoint` takes it (default: packaged)")
    parser.add_argument("--gateway", help="a running gateway's base URL (http://HOST:PORT/v1)")
    parser.add_argument("--triton-grpc", help="the gateway's Triton (HOST:PORT), with --gateway")
    parser.add_argument("--metrics-url", help="that Triton's metrics (http://HOST:PORT/metrics), with --gateway: "
                                              "each whisper instance's answers in each row")
    parser.add_argument("--hypothesis-every", type=float, nargs="+", default=[None], metavar="SECONDS",
                        help="the gateway's --live-hypothesis-every, a gateway for each in turn (the batch row "
                             "runs with the first); default: the gateway's own")
    parser.add_argument("--gateway-workers", type=int, default=1, metavar="N",
                        help="the gateway's --workers: processes that share its sessions (default: %(default)s)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if args.gateway:
            triton_grpc, cadences, metrics_url = args.triton_grpc, [None], args.metrics_url
        else:
            command = ServeCommand(checkpoint=args.checkpoint)
            print(f"starting {command.display}", flush=True)
            stack.enter_context(ServerProcess(command, args.out / "serve.log", STARTUP_TIMEOUT_S))
            triton_grpc, cadences = command.grpc_url, args.hypothesis_every
            metrics_url = command.metrics_url
        rows, latencies, stream = [], [], None
        for index, every in enumerate(cadences):
            with contextlib.ExitStack() as gateway_stack:
                if args.gateway:
                    gateway = Gateway(args.gateway, None)
                else:
                    log = args.out / f"gateway-{index}.log"
                    gateway = gateway_stack.enter_context(gateway_process(triton_grpc, log, every,
                                                                          args.gateway_workers))
                if stream is None:
                    stream = reference_stream(gateway.url)
                    print(f"reference: {len(stream.words)} words in {stream.seconds:.1f} s of stream", flush=True)
                plan = [(sessions, 0) for sessions in args.sessions]
                if args.batch_concurrency and index == 0:
                    plan.append((args.sessions[-1], args.batch_concurrency))
                for sessions, batch in plan:
                    cpu_before, started = gateway_cpu_s(gateway), time.monotonic()
                    instances_before = _reading(metrics_url)
                    summary, measured, client_cores = asyncio.run(measure(gateway.url, triton_grpc, stream,
                                                                          sessions, batch))
                    use = cpu_use(cpu_before, gateway_cpu_s(gateway), client_cores, time.monotonic() - started)
                    rows.append(dataclasses.replace(summary, hypothesis_every_s=every, gateway_workers=gateway.workers,
                                                    **asdict(use), **instance_fields(instances_before,
                                                                                     _reading(metrics_url))))
                    latencies.append(measured)
                    print(markdown(rows[-1:], ""), flush=True)
    commit, machine = commit_info(), machine_info()
    record = {"commit": commit.commit, "dirty": commit.dirty, "machine": machine,
              "recorded": time.strftime("%Y-%m-%d %H:%M"), "checkpoint": args.checkpoint or "packaged tiny.en",
              "stream": list(STREAM), "rows": [asdict(r) for r in rows]}
    (args.out / "live.json").write_text(json.dumps(record, indent=1))
    where = machine["gpu"] or f"{machine['cpu']}, {machine['cpu_count']} cores"
    header = (f"# Live sessions: word end to delta\n\n{record['recorded']}, commit `{commit.commit}`, {where}; "
              f"{record['checkpoint']}. Stream: {', '.join(STREAM)}, {PAUSE_S:g} s apart, server_vad. "
              f"Command: `python -m bench.live_latency --out {args.out} --sessions "
              f"{' '.join(map(str, args.sessions))}" + (f" --batch-concurrency {args.batch_concurrency}"
                                                         if args.batch_concurrency else "")
              + ("" if args.hypothesis_every == [None] else
                 " --hypothesis-every " + " ".join(f"{x:g}" for x in args.hypothesis_every))
              + (f" --gateway-workers {args.gateway_workers}" if args.gateway_workers != 1 else "") + "`.")
    (args.out / "README.md").write_text(markdown(rows, header) + "\n![word end to delta](live.png)\n")
    plot(rows, latencies, args.out / "live.png")
    print(markdown(rows, header))


def plot(rows: list[Summary], latencies: list[list[float]], path: Path) -> None:
    """The share of words shown within each delay, per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for row, values in zip(rows, latencies):
        ordered = np.sort(values)
        label = f"{row.sessions} session(s)" + (f", {row.batch_concurrency} batch" if row.batch_concurrency else "")
        label += "" if row.hypothesis_every_s is None else f", every {row.hypothesis_every_s:g} s"
        axis.plot(ordered, np.arange(1, len(ordered) + 1) / max(len(ordered), 1), label=label)
    axis.set(xlabel="word end to its delta (s)", ylabel="share of words", title="Live sessions: word latency")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
