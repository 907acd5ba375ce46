"""The preprocessing model's own Prometheus metrics, served on Triton's metrics port.

`preprocessing` answers from its decoding threads after `execute` has returned, so
Triton's `nv_inference_compute_*` for it count little more than handing the files to
those threads. These histograms time what follows, per request answered with its
log-mel (`preprocessing_service.RequestTiming`; a file that fails to decode is not
timed): the whole of it, the file's decoding (with its wait for a thread), the call's
log-mels and the response's send. They are labelled, like the whisper model's, by `gpu`
and `instance`; docs/operating.md lists them.
"""

from __future__ import annotations

import collections
from typing import Any

from python_backend_lib.serving.preprocessing_service import RequestTiming
from python_backend_lib.serving.prometheus import PUBLISH_INTERVAL_S, Publisher

# Histogram upper bounds (Prometheus adds +Inf): a short file's log-mel on a GPU takes
# well under a millisecond, an hour's decoding on the CPU seconds.
SECONDS_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0]
# The histograms, by the `RequestTiming` field each observes.
HISTOGRAMS = {
    "total": ("preprocessing_request_duration_seconds",
              "Seconds from execute taking a request to its response handed to Triton "
              "(requests answered with a log-mel)"),
    "decode": ("preprocessing_decode_seconds",
               "Seconds from execute taking a request until its file was decoded: the wait for a decoding thread, "
               "the decoding, and the speech detection where asked for"),
    "log_mel": ("preprocessing_log_mel_seconds",
                "Seconds the log-mels of a request's execute call took, from the call's last file decoded"),
    "send": ("preprocessing_send_seconds",
             "Seconds from a request's log-mel ready to its response handed to Triton"),
}


class PreprocessingMetrics(Publisher):
    """Publishes the timings a `PreprocessingService` leaves in its `timings` deque.

    gpu: this instance's `gpu` label (`settings.device_label`); instance: Triton's name for
    it (preprocessing_0_3)."""

    def __init__(self, pb_utils: Any, timings: collections.deque[RequestTiming], *, gpu: str, instance: str,
                 interval_s: float = PUBLISH_INTERVAL_S) -> None:
        super().__init__(pb_utils, "preprocessing-metrics", interval_s, gpu=gpu, instance=instance)
        self.timings = timings
        self._histograms = {field: self.families.histogram(name, description, SECONDS_BUCKETS)
                            for field, (name, description) in HISTOGRAMS.items()}
        self.start()

    def publish(self) -> None:
        while self.timings:
            timing = self.timings.popleft()
            for field, histogram in self._histograms.items():
                histogram.observe(getattr(timing, field))
        for histogram in self._histograms.values():
            histogram.flush()
