"""A flood at twice the server's capacity: every request must get its transcript or a
fast UNAVAILABLE refusal, none may be lost, and latency must come back afterwards.

    python -m loadtest.flood --grpc-url localhost:8001 --metrics-url http://localhost:8002/metrics \\
        --record docs/benchmarks/flood

First the capacity is measured: as many clients as the engine has decoding slots
send a short clip back to back for MEASURE_S. Then requests are sent open-loop at
OVERLOAD times the rate the server answers, for as long as it takes the excess
to add up to LIMIT_MARGIN times the whisper model's request limit (slots +
max_queued_requests), so that the limit is reached whatever the machine's speed.
Without a limit the excess would wait inside the engine ever longer; the limit
refuses it at once instead. tests/served/test_overload.py runs it and checks each
outcome; docs/operating.md quotes the record this writes.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path

import numpy as np
import tritonclient.grpc
from tritonclient.utils import InferenceServerException

from clients.connection import AddressError, Protocol, parse_address
from loadtest import records
from loadtest.clips import DEFAULT_AUDIO_DIR
from loadtest.metrics import per_instance
from loadtest.outcomes import Judged, Verdict, judge
from python_backend_lib.contract import tensor_names

CLIP = DEFAULT_AUDIO_DIR / "cards_001.wav"  # 1.1 s: one short window
MEASURE_S = 8.0
OVERLOAD = 2.0  # times the rate the server answers
# The flood lasts at least this long, and until the requests sent beyond what the
# server answers add up to LIMIT_MARGIN request limits. With 20 s alone, a machine
# answering under 1.6 requests/s (a loaded 2-core one) never reached the limit of 32.
MIN_FLOOD_S = 20.0
LIMIT_MARGIN = 2.0
MAX_FLOOD_S = 180.0
# The flood's rate follows the answers of the last RATE_WINDOW_S: a capacity
# measured while the machine was busier than during the flood does not make the
# flood too gentle to overload the server. Answers come in bursts (requests
# admitted together finish together), so the window spans several of them.
RATE_WINDOW_S = 8.0
REQUEST_TIMEOUT_S = 120.0  # a request not answered by then counts as lost
LATENCY_SAMPLES = 5


@dataclass(frozen=True)
class Outcome:
    seconds: float
    text: str | None = None
    error: InferenceServerException | None = None

    @cached_property
    def judged(self) -> Judged | None:
        """How the error counts (`loadtest.outcomes`); None for an answer."""
        return None if self.error is None else judge(self.error)

    @property
    def verdict(self) -> Verdict:
        return Verdict.ANSWERED if self.judged is None else self.judged.verdict


def audio_input(audio: bytes) -> list:
    tensor = tritonclient.grpc.InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[audio]], dtype=np.object_))
    return [tensor]


def transcribe(client: tritonclient.grpc.InferenceServerClient, audio: bytes) -> Outcome:
    started = time.monotonic()
    try:
        reply = client.infer(tensor_names.ENSEMBLE_NAME, audio_input(audio), client_timeout=REQUEST_TIMEOUT_S)
    except InferenceServerException as error:
        return Outcome(time.monotonic() - started, error=error)
    return Outcome(time.monotonic() - started, text=reply.as_numpy(tensor_names.TEXT).reshape(-1)[0].decode())


def median_latency(grpc_url: str, audio: bytes) -> float:
    client = tritonclient.grpc.InferenceServerClient(grpc_url)
    return statistics.median(transcribe(client, audio).seconds for _ in range(LATENCY_SAMPLES))


def capacity(grpc_url: str, audio: bytes, concurrency: int, seconds: float = MEASURE_S) -> float:
    """Requests answered per second by `concurrency` clients sending back to back."""
    deadline = time.monotonic() + seconds
    answered: list[Outcome] = []

    def client_loop() -> None:
        client = tritonclient.grpc.InferenceServerClient(grpc_url)
        while time.monotonic() < deadline:
            outcome = transcribe(client, audio)
            if outcome.error is not None:
                raise outcome.error
            answered.append(outcome)

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for future in [pool.submit(client_loop) for _ in range(concurrency)]:
            future.result()
    return len(answered) / (time.monotonic() - started)


def transcribe_engines_gauge(metrics_url: str, name: str) -> float:
    """A gauge summed over the `whisper` model's engines, which the `transcribe` ensemble
    calls; not the streamed path's (`whisper_stream`), whose slots and request limit the
    flood never reaches. ValueError when the endpoint has no such series."""
    values = per_instance(metrics_url, name, model=tensor_names.WHISPER_NAME)
    if not values:
        raise ValueError(f"no {name} of the {tensor_names.WHISPER_NAME} model at {metrics_url}")
    return sum(values.values())


def flood_seconds(capacity_per_s: float, request_limit: int) -> float:
    """How long the flood must last for its excess over `capacity_per_s` to add up
    to LIMIT_MARGIN request limits (within MIN_FLOOD_S and MAX_FLOOD_S)."""
    needed = LIMIT_MARGIN * request_limit / ((OVERLOAD - 1) * capacity_per_s)
    return min(MAX_FLOOD_S, max(MIN_FLOOD_S, needed))


@dataclass
class _Flood:
    """The flood's shared state: callbacks run on tritonclient's threads."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    outcomes: list[Outcome] = field(default_factory=list)
    transcribed_at: collections.deque = field(default_factory=collections.deque)  # monotonic times of transcripts
    sent: int = 0
    done_sending: bool = False
    all_answered: threading.Event = field(default_factory=threading.Event)

    def answered(self, started: float, result, error) -> None:
        now = time.monotonic()
        outcome = Outcome(now - started, error=error)
        if error is None:
            outcome = Outcome(outcome.seconds, text=result.as_numpy(tensor_names.TEXT).reshape(-1)[0].decode())
        with self.lock:
            self.outcomes.append(outcome)
            if error is None:
                self.transcribed_at.append(now)
            if self.done_sending and len(self.outcomes) == self.sent:
                self.all_answered.set()

    def answer_rate(self, now: float) -> float:
        """Transcripts per second over the last RATE_WINDOW_S (refusals left out)."""
        with self.lock:
            while self.transcribed_at and self.transcribed_at[0] < now - RATE_WINDOW_S:
                self.transcribed_at.popleft()
            return len(self.transcribed_at) / RATE_WINDOW_S


