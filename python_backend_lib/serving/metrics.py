"""The whisper model's own Prometheus metrics, served on Triton's metrics port.

Triton's `/metrics` already counts requests, queue and compute time per model
(`nv_inference_*`). The whisper model answers from its engine thread, after
`execute` has returned, so those say little about decoding; these add what the
engine sees. All are documented in docs/operating.md ("Metrics").

The engine and the request ledger keep plain counters; `WhisperMetrics` reads
them on its own thread every `interval_s` (`serving.prometheus.Publisher`), so no
metric call ever runs on the engine thread or delays a request.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from python_backend_lib.contract.faults import Fault
from python_backend_lib.devices.memory_use import memory_use
from python_backend_lib.serving.admission import RequestLedger
from python_backend_lib.serving.prometheus import PUBLISH_INTERVAL_S, Publisher
from python_backend_lib.serving.responses import describe_failure

log = logging.getLogger(__name__)

SUCCESS = "success"
# Values of the `outcome` label: success, or whose fault a failure was.
OUTCOMES = (SUCCESS, *(fault.value for fault in Fault))

# Histogram upper bounds (Prometheus adds +Inf).
REQUEST_SECONDS_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0]
REAL_TIME_FACTOR_BUCKETS = [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]
QUEUE_WAIT_BUCKETS = [0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
ANSWER_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.5]
# whisper_gpu_memory_bytes's `pool` label, in the order memory_use reads them.
GPU_MEMORY_POOLS = ("allocated", "reserved")


def outcome_label(outcome: object) -> str:
    """`success` for a result, else the failure's `Fault` value (client, cancelled, server, overloaded)."""
    if not isinstance(outcome, BaseException):
        return SUCCESS
    return describe_failure(outcome).fault.value


def audio_seconds(outcome: object) -> float | None:
    """Seconds of audio a successful outcome decoded (a `DecodedRecording`'s duration)."""
    return getattr(outcome, "duration", None) if not isinstance(outcome, BaseException) else None


@dataclass(frozen=True)
class Counters:
    """Monotonic totals read from the engine and its decode batch."""

    steps_graph: int
    steps_eager: int
    graph_fallbacks: int
    failed_steps: int
    restarts: int


def read_counters(engine: Any) -> Counters:
    counts, stats = engine.batch.counts, engine.stats
    return Counters(
        counts.graph_steps, counts.eager_passes, counts.graph_fallbacks, stats.failed_steps, stats.restarts
    )


