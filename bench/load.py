"""The load generator: requests in flight from several client processes, over gRPC (asyncio).

`concurrency` is the number of requests in flight: each of that many client
slots sends a request, waits for its answer, and sends the next. The slots are
spread over a few processes, each with one event loop and one
`tritonclient.grpc.aio` client (its own connection) per SLOTS_PER_CONNECTION
slots, so that at thousands of requests a second the client is not the
bottleneck; each process measures its own CPU time over the window so the
report can show it.

A point runs warm-up plus a measured window, all processes on one shared clock
(time.monotonic). The slots start spread evenly over the list of clips (slot s
of C at clip s x len / C) and each sends the clips that follow its own, round and
round, so every slot sends every clip in turn and every clip is sent about
equally often, however the concurrency divides the list: a slot that kept to a
few clips would send short ones more often (they come back sooner), and slots
started side by side (slot s at clip s) would leave the end of the list unsent
in a short window when there are fewer slots than clips. Each point records the
mean length of the clips it served. Every answer is read
as verbose_json and judged (`bench.transcripts`): an empty or implausible
transcript, or one far from the library's transcript of its clip, counts as
BAD_TRANSCRIPT, never as throughput.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.stats import BAD_TRANSCRIPT, OK, Outcome, PointStats, summarize
from bench.transcripts import TranscriptCheck, Verdict, judge_json
from loadtest.outcomes import status_name
from python_backend_lib.contract import tensor_names

START_DELAY_S = 0.5  # orders reach every process before the shared start time
REASON_CHARS = 120  # of an error's message, kept with its outcome
# Each process opens one gRPC connection per this many slots, as that many separate
# clients would: no one HTTP/2 connection's stream limit or lock caps the load.
SLOTS_PER_CONNECTION = 64
CHANNEL_ARGS = [
    ("grpc.max_send_message_length", 2**31 - 1),
    ("grpc.max_receive_message_length", 2**31 - 1),
    ("grpc.use_local_subchannel_pool", 1),  # a connection of its own, not one shared by every channel
]
_POINTS = itertools.count(1)  # numbers the points this process runs, for their request ids


@dataclass(frozen=True)
class LoadRequest:
    """One clip as the load generator sends it: a WAV file and the request parameters."""

    name: str
    wav: bytes
    duration_s: float
    parameters: dict[str, object]
    check: TranscriptCheck


@dataclass(frozen=True)
class PointPlan:
    concurrency: int
    warmup_s: float
    duration_s: float
    timeout_s: float  # a request not answered by then counts as DEADLINE_EXCEEDED


@dataclass(frozen=True)
class _Order:
    """One process's share of a point: slots first_slot .. first_slot + slots - 1."""

    first_slot: int
    slots: int
    plan: PointPlan
    start: float  # time.monotonic() at which warm-up begins
    point: str  # the point's part of its request ids


@dataclass(frozen=True)
class _Report:
    outcomes: list[Outcome]
    cpu_s: float  # this process's user + system CPU time inside the measured window
    problems: list[str]


@dataclass(frozen=True)
class PointResult:
    stats: PointStats
    processes: int
    client_cpu_cores: float  # the client processes' CPU time over the window's length
    # The request ids of the requests sent inside the window start with it, and only theirs:
    # Triton's trace records them (`bench.triton_trace.timeline`).
    request_ids: str = ""

    def to_dict(self) -> dict:
        return {**self.stats.to_dict(), "client_processes": self.processes,
                "client_cpu_cores": self.client_cpu_cores}