@dataclass(frozen=True)
class FloodRun:
    sent: int
    outcomes: list[Outcome]
    seconds: float  # of sending
    peak_rate_per_s: float


def flood(grpc_url: str, audio: bytes, capacity_per_s: float, seconds: float) -> FloodRun:
    """Send requests open-loop at OVERLOAD times the rate the server answers (at
    least OVERLOAD * `capacity_per_s`) for `seconds`; wait for every answer."""
    client = tritonclient.grpc.InferenceServerClient(grpc_url)
    inputs = audio_input(audio)
    state = _Flood()
    begin = next_send = time.monotonic()
    peak = 0.0
    while next_send - begin < seconds:
        time.sleep(max(0.0, next_send - time.monotonic()))
        started = time.monotonic()
        with state.lock:
            state.sent += 1
        client.async_infer(
            tensor_names.ENSEMBLE_NAME, inputs, client_timeout=REQUEST_TIMEOUT_S,
            callback=lambda result, error, s=started: state.answered(s, result, error),
        )  # fmt: skip
        rate = OVERLOAD * max(capacity_per_s, state.answer_rate(started))
        peak = max(peak, rate)
        next_send += 1.0 / rate
    sending_s = time.monotonic() - begin
    with state.lock:
        state.done_sending = True
        if len(state.outcomes) == state.sent:
            state.all_answered.set()
    state.all_answered.wait(REQUEST_TIMEOUT_S + 10)
    with state.lock:
        return FloodRun(state.sent, list(state.outcomes), sending_s, peak)


