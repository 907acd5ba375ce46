"""The preprocessing model's metrics (`serving.preprocessing_metrics`), checked without a server:
each request's timing lands once in each of its four histograms, labelled by instance."""

from __future__ import annotations

import collections
import weakref

import pytest
from fake_pb_utils import MetricFamily, PbUtils

from python_backend_lib.serving.preprocessing_metrics import HISTOGRAMS, SECONDS_BUCKETS, PreprocessingMetrics
from python_backend_lib.serving.preprocessing_service import RequestTiming


def test_each_timing_lands_in_its_four_histograms_once():
    MetricFamily.created = []
    timings: collections.deque = collections.deque()
    metrics = PreprocessingMetrics(PbUtils, timings, gpu="0", instance="preprocessing_0_3", interval_s=3600)
    recorded = [RequestTiming(decode=0.0004, log_mel=0.0015, send=0.0002, total=0.0031),
                RequestTiming(decode=0.02, log_mel=0.0015, send=0.0003, total=0.03),
                RequestTiming(decode=3.0, log_mel=0.2, send=0.001, total=3.5)]
    timings.extend(recorded)
    metrics.publish()
    assert not timings  # drained: a second publish counts nothing again
    metrics.publish()
    series = {(m.family.name, m.labels.get("le")): m.value for m in MetricFamily.created}
    labels = {(m.labels["gpu"], m.labels["instance"]) for m in MetricFamily.created}
    metrics.close()
    assert labels == {("0", "preprocessing_0_3")}
    for field, (name, _) in HISTOGRAMS.items():
        values = [getattr(t, field) for t in recorded]
        for bound in SECONDS_BUCKETS:
            assert series[f"{name}_bucket", format(bound, "g")] == sum(v <= bound for v in values), (name, bound)
        assert series[f"{name}_bucket", "+Inf"] == series[f"{name}_count", None] == len(recorded)
        assert series[f"{name}_sum", None] == pytest.approx(sum(values))


def test_closing_lets_go_of_every_metric_and_family():
    """As the whisper model's: a metric that outlives `finalize` crashes Triton's stub."""
    MetricFamily.created = []
    metrics = PreprocessingMetrics(PbUtils, collections.deque(), gpu="cpu", instance="preprocessing_0_0",
                                   interval_s=3600)
    alive = [weakref.ref(m) for m in MetricFamily.created] + [weakref.ref(m.family) for m in MetricFamily.created]
    MetricFamily.created = []
    metrics.close()
    assert alive and not [ref for ref in alive if ref() is not None]
