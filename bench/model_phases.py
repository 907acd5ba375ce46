"""Where a request's time goes inside the preprocessing and whisper models, from their own
metrics over a window.

Triton's statistics end a Python model's request when its `execute` returns; both models
answer later, from threads of their own. Their own histograms (docs/operating.md,
"Metrics") split that time:
- whisper: from reaching the model to its answer (`whisper_request_duration_seconds`), a
  window's way into the decode batch (`whisper_queue_wait_seconds`: a slot, and its encoder
  pass started), and the answer's way from the engine's result to Triton
  (`whisper_answer_seconds`);
- preprocessing: from `execute` taking a request to its answer
  (`preprocessing_request_duration_seconds`), and in it the file's decoding, the call's
  log-mels and the send (`preprocessing_decode_seconds`, `_log_mel_seconds`, `_send_seconds`).
Read before and after a window, their sums and counts give each phase's mean over the
window's requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from loadtest.metrics import model_samples

# The models publish their metrics once a second (`serving.prometheus.PUBLISH_INTERVAL_S`).
PUBLISH_WAIT_S = 1.2
SETTLE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ModelPhases:
    """One model's phases: phase -> its histogram; each mean is reported in ms."""

    prefix: str  # what its metrics' names start with
    histograms: dict[str, str]
    requests: str  # the phase whose count is the requests answered
    trailing: str  # a phase whose count may trail the requests' by a publish

    def totals(self, samples: dict[str, float]) -> dict[str, tuple[float, float]]:
        """Each phase's (sum in seconds, count) in one reading (`loadtest.metrics.model_samples`)."""
        return {phase: (samples.get(f"{name}_sum", 0.0), samples.get(f"{name}_count", 0.0))
                for phase, name in self.histograms.items()}

    def means(self, before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
        """Each phase's mean in ms over the requests between two readings, with `requests`, the
        requests counted in between; a phase with nothing counted is left out."""
        means: dict[str, float] = {"requests": after[self.requests][1] - before[self.requests][1]}
        for phase in self.histograms:
            seconds = after[phase][0] - before[phase][0]
            count = after[phase][1] - before[phase][1]
            if count > 0:
                means[phase] = round(1e3 * seconds / count, 3)
        return means


WHISPER = ModelPhases("whisper_", {
    "request_ms": "whisper_request_duration_seconds",
    "queue_wait_ms": "whisper_queue_wait_seconds",
    "answer_ms": "whisper_answer_seconds",
}, requests="request_ms", trailing="answer_ms")  # an answer's time is published after its request
PREPROCESSING = ModelPhases("preprocessing_", {
    "request_ms": "preprocessing_request_duration_seconds",
    "decode_ms": "preprocessing_decode_seconds",
    "log_mel_ms": "preprocessing_log_mel_seconds",
    "send_ms": "preprocessing_send_seconds",
}, requests="request_ms", trailing="request_ms")  # one publish flushes all four
MODELS = {"whisper": WHISPER, "preprocessing": PREPROCESSING}

Totals = dict[str, dict[str, tuple[float, float]]]  # model -> phase -> (sum in seconds, count)


def read_totals(metrics_url: str) -> Totals:
    return {model: phases.totals(model_samples(metrics_url, phases.prefix)) for model, phases in MODELS.items()}


def settled_totals(metrics_url: str, timeout_s: float = SETTLE_TIMEOUT_S) -> Totals:
    """`read_totals` once two publishes agree and every request counted has its trailing phase
    (up to a publish later); the last reading after `timeout_s` otherwise."""
    deadline = time.monotonic() + timeout_s
    last = read_totals(metrics_url)
    while time.monotonic() < deadline:
        time.sleep(PUBLISH_WAIT_S)
        now = read_totals(metrics_url)
        complete = all(now[m][p.trailing][1] >= now[m][p.requests][1] for m, p in MODELS.items())
        if now == last and complete:
            return now
        last = now
    return last


def phase_means(before: Totals, after: Totals) -> dict[str, dict[str, float]]:
    """Each model's phase means over the requests between two readings (`ModelPhases.means`)."""
    return {model: phases.means(before[model], after[model]) for model, phases in MODELS.items()}
