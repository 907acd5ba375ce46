"""A stand-in for the metrics part of Triton's `triton_python_backend_utils`: what the models'
metric publishers (`serving.prometheus`) call, recorded for the tests to read."""

from __future__ import annotations


class Metric:
    calls = 0  # every call is an IPC round trip in the real pb_utils
    order: list[str] = []  # the families' names, call by call

    def __init__(self, family, labels, buckets):
        self.family, self.labels, self.buckets = family, labels, buckets
        self.value, self.observed = 0.0, []

    def increment(self, value):
        assert value >= 0, "counters only go up"
        Metric.calls += 1
        Metric.order.append(self.family.name)
        self.value += value

    def set(self, value):
        Metric.calls += 1
        self.value = value

    def observe(self, value):
        Metric.calls += 1
        self.observed.append(value)


class MetricFamily:
    """The part of pb_utils.MetricFamily the exporter uses, recording what it is given."""

    COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
    created: list[Metric] = []

    def __init__(self, name, description, kind):
        self.name, self.kind = name, kind

    def Metric(self, labels, buckets=None):
        assert (buckets is not None) == (self.kind == self.HISTOGRAM)
        metric = Metric(self, labels, buckets)
        MetricFamily.created.append(metric)
        return metric


class PbUtils:
    MetricFamily = MetricFamily
