"""Where a served request's time goes, from Triton's own timestamps (`whisper-triton serve --trace-file`).

Triton's "triton" trace mode writes, for every traced request, the times (CLOCK_MONOTONIC,
nanoseconds: the clock of Python's `time.monotonic_ns`) at which the gRPC or HTTP
front end read it and sent its answer, the ensemble started and received the answer, and
each model's request was queued, its `execute` started and returned. Here these become
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
import statistics
from dataclasses import dataclass
from pathlib import Path

# The front end's first timestamp once the request is read: GRPC_WAITREAD_START is
# when the server began waiting for it, which includes the client's idle time.
RECEIVED = ("GRPC_WAITREAD_END", "HTTP_RECV_END")
# Per-model events worth reading, in the order they normally happen.
MODEL_EVENTS = {"QUEUE_START": "queued", "COMPUTE_START": "execute starts", "COMPUTE_END": "execute returns"}
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


def read_trace(path: Path) -> dict[int, dict]:
    """Triton's trace file -> {trace id: {"model": name, "parent": id or None, "ns": {event: ns}}}."""
    traces: dict[int, dict] = collections.defaultdict(lambda: {"model": None, "parent": None, "ns": {}})
    for record in json.loads(path.read_text()):
        trace = traces[record["id"]]
        if "model_name" in record:
            trace["model"], trace["parent"] = record["model_name"], record.get("parent_id")
        for stamp in record.get("timestamps", ()):
            trace["ns"].setdefault(stamp["name"], stamp["ns"])
    return dict(traces)


def timeline(traces: dict[int, dict], ensemble: str, last_s: float | None = None) -> Timeline:
    """The median timeline of `ensemble` requests; with last_s, of those the front end read
    in the last_s seconds before the last one (a measured window after a warm-up)."""
    children: dict[int, list[dict]] = collections.defaultdict(list)
    for trace in traces.values():
        if trace["parent"] is not None:
            children[trace["parent"]].append(trace)
    received_ns = {
        trace_id: next(trace["ns"][name] for name in RECEIVED if name in trace["ns"])
        for trace_id, trace in traces.items()
        if trace["model"] == ensemble and any(name in trace["ns"] for name in RECEIVED)
    }
    since_ns = max(received_ns.values()) - last_s * 1e9 if received_ns and last_s is not None else 0
    offsets: dict[str, list[float]] = collections.defaultdict(list)
    requests = 0
    for trace_id, received in received_ns.items():
        trace = traces[trace_id]
        if received < since_ns:
            continue
        requests += 1
        for name, label in ENSEMBLE_EVENTS.items():
            if name in trace["ns"]:
                offsets[label].append((trace["ns"][name] - received) / 1e6)
        for child in children[trace_id]:
            for name, label in MODEL_EVENTS.items():
                if name in child["ns"]:
                    offsets[f"{child['model']}: {label}"].append((child["ns"][name] - received) / 1e6)
    events = [
        TimelineEvent(label, round(statistics.median(values), 3), round(_p90(values), 3))
        for label, values in offsets.items()
    ]
    return Timeline(requests, sorted(events, key=lambda event: event.median_ms))


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def markdown(line: Timeline, client_p50_ms: float | None = None) -> list[str]:
    """The timeline as a table; with the client's median latency, what lies outside the server."""
    lines = [f"Triton's trace of {line.requests} requests (`--trace-file`): each event's offset from the moment "
             "the front end had read the request.", "",
             "| event | median ms | p90 ms | since the event before (medians) |", "|---|---|---|---|"]  # fmt: skip
    before = 0.0
    for event in line.events:
        lines.append(f"| {event.label} | {event.median_ms} | {event.p90_ms} | {event.median_ms - before:.3f} |")
        before = event.median_ms
    if client_p50_ms is not None:
        lines += ["", f"The client's median latency is {client_p50_ms} ms: about {client_p50_ms - before:.2f} ms "
                  "lie outside these events (the client, the transport, and the front end's reading of the request)."]  # fmt: skip
    return lines