def split_slots(concurrency: int, processes: int) -> list[tuple[int, int]]:
    """(first slot, slots) per process: as even as can be, no process idle."""
    used = min(processes, concurrency)
    shares = [concurrency // used + (i < concurrency % used) for i in range(used)]
    firsts = [sum(shares[:i]) for i in range(used)]
    return list(zip(firsts, shares))


class LoadGenerator:
    """Client processes for one server and one list of requests; `run` one point at a time."""

    def __init__(self, url: str, requests: Sequence[LoadRequest], processes: int) -> None:
        self.url, self.requests, self.processes = url, list(requests), processes
        self._workers: list[tuple[multiprocessing.Process, object]] = []

    def __enter__(self) -> LoadGenerator:
        context = multiprocessing.get_context("spawn")  # no inherited gRPC threads
        for _ in range(self.processes):
            parent, child = context.Pipe()
            process = context.Process(target=_worker_main, args=(child, self.url, self.requests), daemon=True)
            process.start()
            self._workers.append((process, parent))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for process, pipe in self._workers:
            try:
                pipe.send(None)
            except OSError:
                pass
        for process, _ in self._workers:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join()
        self._workers.clear()

    def run(self, plan: PointPlan, at_window: Callable[[str], None] | None = None) -> PointResult:
        """One point. `at_window("start")` and `at_window("end")` are called at the measured
        window's edges (to read the server's statistics there)."""
        shares = split_slots(plan.concurrency, len(self._workers))
        start = time.monotonic() + START_DELAY_S
        point = f"{os.getpid()}-{next(_POINTS)}"
        for (first, slots), (_, pipe) in zip(shares, self._workers):
            pipe.send(_Order(first, slots, plan, start, point))
        window = (start + plan.warmup_s, start + plan.warmup_s + plan.duration_s)
        for edge, when in zip(("start", "end"), window):
            time.sleep(max(0.0, when - time.monotonic()))
            if at_window is not None:
                at_window(edge)
        reports: list[_Report] = []
        for _, pipe in self._workers[: len(shares)]:
            reply = pipe.recv()
            if isinstance(reply, BaseException):
                raise reply
            reports.append(reply)
        outcomes = [o for r in reports for o in r.outcomes]
        problems = [p for r in reports for p in r.problems]
        stats = summarize(outcomes, [r.duration_s for r in self.requests], window, plan.concurrency, problems)
        cores = sum(r.cpu_s for r in reports) / plan.duration_s
        return PointResult(stats=stats, processes=len(shares), client_cpu_cores=round(cores, 3),
                           request_ids=window_request_ids(point))  # fmt: skip


# ------------------------------------------------------------------ in each client process


def _worker_main(pipe, url: str, requests: list[LoadRequest]) -> None:
    asyncio.run(_serve_orders(pipe, url, requests))


async def _serve_orders(pipe, url: str, requests: list[LoadRequest]) -> None:
    import tritonclient.grpc.aio as grpc_aio

    clients: list = []  # clients[k] serves this process's slots k * SLOTS_PER_CONNECTION ...

    def client_for(local_slot: int):
        while len(clients) <= local_slot // SLOTS_PER_CONNECTION:
            clients.append(grpc_aio.InferenceServerClient(url, channel_args=CHANNEL_ARGS))
        return clients[local_slot // SLOTS_PER_CONNECTION]

    inputs = [_audio_input(grpc_aio, r.wav) for r in requests]  # built once: the client's work per request stays small
    outputs = [grpc_aio.InferRequestedOutput(tensor_names.FORMATTED)]
    loop = asyncio.get_running_loop()
    try:
        while (order := await loop.run_in_executor(None, pipe.recv)) is not None:
            try:
                report = await _run_order(client_for, requests, inputs, outputs, order)
            except Exception as error:  # the parent raises it
                report = error
            pipe.send(report)
    finally:
        for client in clients:
            await client.close()


def _audio_input(grpc_aio, wav: bytes):
    import numpy as np

    audio = grpc_aio.InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
    audio.set_data_from_numpy(np.array([[wav]], dtype=np.object_))
    return audio


def window_request_ids(point: str) -> str:
    """What the request ids of a point's requests sent inside its window start with."""
    return f"{point}/window/"


def request_id(point: str, in_window: bool, slot: int, sent: int) -> str:
    """A request's id: its point, whether it was sent inside the window (the requests whose
    latencies count), its slot, and how many the slot had sent before it."""
    prefix = window_request_ids(point) if in_window else f"{point}/warm-up/"
    return f"{prefix}{slot}-{sent}"


def first_clip(slot: int, concurrency: int, clips: int) -> int:
    """The clip slot `slot` of `concurrency` sends first: the slots' starts spread evenly over the list."""
    return slot * clips // concurrency


async def _run_order(client_for, requests, inputs, outputs, order: _Order) -> _Report:
    plan = order.plan
    window_start, end = order.start + plan.warmup_s, order.start + plan.warmup_s + plan.duration_s
    outcomes: list[Outcome] = []
    problems: list[str] = []
    cpu: dict[str, float] = {}

    async def clock() -> None:  # this process's CPU time at the window's edges
        for edge, when in (("start", window_start), ("end", end)):
            await asyncio.sleep(max(0.0, when - time.monotonic()))
            times = os.times()
            cpu[edge] = times.user + times.system

    async def slot(index: int) -> None:
        client, k = client_for(index - order.first_slot), first_clip(index, plan.concurrency, len(requests))
        await asyncio.sleep(max(0.0, order.start - time.monotonic()))
        for count in itertools.count():
            if (sent := time.monotonic()) >= end:
                break
            clip = k % len(requests)
            k += 1
            identity = request_id(order.point, window_start <= sent, index, count)
            status, verdict, reason = await _send(client, requests[clip], inputs[clip], outputs, plan.timeout_s, identity)
            outcomes.append(Outcome(clip, sent, time.monotonic(), status, verdict.tokens, verdict.fallback,
                                    verdict.long_sample, verdict.exact, reason, verdict.differs))  # fmt: skip
            problem = verdict.problem
            if problem and len(problems) < 5:
                problems.append(f"{requests[clip].name}: {problem}")

    await asyncio.gather(clock(), *(slot(order.first_slot + i) for i in range(order.slots)))
    return _Report(outcomes=outcomes, cpu_s=cpu["end"] - cpu["start"], problems=problems)


def error_reason(message: str) -> str:
    """An error's message with its numbers masked, so that like errors count as one reason."""
    return re.sub(r"\d+(\.\d+)?", "N", " ".join(message.split()))[:REASON_CHARS]


async def _send(
    client, request: LoadRequest, audio, outputs, timeout_s: float, identity: str
) -> tuple[str, Verdict, str]:
    """One request's status, its transcript's verdict (an empty one for an error) and an error's reason."""
    from tritonclient.utils import InferenceServerException

    try:
        result = await client.infer(
            tensor_names.ENSEMBLE_NAME, [audio], outputs=outputs, parameters=request.parameters,
            client_timeout=timeout_s, request_id=identity,
        )
    except InferenceServerException as error:
        status = status_name(error)
        return status, Verdict(tokens=0, fallback=False, problem=None), error_reason(str(error.message()))
    verdict = judge_json(result.as_numpy(tensor_names.FORMATTED).reshape(-1)[0], request.check)
    return (OK if verdict.ok else BAD_TRANSCRIPT), verdict, ""
