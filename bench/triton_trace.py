"""Where a served request's time goes, from Triton's own timestamps (`whisper-triton serve --trace-file`).

Triton's "triton" trace mode writes, for every traced request, the times (CLOCK_MONOTONIC,
nanoseconds: the clock of Python's `time.monotonic_ns`) at which the gRPC or HTTP
front end read it and sent its answer, the ensemble started and received the answer, and
each model's request was queued, its `execute` started, handed the inputs over, had its
outputs back and returned, and the request ended (`MODEL_EVENTS`). Here these become
a timeline of the ensemble request: each event's offset from the moment the front end
had read the request, as the median over the traced requests.

A Python model that answers from its own thread (it returns None from `execute`) has
its `execute` end when the stub reports the call done, which may come after its
response: the timeline lists events in their median order, so such an event shows
where it really fell.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field
from pathlib import Path

from bench.stats import percentile_summary

# The front end's first timestamp once the request is read: GRPC_WAITREAD_START is
# when the server began waiting for it, which includes the client's idle time.
RECEIVED = ("GRPC_WAITREAD_END", "HTTP_RECV_END")
# Per-model events worth reading, in the order they normally happen. For a Python-backend
# model (r24.10's python_be.cc) the backend's execute starts, writes the requests for its
# stub process ("inputs handed over"), gets the stub's `execute` return ("stub returned"),
# then sends the responses that return carried (a GPU output costs one more round trip to
# the stub) and returns; "released" is Triton's end of the request.
MODEL_EVENTS = {
    "QUEUE_START": "queued",
    "COMPUTE_START": "execute starts",
    "COMPUTE_INPUT_END": "inputs handed over",
    "COMPUTE_OUTPUT_START": "stub returned",
    "COMPUTE_END": "execute returns",
    "REQUEST_END": "released",
}
ENSEMBLE_EVENTS = {
    "REQUEST_START": "ensemble starts",
    "INFER_RESPONSE_COMPLETE": "ensemble has the answer",
    "GRPC_SEND_START": "gRPC sends the answer",
    "GRPC_SEND_END": "gRPC sent the answer",
    "HTTP_SEND_END": "HTTP sent the answer",
}


@dataclass(frozen=True)
class TimelineEvent:
    label: str
    median_ms: float  # from the front end's receipt of the request
    p90_ms: float


@dataclass(frozen=True)
class Timeline:
    requests: int  # ensemble requests in it
    events: list[TimelineEvent]  # in order of their medians

    @classmethod
    def from_record(cls, record: dict) -> Timeline:
        """Inverse of `dataclasses.asdict`, for a timeline read back from a results file."""
        return cls(record["requests"], [TimelineEvent(**event) for event in record["events"]])


@dataclass
class Trace:
    """One traced request: of the ensemble (parent None) or of a model inside it."""

    model: str | None = None
    parent: int | None = None
    request_id: str = ""  # the client's, as Triton records it
    ns: dict[str, int] = field(default_factory=dict)  # event name -> its first timestamp

    def received_ns(self) -> int | None:
        return next((self.ns[name] for name in RECEIVED if name in self.ns), None)


def trace_files(path: Path) -> list[Path]:
    """The files Triton wrote for `serve --trace-file path`: `path` itself when it wrote only
    on stopping, else `path`.0, `path`.1 and so on, in order (`triton_output.trace_flags`)."""
    numbered = [p for p in path.parent.glob(f"{path.name}.*") if p.suffix[1:].isdigit()]
    return ([path] if path.exists() else []) + sorted(numbered, key=lambda p: int(p.suffix[1:]))


def read_trace(path: Path) -> dict[int, Trace]:
    """Triton's trace files (`trace_files`) -> their traces by id (a trace's records come one
    event at a time). FileNotFoundError when Triton wrote none."""
    files = trace_files(path)
    if not files:
        raise FileNotFoundError(path)
    traces: dict[int, Trace] = collections.defaultdict(Trace)
    for record in (record for file in files for record in json.loads(file.read_text())):
        trace = traces[record["id"]]
        if "model_name" in record:
            trace.model, trace.parent = record["model_name"], record.get("parent_id")
            trace.request_id = record.get("request_id", "")
        for stamp in record.get("timestamps", ()):
            trace.ns.setdefault(stamp["name"], stamp["ns"])
    return dict(traces)


def timeline(traces: dict[int, Trace], ensemble: str, request_ids: str = "") -> Timeline:
    """The median timeline of the `ensemble` requests whose request ids start with
    `request_ids` (a load point's measured window: `bench.load.PointResult.request_ids`), so
    that it covers the very requests whose latencies the client measured."""
    children: dict[int, list[Trace]] = collections.defaultdict(list)
    for trace in traces.values():
        if trace.parent is not None:
            children[trace.parent].append(trace)
    received_ns = {
        trace_id: trace.received_ns()
        for trace_id, trace in traces.items()
        if trace.model == ensemble and trace.request_id.startswith(request_ids) and trace.received_ns() is not None
    }
    offsets_s: dict[str, list[float]] = collections.defaultdict(list)
    for trace_id, received in received_ns.items():
        events = [(label, traces[trace_id].ns.get(name)) for name, label in ENSEMBLE_EVENTS.items()]
        events += [(f"{child.model}: {label}", child.ns.get(name))
                   for child in children[trace_id] for name, label in MODEL_EVENTS.items()]  # fmt: skip
        for label, at_ns in events:
            if at_ns is not None:
                offsets_s[label].append((at_ns - received) / 1e9)
    summaries = {label: percentile_summary(values) for label, values in offsets_s.items()}
    events = [TimelineEvent(label, summary["p50"], summary["p90"]) for label, summary in summaries.items()]
    return Timeline(len(received_ns), sorted(events, key=lambda event: event.median_ms))


def markdown(line: Timeline, client_p50_ms: float | None = None) -> list[str]:
    """The timeline as a table; with the client's median latency, what lies outside the server."""
    lines = [f"Triton's trace of {line.requests} requests (`--trace-file`): each event's offset from the moment "
             "the front end had read the request.", "",
             "| event | median ms | p90 ms | since the event before (medians) |", "|---|---|---|---|"]  # fmt: skip
    before = 0.0
    for event in line.events:
        lines.append(f"| {event.label} | {event.median_ms} | {event.p90_ms} | {event.median_ms - before:.2f} |")
        before = event.median_ms
    if client_p50_ms is not None:
        lines += ["", f"The client's median latency is {client_p50_ms} ms: about {client_p50_ms - before:.2f} ms "
                  "lie outside these events (the client, the transport, and the front end's reading of the request)."]  # fmt: skip
    return lines