@dataclass(frozen=True)
class FloodReport:
    """What a flood did. outcomes: every answer (a transcript or an error), for checks;
    left out of the record."""

    expected_text: str
    slots: int
    request_limit: int
    capacity_per_s: float
    flood_s: float
    peak_rate_per_s: float
    sent: int
    answered: int
    refused: int  # as overloaded
    failed: int  # any other error (`loadtest.outcomes`)
    lost: int
    answered_median_s: float
    answered_max_s: float
    refused_median_s: float
    latency_before_s: float
    latency_after_s: float
    refusals: dict[str, int]  # "status: message" -> count
    failures: dict[str, int]
    outcomes: tuple[Outcome, ...] = ()

    def summary(self) -> str:
        return (
            f"capacity {self.capacity_per_s:.1f}/s at {self.slots} clients; flood of {self.flood_s:.0f} s at "
            f"{OVERLOAD:g}x the answer rate (up to {self.peak_rate_per_s:.1f}/s): {self.sent} sent, "
            f"{self.answered} answered (median {self.answered_median_s:.2f} s, max {self.answered_max_s:.2f} s), "
            f"{self.refused} refused (median {self.refused_median_s:.2f} s), {self.failed} failed, {self.lost} lost; "
            f"latency before {self.latency_before_s:.2f} s, after {self.latency_after_s:.2f} s"
        )

    def results(self) -> dict:
        """The record's numbers: every field but the outcomes (exceptions, not JSON)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "outcomes"}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run_flood(grpc_url: str, metrics_url: str, audio: bytes | None = None, say=print) -> FloodReport:
    """Measure, flood, measure again; the report holds every outcome."""
    audio = CLIP.read_bytes() if audio is None else audio
    client = tritonclient.grpc.InferenceServerClient(grpc_url)
    expected = transcribe(client, audio)
    if expected.error is not None or not expected.text:
        raise RuntimeError(f"the server does not transcribe the clip: {expected.error or 'no text'}")
    baseline = median_latency(grpc_url, audio)
    slots = int(transcribe_engines_gauge(metrics_url, "whisper_decoding_slots"))
    limit = int(transcribe_engines_gauge(metrics_url, "whisper_request_limit"))
    measured = capacity(grpc_url, audio, concurrency=slots)
    seconds = flood_seconds(measured, limit)
    say(f"flood: capacity {measured:.2f}/s at {slots} clients; flooding for {seconds:.0f} s (request limit {limit})")
    run = flood(grpc_url, audio, measured, seconds)
    succeeded = [o for o in run.outcomes if o.verdict is Verdict.ANSWERED]
    refused = [o for o in run.outcomes if o.verdict is Verdict.REFUSED]
    failed = [o for o in run.outcomes if o.verdict is Verdict.FAILED]
    refusals = collections.Counter(o.judged.reason for o in refused)
    failures = collections.Counter(o.judged.reason for o in failed)
    return FloodReport(
        expected_text=expected.text,
        slots=slots,
        request_limit=limit,
        capacity_per_s=measured,
        flood_s=run.seconds,
        peak_rate_per_s=run.peak_rate_per_s,
        sent=run.sent,
        answered=len(succeeded),
        refused=len(refused),
        failed=len(failed),
        lost=run.sent - len(run.outcomes),
        answered_median_s=_median([o.seconds for o in succeeded]),
        answered_max_s=max((o.seconds for o in succeeded), default=float("nan")),
        refused_median_s=_median([o.seconds for o in refused]),
        latency_before_s=baseline,
        latency_after_s=median_latency(grpc_url, audio),
        refusals=dict(refusals.most_common()),
        failures=dict(failures.most_common()),
        outcomes=tuple(run.outcomes),
    )


def markdown(report: FloodReport) -> list[str]:
    return [
        f"The 1.1 s clip `{CLIP.name}` through the `transcribe` ensemble over gRPC against `whisper-triton serve` "
        f"({report.slots} decoding slots, request limit {report.request_limit}).",
        "",
        "| | |",
        "| --- | --- |",
        f"| capacity ({report.slots} clients back to back, {MEASURE_S:g} s) | {report.capacity_per_s:.2f} requests/s |",
        f"| flood | {report.flood_s:.0f} s open-loop at {OVERLOAD:g}x the answer rate, "
        f"up to {report.peak_rate_per_s:.2f}/s |",
        f"| sent | {report.sent} |",
        f"| answered with the right transcript | {report.answered} (median {report.answered_median_s:.2f} s, "
        f"max {report.answered_max_s:.2f} s) |",
        f"| refused with UNAVAILABLE as overloaded | {report.refused} (median {report.refused_median_s:.2f} s) |",
        f"| failed otherwise | {report.failed} |",
        f"| lost (no answer within {REQUEST_TIMEOUT_S:.0f} s) | {report.lost} |",
        f"| median latency before / after (one client) | {report.latency_before_s:.2f} s / "
        f"{report.latency_after_s:.2f} s |",
        "",
        "Refusals, by status and message:",
        "",
        *[f"- {count} x `{message}`" for message, count in report.refusals.items()],
        *(["", "Failures, by status and message:", ""] if report.failures else []),
        *[f"- {count} x `{message}`" for message, count in report.failures.items()],
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.flood", description=__doc__.split("\n\n")[0])
    parser.add_argument("--grpc-url", default="localhost:8001", help="Triton's gRPC address, host:port or grpc://")
    parser.add_argument("--metrics-url", default="http://localhost:8002/metrics", help="Triton's metrics endpoint")
    parser.add_argument("--record", type=Path, help="write <RECORD>.json and <RECORD>.md, e.g. docs/benchmarks/flood")
    args = parser.parse_args(argv)
    try:
        grpc_url = parse_address(args.grpc_url, Protocol.GRPC).location
    except AddressError as error:
        parser.error(f"--grpc-url: {error}")
    report = run_flood(grpc_url, args.metrics_url)
    print(report.summary())
    failed = report.lost or not report.refused or any(o.text != report.expected_text for o in report.outcomes if o.error is None)
    if args.record:
        for path in records.write_record(args.record, "Flood at twice capacity", records.origin(), report.results(), markdown(report)):
            print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
