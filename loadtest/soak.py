"""A soak test: mixed load for a bounded time, then every request accounted for.

    python -m loadtest.soak --serve --seconds 600 --record docs/benchmarks/soak
    python -m loadtest.soak --http-url localhost:8000 --grpc-url localhost:8001 \\
        --metrics-url http://localhost:8002/metrics --fault-prompt TEXT --seconds 60

Workers send, each one request at a time, a random mix (`WEIGHTS`) of short clips,
a long recording, word timestamps, bad input, requests their client cancels or
abandons mid-request, and, where the server arms a fault prompt
(WHISPER_TRITON_FAULT_PROMPT), requests that break their decoder step. Each is
judged (`soak_requests`). A warm-up comes first (its requests are judged too):
each kind once, then the same mix; then the soak proper. At the end the soak
requires (`soak_report`): no UNEXPECTED outcome, nothing left in the whisper model (requests in
flight, windows decoding or waiting), the engine healthy and Triton ready, and
the resident memory of the whisper and the preprocessing stubs (`JUDGED_MODELS`) each
within `RSS_TOLERANCE_MIB` of where it was after the warm-up. A long soak can pause to
settle every `--settle-every` seconds (`checkpoints`): then the last stretch alone may
grow by no more than `LATE_TOLERANCE_MIB`, so that memory which rises early and levels
passes, and memory that keeps rising fails however long the run.

`--serve` starts a server of its own with a fault prompt armed; otherwise the
server must run on this machine (its memory is read from /proc). Progress is
printed every PROGRESS_S; tests/served/test_soak.py runs it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from clients.connection import AddressError, Protocol, parse_address
from loadtest import records
from loadtest.clips import DEFAULT_AUDIO_DIR, WINDOW_S, load_clips
from loadtest.metrics import whisper_samples
from loadtest.processes import rss_mib, stub_processes
from loadtest.soak_report import JUDGED_MODELS, LATE_TOLERANCE_MIB, Snapshot, SoakReport, count, markdown
from loadtest.soak_requests import WEIGHTS, Expected, Inputs, Outcome, Result, SoakClient, text_of, tokens_of

DEFAULT_CONCURRENCY = 6
SHORT_CLIPS = 6  # the shortest clips of the manifest, one window each
LONG_CLIP = "sonnet1_longform.wav"  # 53 s: two windows, one after the other
WORDS_CLIP = "jfk.wav"
PROGRESS_S = 15.0
# Abandoned requests (cancelled through the ensemble, hung up) are still decoded
# after the soak; this long at most until nothing is left.
SETTLE_TIMEOUT_S = 180.0
# Memory is read with the server settled after a warm-up of the same load
# (loadtest.soak_report.RSS_TOLERANCE_MIB says why).
WARMUP_S = 30.0
SEED = 11


@dataclass(frozen=True)
class Server:
    http_url: str
    grpc_url: str
    metrics_url: str
    fault_prompt: str | None

    @property
    def grpc_port(self) -> int:
        return int(self.grpc_url.rpartition(":")[2])


def load_inputs(audio_dir: Path = DEFAULT_AUDIO_DIR) -> Inputs:
    """The manifest's shortest clips, its long recording, the clip for word timestamps,
    and every clip one after another (a second of silence between) as one waveform."""
    from python_backend_lib.audio.decode import decode_audio
    from python_backend_lib.core import geometry

    clips = load_clips(audio_dir)
    by_name = {clip.name: clip for clip in clips}
    short = tuple(c for c in clips if c.duration_s < WINDOW_S)[:SHORT_CLIPS]
    gap = np.zeros(geometry.SAMPLE_RATE, dtype=np.float32)
    # Distinct speech throughout: a clip repeated would be text that compresses too
    # well, decoded again at rising temperatures, at random.
    waveform = np.concatenate([part for clip in clips for part in (decode_audio(clip.audio), gap)])
    return Inputs(short=short, long=by_name[LONG_CLIP], words=by_name[WORDS_CLIP], waveform=waveform.astype(np.float32))


def references(client: SoakClient) -> Expected:
    """Each input transcribed before the load: what every answer must equal. Sent all at
    once over gRPC (its client is thread-safe), so that the engine batches them, as the
    load batches every answer they are compared with."""
    inputs = client.inputs
    with ThreadPoolExecutor(len(inputs.short) + 3) as pool:
        texts = {clip.name: pool.submit(client.transcribe, "grpc", clip.audio) for clip in (*inputs.short, inputs.long)}
        texts[Expected.WORDS_KEY] = pool.submit(client.transcribe, "grpc", inputs.words.audio, word_timestamps=True)
        log_mel = client.log_mel(inputs.waveform)
        tokens = pool.submit(client.decode, log_mel)
        return Expected({key: text_of(reply.result()) for key, reply in texts.items()}, log_mel,
                        tokens_of(tokens.result()))



def snapshot(server: Server) -> Snapshot:
    samples = whisper_samples(server.metrics_url)
    counters = {k: v for k, v in samples.items()
                if k.startswith("whisper_requests_total") or k in ("whisper_engine_restarts_total", "whisper_failed_steps_total")}  # fmt: skip
    return Snapshot(
        in_flight=samples["whisper_requests_in_flight"],
        running=samples["whisper_running_batch_size"],
        waiting=samples["whisper_waiting_windows"],
        healthy=samples["whisper_engine_healthy"],
        ready=is_ready(server.http_url),
        rss_mib=model_rss_mib(stub_processes(server.grpc_port)),
        counters=counters,
    )


def model_rss_mib(stubs) -> dict[str, float]:
    """Resident memory by model: a model with several instances has a stub each."""
    totals: dict[str, float] = {}
    for stub in stubs:
        totals[stub.model] = totals.get(stub.model, 0.0) + rss_mib(stub.pid)
    return {model: round(total, 1) for model, total in totals.items()}


def is_ready(http_url: str) -> bool:
    """Triton's readiness; False too when it does not answer."""
    import tritonclient.http

    try:
        return tritonclient.http.InferenceServerClient(http_url, connection_timeout=5).is_server_ready()
    except Exception:  # refused, reset, timed out: not ready either way
        return False


