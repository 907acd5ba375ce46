"""A model's own Prometheus metrics through Triton's `pb_utils.MetricFamily`, published
from a thread of their own.

Each metric call is an IPC round trip to the Triton process during which the stub
holds the GIL (every Python thread of the model waits), so a model keeps its numbers
in plain counters and a `Publisher` hands them over every `interval_s`, a fixed number
of calls however many requests they cover. Histograms are kept here (`Histogram`) and
handed over as their cumulative `_bucket{le}`, `_sum` and `_count` counters: one call
per observation kept a metrics thread busy for much of the time under GPU load
(docs/operating.md).
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
from typing import Any

log = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 1.0
# Observations a model keeps for its publisher between two publishes; beyond this the
# oldest are dropped, so a publisher that stopped cannot make them grow without end.
MAX_UNPUBLISHED = 10_000


def unpublished() -> collections.deque:
    """Where a model's threads leave observations for its publisher to drain."""
    return collections.deque(maxlen=MAX_UNPUBLISHED)


class Families:
    """One `MetricFamily` per name, created on first use; every metric carries the instance's labels."""

    def __init__(self, pb_utils: Any, **labels: str) -> None:
        self._family_type = pb_utils.MetricFamily
        self._families: dict[str, Any] = {}
        self._labels = labels

    def _family(self, name: str, description: str, kind: Any) -> Any:
        if name not in self._families:
            self._families[name] = self._family_type(name=name, description=description, kind=kind)
        return self._families[name]

    def counter(self, name: str, description: str, **labels: str) -> Any:
        return self._family(name, description, self._family_type.COUNTER).Metric(labels={**self._labels, **labels})

    def gauge(self, name: str, description: str, **labels: str) -> Any:
        return self._family(name, description, self._family_type.GAUGE).Metric(labels={**self._labels, **labels})

    def histogram(self, name: str, description: str, buckets: list[float]) -> Histogram:
        return Histogram(self, name, description, buckets)

    def clear(self) -> None:
        """Let go of the families (once nothing holds their metrics)."""
        self._families.clear()


class Histogram:
    """A Prometheus histogram counted here and handed to Triton at `flush` as its
    cumulative bucket counters (`<name>_bucket{le=...}`), `<name>_sum` and
    `<name>_count`: what a Prometheus histogram exposes, at one IPC call per
    changed series instead of one per observation."""

    def __init__(self, families: Families, name: str, description: str, bounds: list[float]) -> None:
        self.bounds = sorted(bounds)
        self._buckets = [
            families.counter(f"{name}_bucket", description, le=bound_label(bound))
            for bound in [*self.bounds, float("inf")]
        ]
        self._sum = families.counter(f"{name}_sum", description)
        self._count = families.counter(f"{name}_count", description)
        self._new = [0] * len(self._buckets)  # observations since the last flush, by smallest bucket holding them
        self._new_sum = 0.0

    def observe(self, value: float) -> None:
        self._new[bisect.bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self._new_sum += value

    def flush(self) -> None:
        cumulative = 0
        for bucket, n in zip(self._buckets, self._new):
            cumulative += n
            if cumulative:
                bucket.increment(cumulative)
        if cumulative:
            self._sum.increment(self._new_sum)
            self._count.increment(cumulative)
        self._new = [0] * len(self._buckets)
        self._new_sum = 0.0


def bound_label(bound: float) -> str:
    """A bucket's `le` label as Prometheus clients write it: 0.5, 10, +Inf."""
    return "+Inf" if bound == float("inf") else format(bound, "g")


class Publisher:
    """Calls `publish` on a thread of its own every `interval_s`, and once more at `close`.

    A subclass makes its metrics from `self.families` and then calls `start`."""

    def __init__(self, pb_utils: Any, name: str, interval_s: float = PUBLISH_INTERVAL_S, **labels: str) -> None:
        self.families = Families(pb_utils, **labels)
        self.interval_s = interval_s
        self._name = name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def publish(self) -> None:
        """Hand everything new since the last call to Triton (on the publishing thread)."""
        raise NotImplementedError

    def close(self) -> None:
        """Publish once more, stop the thread, and let go of every metric while the stub
        still runs (call it from `finalize`). Left to the interpreter's exit, the metrics'
        destructors run after the stub has freed its shared memory: each stub then
        segfaults, and tritonserver waits out its exit timeout instead of stopping."""
        self._stop.set()
        self._thread.join(timeout=10)
        families = self.families
        vars(self).clear()  # the metrics first: families must outlive their metrics
        families.clear()

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(self.interval_s)
            try:
                self.publish()
            except Exception:  # metrics must never take the model down
                log.exception("publishing the %s metrics failed", self._name)
            if stopping:
                return
