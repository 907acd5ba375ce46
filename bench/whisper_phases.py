"""Where a request's time goes inside the whisper model, from its own metrics over a window.

Triton's statistics end a Python model's request when its `execute` returns; the
whisper model answers later, from its engine and a responder thread. Its own
histograms (docs/operating.md, "Metrics") split that time: from reaching the model to
its answer (`whisper_request_duration_seconds`), a window's way into the decode batch
(`whisper_queue_wait_seconds`: a slot, and its encoder pass started), and the answer's way from the engine's result to Triton
(`whisper_answer_seconds`). Read before and after a window, their sums and counts give
each phase's mean over the window's requests.
"""

from __future__ import annotations

import time

from loadtest.metrics import whisper_samples

# Phase -> its histogram; each mean is reported in ms.
PHASES = {
    "request_ms": "whisper_request_duration_seconds",
    "queue_wait_ms": "whisper_queue_wait_seconds",
    "answer_ms": "whisper_answer_seconds",
}
# The whisper model publishes its metrics once a second (`serving.metrics.PUBLISH_INTERVAL_S`).
PUBLISH_WAIT_S = 1.2
SETTLE_TIMEOUT_S = 10.0


def phase_totals(samples: dict[str, float]) -> dict[str, tuple[float, float]]:
    """Each phase's (sum in seconds, count) in one reading (`loadtest.metrics.whisper_samples`)."""
    return {phase: (samples.get(f"{name}_sum", 0.0), samples.get(f"{name}_count", 0.0)) for phase, name in PHASES.items()}


def settled_totals(metrics_url: str, timeout_s: float = SETTLE_TIMEOUT_S) -> dict[str, tuple[float, float]]:
    """`phase_totals` once two publishes agree and every request counted has its answer time
    (an answer's time is published after its request, up to a publish later); the last reading
    after `timeout_s` otherwise."""
    deadline = time.monotonic() + timeout_s
    last = phase_totals(whisper_samples(metrics_url))
    while time.monotonic() < deadline:
        time.sleep(PUBLISH_WAIT_S)
        now = phase_totals(whisper_samples(metrics_url))
        if now == last and now["answer_ms"][1] >= now["request_ms"][1]:
            return now
        last = now
    return last


def phase_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Each phase's mean in ms over the requests between two readings, with `requests`, the
    successful requests counted in between; a phase with nothing counted is left out."""
    means: dict[str, float] = {"requests": after["request_ms"][1] - before["request_ms"][1]}
    for phase in PHASES:
        seconds = after[phase][0] - before[phase][0]
        count = after[phase][1] - before[phase][1]
        if count > 0:
            means[phase] = round(1e3 * seconds / count, 3)
    return means