def settle(server: Server, say: Callable[[str], None], timeout: float = SETTLE_TIMEOUT_S) -> Snapshot:
    """Wait until the whisper model holds nothing (published once a second), then two more publications."""
    started = time.monotonic()
    said = started
    while not (now := snapshot(server)).idle and time.monotonic() < started + timeout:
        if time.monotonic() - said >= PROGRESS_S / 3:
            said = time.monotonic()
            say(f"settling: {now.in_flight:g} requests in the whisper model, {now.running:g} windows decoding, "
                f"{now.waiting:g} waiting ({said - started:.0f} s)")  # fmt: skip
        time.sleep(0.5)
    time.sleep(2.5)  # by then the idle engine gave its freed memory back (devices.host_memory.IDLE_RELEASE_S)
    return snapshot(server)


@dataclass
class Tally:
    """Outcomes as they come, from every worker."""

    outcomes: list[Outcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)

    def counts(self) -> collections.Counter:
        with self.lock:
            return collections.Counter(outcome.result for outcome in self.outcomes)


@dataclass(frozen=True)
class Load:
    """What one phase of load did. rss_mib: the whisper stub's RSS at each progress line, by second."""

    outcomes: list[Outcome]
    rss_mib: list[tuple[float, float]]


def run_load(server: Server, inputs: Inputs, expected: Expected, seconds: float, concurrency: int, seed: int,
             say: Callable[[str], None], phase: str = "soak", first: Sequence[str] = ()) -> Load:  # fmt: skip
    """`concurrency` workers, each sending one request at a time: the kinds of `first` in
    order, whichever worker is free, then random draws until `seconds` have passed."""
    tally = Tally()
    deadline = time.monotonic() + seconds
    errors: list[BaseException] = []
    whisper = next(stub.pid for stub in stub_processes(server.grpc_port) if stub.model == "whisper")
    unsent = collections.deque(first)  # kinds not offered (`fault` where not armed) are skipped
    lock = threading.Lock()

    def next_kind(names: list[str], rng: random.Random) -> str | None:
        """The next kind of `first` even past the deadline (each is sent, however slow the
        machine), else a random draw until the deadline, then None."""
        with lock:
            while unsent:
                if (kind := unsent.popleft()) in names:
                    return kind
        if time.monotonic() >= deadline:
            return None
        return rng.choices(names, weights=[WEIGHTS[name] for name in names])[0]

    def worker(index: int) -> None:
        client = SoakClient(server.http_url, server.grpc_url, server.fault_prompt, inputs)
        kinds = client.kinds()
        names = sorted(kinds)
        rng = random.Random(f"{seed} {phase} {index}")
        try:
            while (kind := next_kind(names, rng)) is not None:
                tally.add(kinds[kind](expected, rng))
        except BaseException as error:  # a bug of the soak itself: stop and say so
            errors.append(error)
        finally:
            client.close()

    threads = [threading.Thread(target=worker, args=(i,), name=f"soak-{i}", daemon=True) for i in range(concurrency)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    timeline = []
    while any(thread.is_alive() for thread in threads):
        for thread in threads:
            thread.join(timeout=PROGRESS_S / len(threads))
        elapsed, rss = time.monotonic() - started, rss_mib(whisper)
        timeline.append((round(elapsed, 1), round(rss, 1)))
        counts = tally.counts()
        say(f"{phase}: {min(elapsed, seconds):5.0f}/{seconds:.0f} s, {sum(counts.values())} requests: "
            + ", ".join(f"{result.value} {counts[result]}" for result in Result)
            + f"; whisper stub {rss:.0f} MiB")  # fmt: skip
    if errors:
        raise errors[0]
    return Load(tally.outcomes, timeline)





def warmup_kinds() -> list[str]:
    """What the warm-up sends before its random draws: each kind once, since on a busy
    machine a short soak makes few requests and a kind drawn rarely (59 requests drew no
    `disconnect`) would go untried. The soak proper draws at random from its start."""
    return sorted(WEIGHTS)


def stretches(seconds: float, settle_every: float | None) -> list[float]:
    """The soak proper's stretches of load, each `settle_every` long but the last, which
    takes what is left; one stretch when `settle_every` is None."""
    if settle_every is None or settle_every >= seconds:
        return [seconds]
    whole, rest = divmod(seconds, settle_every)
    return [settle_every] * int(whole) + ([rest] if rest > 0 else [])


def soak(server: Server, seconds: float, concurrency: int = DEFAULT_CONCURRENCY, seed: int = SEED,
         warmup_seconds: float = WARMUP_S, say: Callable[[str], None] = print,
         settle_every: float | None = None) -> SoakReport:  # fmt: skip
    """References, a warm-up of the load, the soak proper (settling between stretches of
    `settle_every` seconds, if given), and the server once settled."""
    inputs = load_inputs()
    say(f"soak: references against {server.grpc_url}")
    client = SoakClient(server.http_url, server.grpc_url, server.fault_prompt, inputs)
    try:
        expected = references(client)
    finally:
        client.close()
    warmup = run_load(server, inputs, expected, warmup_seconds, concurrency, seed, say, phase="warm-up",
                      first=warmup_kinds())
    before = settle(server, say)
    say(f"soak: {seconds:.0f} s with {concurrency} workers; whisper stub {before.rss_mib['whisper']:.0f} MiB")
    parts = stretches(seconds, settle_every)
    outcomes: list[Outcome] = []
    timeline: list[tuple[float, float]] = []
    checkpoints: list[tuple[float, Snapshot]] = []
    done = 0.0
    for index, part in enumerate(parts):
        if index:
            checkpoint = settle(server, say)
            checkpoints.append((done, checkpoint))
            say(f"soak: settled after {done:.0f} s: " + ", ".join(f"{model} {checkpoint.rss_mib[model]:.0f} MiB"
                                                                   for model in JUDGED_MODELS))  # fmt: skip
        # One stretch keeps the draws of a soak without checkpoints (its phase names its seed).
        phase = "soak" if len(parts) == 1 else f"soak {index + 1}/{len(parts)}"
        load = run_load(server, inputs, expected, part, concurrency, seed, say, phase=phase)
        outcomes += load.outcomes
        timeline += [(round(done + second, 1), rss) for second, rss in load.rss_mib]
        done += part
    say("soak: waiting for the server to settle")
    after = settle(server, say)
    every = warmup.outcomes + outcomes
    details = collections.Counter(f"{o.kind} {o.result.value}: {o.detail}" for o in every if o.detail)
    unexpected = [f"{o.kind}: {o.detail}" for o in every if o.result is Result.UNEXPECTED][:20]
    return SoakReport(seconds, warmup_seconds, concurrency, seed, count(outcomes), count(warmup.outcomes),
                      dict(sorted(details.items())), unexpected, before, after, timeline, checkpoints)  # fmt: skip



@contextlib.contextmanager
def own_server(fault_prompt: str) -> Iterator[Server]:
    """`whisper-triton serve`'s server on free ports, with `fault_prompt` armed."""
    import socket

    from python_backend_lib.apps.server import ServerSettings, TritonServer, packaged_model_repository
    from python_backend_lib.serving.settings import FAULT_PROMPT_ENV

    def free_port() -> int:
        with socket.socket() as probe:
            probe.bind(("", 0))
            return probe.getsockname()[1]

    os.environ[FAULT_PROMPT_ENV] = fault_prompt  # tritonserver inherits it
    settings = ServerSettings(model_repository=packaged_model_repository(), http_port=free_port(),
                              grpc_port=free_port(), metrics_port=free_port())  # fmt: skip
    with TritonServer(settings) as triton:
        yield Server(triton.http_url, triton.grpc_url, triton.metrics_url, fault_prompt)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to send requests")
    parser.add_argument("--warmup-seconds", type=float, default=WARMUP_S, help="the same load first, before memory is read")
    parser.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="workers")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--settle-every", type=float, metavar="SECONDS",
                        help="pause the load to settle and read memory this often; the last stretch must then "
                             f"grow no more than {LATE_TOLERANCE_MIB:g} MiB")  # fmt: skip
    parser.add_argument("--serve", action="store_true", help="start a server of its own, with a fault prompt armed")
    parser.add_argument("--http-url", default="localhost:8000", help="Triton's HTTP address, host:port or http://")
    parser.add_argument("--grpc-url", default="localhost:8001", help="Triton's gRPC address, host:port or grpc://")
    parser.add_argument("--metrics-url", default="http://localhost:8002/metrics", help="Triton's metrics endpoint")
    parser.add_argument("--fault-prompt", help="the WHISPER_TRITON_FAULT_PROMPT the server was started with")
    parser.add_argument("--record", type=Path, help="write <RECORD>.json and <RECORD>.md, e.g. docs/benchmarks/soak")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.concurrency < 1 or (args.settle_every is not None and args.settle_every <= 0):
        parser.error("--seconds and --settle-every must be above 0 and --concurrency at least 1")
    try:
        http_url = parse_address(args.http_url, Protocol.HTTP).location
        grpc_url = parse_address(args.grpc_url, Protocol.GRPC).location
    except AddressError as error:
        parser.error(str(error))
    origin = records.origin() if args.record else None  # the load average before our own server starts
    if args.serve:
        context = own_server(args.fault_prompt or "soak: fail this request inside the engine")
    else:
        context = contextlib.nullcontext(Server(http_url, grpc_url, args.metrics_url, args.fault_prompt))
    with context as server:
        report = soak(server, args.seconds, args.concurrency, args.seed, args.warmup_seconds,
                      say=lambda line: print(line, flush=True), settle_every=args.settle_every)
    print("\n".join(markdown(report)))
    if args.record:
        for path in records.write_record(args.record, "Soak test", origin, report.results(), markdown(report)):
            print(f"wrote {path}")
    return 1 if report.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