class WhisperMetrics(Publisher):
    """Publishes the engine's and the ledger's numbers as Prometheus metrics.

    pb_utils: `triton_python_backend_utils` (or anything with its `MetricFamily` API).
    engine: the `Engine` whose batch is watched; ledger: the whisper model's `RequestLedger`;
    stall_watch: the instance's `StallWatch`, whose verdict `whisper_engine_stalled` tells.
    answer_times: seconds from each request's outcome to its response handed to Triton
        (`WhisperService.answer_times`), drained at each publish.
    gpu: this instance's `gpu` label (`device_label`); instance: its `instance` label, Triton's
        name for it (whisper_0_1): each engine, several on one GPU too, has its own series.
    backend: what decodes (`loading.AttentionBackendName` value), published as an info metric.
    """

    def __init__(
        self,
        pb_utils: Any,
        engine: Any,
        ledger: RequestLedger,
        stall_watch: Any = None,
        answer_times: collections.deque | None = None,
        *,
        gpu: str,
        instance: str,
        backend: str,
        interval_s: float = PUBLISH_INTERVAL_S,
    ) -> None:
        super().__init__(pb_utils, "whisper-metrics", interval_s, gpu=gpu, instance=instance)
        self.engine = engine
        self.ledger = ledger
        self.stall_watch = stall_watch
        self.answer_times = answer_times
        family = self.families
        self._requests = {
            label: family.counter("whisper_requests_total", "Requests answered, by outcome", outcome=label)
            for label in OUTCOMES
        }
        self._audio = family.counter("whisper_audio_seconds_total", "Seconds of audio transcribed")
        self._request_seconds = family.histogram(
            "whisper_request_duration_seconds",
            "Seconds from a request reaching the whisper model to its answer (successful requests)",
            REQUEST_SECONDS_BUCKETS,
        )
        self._rtf = family.histogram(
            "whisper_real_time_factor",
            "Per successful request: seconds to answer divided by seconds of audio",
            REAL_TIME_FACTOR_BUCKETS,
        )
        self._queue_wait = family.histogram(
            "whisper_queue_wait_seconds",
            "Seconds from a 30 s window's submission to the engine until it joined the decode batch: its wait "
            "for a slot, and its encoder pass started (on the CPU, run)",
            QUEUE_WAIT_BUCKETS,
        )
        self._answer = family.histogram(
            "whisper_answer_seconds",
            "Seconds from a request's outcome on the engine thread to its response handed to Triton "
            "(a responder thread's wait, the outputs written, the send)",
            ANSWER_BUCKETS,
        )
        self._in_flight = family.gauge("whisper_requests_in_flight", "Requests held by the whisper model")
        self._running = family.gauge("whisper_running_batch_size", "Windows in the decode batch")
        self._waiting = family.gauge("whisper_waiting_windows", "Windows waiting for a decoding slot")
        self._slots = family.gauge("whisper_decoding_slots", "Windows the engine decodes together at most")
        self._limit = family.gauge("whisper_request_limit", "Requests held at most before new ones are refused")
        steps = "Decoder steps, by how they ran: cuda_graph (in a captured graph, a run's each counted) or eager"
        self._steps = {
            "cuda_graph": family.counter("whisper_decode_steps_total", steps, path="cuda_graph"),
            "eager": family.counter("whisper_decode_steps_total", steps, path="eager"),
        }
        self._fallbacks = family.counter(
            "whisper_cuda_graph_fallbacks_total", "Steps run eagerly because no captured graph held the batch"
        )
        self._failed_steps = family.counter(
            "whisper_failed_steps_total", "Decoder steps that raised and were retried request by request"
        )
        self._restarts = family.counter(
            "whisper_engine_restarts_total",
            "Times the engine loop failed, answered every window it held with an error, and started again",
        )
        self._healthy = family.gauge(
            "whisper_engine_healthy",
            "1 while the engine serves; 0 once it gave up after failing repeatedly, or stalled",
        )
        self._heartbeat = family.gauge(
            "whisper_heartbeat_timestamp_seconds",
            "Unix time of the instance's last metrics publish: one that stops moving is a frozen process",
        )
        self._heartbeat.set(time.time())
        self._process_id = family.gauge(
            "whisper_process_id",
            "The instance's process id: what `whisper-triton serve` kills when the process freezes",
        )
        self._process_id.set(os.getpid())
        self._healthy.set(1)  # a new gauge reads 0 until the first publish: the launcher would take it for unhealthy
        self._stalled = family.gauge(
            "whisper_engine_stalled",
            "1 once the engine made no progress for its bound while holding requests (they failed); else 0",
        )
        backend_info = family.gauge(
            "whisper_attention_backend",
            "1 for the attention backend that decodes: flashinfer+cuda_graphs (the GPU engine), flashinfer or sdpa",
            backend=backend,
        )
        backend_info.set(1)
        self._device = engine.batch.device
        self._host_memory = family.gauge("whisper_host_memory_bytes", "Resident host memory of the instance's process")
        memory = "Bytes PyTorch holds on the instance's GPU: allocated (tensors) or reserved (kept by its allocator)"
        self._gpu_memory = {pool: family.gauge("whisper_gpu_memory_bytes", memory, pool=pool)
                            for pool in GPU_MEMORY_POOLS} if self._device.type == "cuda" else {}  # fmt: skip
        self._published = Counters(0, 0, 0, 0, 0)
        self._slots.set(engine.slots)
        self._limit.set(ledger.limit)
        self.start()

    def publish(self) -> None:
        answered: collections.Counter = collections.Counter()
        audio = 0.0
        while self.ledger.recent:
            finished = self.ledger.recent.popleft()
            label = outcome_label(finished.outcome)
            answered[label] += 1
            seconds = audio_seconds(finished.outcome)
            if label == SUCCESS and seconds is not None:
                audio += seconds
                self._request_seconds.observe(finished.seconds)
                if seconds > 0:
                    self._rtf.observe(finished.seconds / seconds)
        waits = self.engine.stats.recent_waits
        while waits:
            self._queue_wait.observe(waits.popleft())
        # An answer time exists once its response is sent, after the request was counted
        # answered: it may come one publish after the request's count.
        answers = self.answer_times if self.answer_times is not None else ()
        while answers:
            self._answer.observe(answers.popleft())
        # The observations go out before the counts of the requests they belong to: each
        # call is seen by a scrape as it lands, so a scrape that counts a request
        # answered finds its duration and queue wait counted too.
        for histogram in (self._request_seconds, self._rtf, self._queue_wait, self._answer):
            histogram.flush()
        for label, n in answered.items():
            self._requests[label].increment(n)
        if audio:
            self._audio.increment(audio)
        counters, last = read_counters(self.engine), self._published
        for metric, now, before in (
            (self._steps["cuda_graph"], counters.steps_graph, last.steps_graph),
            (self._steps["eager"], counters.steps_eager, last.steps_eager),
            (self._fallbacks, counters.graph_fallbacks, last.graph_fallbacks),
            (self._failed_steps, counters.failed_steps, last.failed_steps),
            (self._restarts, counters.restarts, last.restarts),
        ):
            if now > before:
                metric.increment(now - before)
        self._published = counters
        self._in_flight.set(self.ledger.in_flight)
        self._running.set(self.engine.running)
        self._waiting.set(self.engine.waiting)
        self._healthy.set(1 if self.engine.healthy else 0)
        self._stalled.set(1 if self.stall_watch is not None and self.stall_watch.fired else 0)
        use = memory_use(self._device)
        if use.host_resident_bytes is not None:
            self._host_memory.set(use.host_resident_bytes)
        for pool, value in zip(GPU_MEMORY_POOLS, (use.gpu_allocated_bytes, use.gpu_reserved_bytes)):
            if pool in self._gpu_memory and value is not None:
                self._gpu_memory[pool].set(value)
        self._heartbeat.set(time.time())
