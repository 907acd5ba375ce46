"""The whisper model's request limit and its metrics, checked without a server."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import CancelledError

import pytest
from fake_pb_utils import Metric as _Metric
from fake_pb_utils import MetricFamily as _MetricFamily
from fake_pb_utils import PbUtils as _PbUtils

from python_backend_lib.contract.faults import Fault
from python_backend_lib.core.errors import RequestError
from python_backend_lib.engine.loading import EngineSetup
from python_backend_lib.serving.admission import Overloaded, RequestLedger
from python_backend_lib.serving.metrics import OUTCOMES, WhisperMetrics, audio_seconds, outcome_label
from python_backend_lib.serving.responses import describe_failure


def test_the_ledger_refuses_one_more_than_its_limit_and_names_it():
    ledger = RequestLedger(2)
    first, second = ledger.enter(), ledger.enter()
    with pytest.raises(Overloaded, match=r"server overloaded: 2 requests in flight, .*max_queued_requests\) is 2; retry later"):
        ledger.enter()
    ledger.leave(first, "done")
    third = ledger.enter()  # room again
    assert ledger.in_flight == 2
    ledger.leave(second, "done")
    ledger.leave(third, "done")
    assert ledger.in_flight == 0


def test_a_full_ledger_given_a_deadline_admits_when_a_request_leaves_before_it():
    ledger = RequestLedger(1)
    first = ledger.enter()
    leaving = threading.Timer(0.2, ledger.leave, (first, "done"))
    leaving.start()
    started = time.monotonic()
    second = ledger.enter(deadline=started + 30)
    assert 0.15 < time.monotonic() - started < 30 and ledger.in_flight == 1
    with pytest.raises(Overloaded, match="server overloaded: 1 requests in flight"):
        ledger.enter(deadline=time.monotonic() + 0.2)  # nobody leaves: refused once the deadline passed
    ledger.leave(second, "done")
    leaving.join()


def test_closing_an_entry_twice_counts_once():
    ledger = RequestLedger(1)
    entry = ledger.enter()
    ledger.leave(entry, "done")
    ledger.leave(entry, RuntimeError("late duplicate"))
    assert ledger.in_flight == 0 and len(ledger.recent) == 1
    ledger.leave(None, ValueError("refused before entering"))  # recorded, nothing to close
    assert 0 <= ledger.recent[0].seconds < 60 and ledger.recent[1].seconds == 0.0


def test_the_ledger_is_exact_under_concurrent_threads():
    ledger = RequestLedger(10_000)

    def churn():
        for _ in range(1000):
            ledger.leave(ledger.enter(), "done")

    threads = [threading.Thread(target=churn) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert ledger.in_flight == 0


def test_overloaded_is_its_own_fault():
    assert describe_failure(Overloaded("server overloaded")) == ("server overloaded", Fault.OVERLOADED)


@pytest.mark.parametrize(
    ("outcome", "label"),
    [
        (RequestError("audio is empty"), "client"),
        (CancelledError("request cancelled"), "cancelled"),
        (Overloaded("full"), "overloaded"),
        (RuntimeError("bug"), "server"),
        (ValueError("slot 3 is already free"), "server"),
        ("a transcript", "success"),
    ],
)
def test_outcome_labels(outcome, label):
    assert outcome_label(outcome) == label
    assert label in OUTCOMES


def test_metrics_publish_the_ledger_and_a_real_engine():
    from python_backend_lib.audio.decode import decode_audio
    from python_backend_lib.audio.features import window_features
    from python_backend_lib.core.options import DecodingOptions
    from python_backend_lib.text.transcript import Transcript
    from python_backend_lib.transcription.pipeline import Pipeline

    pipeline = Pipeline.load("random:tiny", device="cpu", setup=EngineSetup(slots=2))
    ledger = RequestLedger(4)
    _MetricFamily.created = []
    metrics = WhisperMetrics(_PbUtils, pipeline.engine, ledger, gpu="cpu", instance="whisper_0_0", backend="sdpa", interval_s=3600)
    try:
        features = window_features(decode_audio(open("tests/data/audio/jfk.wav", "rb").read()), 80)
        done = threading.Event()
        pipeline.engine.submit(features, DecodingOptions(max_new_tokens=3), lambda _: done.set())
        assert done.wait(60)
        entry = ledger.enter()
        transcript = Transcript(text="", segments=(), language="en", language_probability=None, duration=8.0, windows=())
        ledger.leave(entry, transcript)
        ledger.leave(None, Overloaded("full"))
        metrics.publish()
        metrics.publish()  # nothing new: nothing counted twice
    finally:
        metrics.close()
        pipeline.close()
    by_name = {}
    for metric in _MetricFamily.created:
        assert metric.labels.pop("gpu") == "cpu"  # every metric names its device ...
        assert metric.labels.pop("instance") == "whisper_0_0"  # ... and its engine
        by_name[metric.family.name, tuple(sorted(metric.labels.items()))] = metric
    assert by_name["whisper_requests_total", (("outcome", "success"),)].value == 1
    assert by_name["whisper_requests_total", (("outcome", "overloaded"),)].value == 1
    assert by_name["whisper_audio_seconds_total", ()].value == 8.0
    assert by_name["whisper_real_time_factor_count", ()].value == 1
    assert by_name["whisper_queue_wait_seconds_count", ()].value == 1
    assert by_name["whisper_request_duration_seconds_bucket", (("le", "+Inf"),)].value == 1
    assert by_name["whisper_decode_steps_total", (("path", "eager"),)].value >= 1
    assert by_name["whisper_decode_steps_total", (("path", "cuda_graph"),)].value == 0
    assert by_name["whisper_decoding_slots", ()].value == 2
    assert by_name["whisper_request_limit", ()].value == 4
    assert by_name["whisper_running_batch_size", ()].value == 0
    assert by_name["whisper_engine_healthy", ()].value == 1
    assert by_name["whisper_engine_restarts_total", ()].value == 0
    assert by_name["whisper_attention_backend", (("backend", "sdpa"),)].value == 1
    assert by_name["whisper_process_id", ()].value == os.getpid()
    # this process's resident memory (the engine runs in it here), within what it held then and now
    statm_bytes = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert 0.5 * statm_bytes < by_name["whisper_host_memory_bytes", ()].value <= 1.5 * statm_bytes
    assert not any(name == "whisper_gpu_memory_bytes" for name, _ in by_name)  # on the CPU: no GPU gauges
    assert audio_seconds(transcript) == 8.0 and audio_seconds(RuntimeError()) is None


def test_a_request_is_counted_answered_only_after_its_duration_and_queue_wait():
    """A scrape reads each metric call as it lands: one between a publish's calls must not
    find a request counted as answered while its observations are still to come."""
    from python_backend_lib.text.transcript import Transcript
    from python_backend_lib.transcription.pipeline import Pipeline

    pipeline = Pipeline.load("random:tiny", device="cpu", setup=EngineSetup(slots=2))
    engine = pipeline.engine
    pipeline.close()
    ledger = RequestLedger(4)
    _MetricFamily.created = []
    metrics = WhisperMetrics(_PbUtils, engine, ledger, gpu="cpu", instance="whisper_0_0", backend="sdpa", interval_s=3600)
    transcript = Transcript(text="", segments=(), language="en", language_probability=None, duration=8.0, windows=())
    for _ in range(2):  # admitted (a queue wait each), then answered
        engine.stats.recent_waits.append(0.01)
        ledger.leave(ledger.enter(), transcript)
    _Metric.order = []
    metrics.publish()
    metrics.close()
    order = _Metric.order
    answered = order.index("whisper_requests_total")
    for histogram in ("whisper_request_duration_seconds", "whisper_real_time_factor", "whisper_queue_wait_seconds"):
        assert max(i for i, name in enumerate(order) if name == f"{histogram}_count") < answered, (histogram, order)


def test_histograms_publish_cumulative_buckets_in_a_fixed_number_of_calls():
    """Prometheus's histogram series, made here: `_bucket{le}` counts the values at most
    `le`, whatever number of observations a publish covers."""
    from python_backend_lib.serving.metrics import QUEUE_WAIT_BUCKETS
    from python_backend_lib.transcription.pipeline import Pipeline

    pipeline = Pipeline.load("random:tiny", device="cpu", setup=EngineSetup(slots=2))
    pipeline_engine = pipeline.engine
    _MetricFamily.created = []
    metrics = WhisperMetrics(_PbUtils, pipeline_engine, RequestLedger(4), gpu="cpu", instance="whisper_0_0", backend="sdpa", interval_s=3600)
    pipeline.close()
    waits = [0.0005, 0.001, 0.003, 0.2, 7.0, 100.0] * 50 + [0.02] * 1000
    published = []
    for batch in (waits[:700], waits[700:]):
        pipeline_engine.stats.recent_waits.extend(batch)
        _Metric.calls = 0
        metrics.publish()
        published.append(_Metric.calls)
    metrics.close()
    series = {
        (m.family.name, m.labels.get("le")): m.value for m in _MetricFamily.created if m.family.name.startswith("whisper_queue_wait")
    }
    for bound in QUEUE_WAIT_BUCKETS:
        assert series["whisper_queue_wait_seconds_bucket", format(bound, "g")] == sum(w <= bound for w in waits), bound
    assert series["whisper_queue_wait_seconds_bucket", "+Inf"] == series["whisper_queue_wait_seconds_count", None] == len(waits)
    assert series["whisper_queue_wait_seconds_sum", None] == pytest.approx(sum(waits))
    # Calls grow with the buckets and gauges, not with the 1,300 observations.
    assert max(published) <= len(QUEUE_WAIT_BUCKETS) + 1 + 2 + 10



def test_answer_times_are_published_as_a_histogram_and_drained():
    """`whisper_answer_seconds`: each answer time the service recorded (`WhisperService.answer_times`)
    lands in its bucket once, at the publish after it."""
    import collections

    from python_backend_lib.serving.metrics import ANSWER_BUCKETS
    from python_backend_lib.transcription.pipeline import Pipeline

    pipeline = Pipeline.load("random:tiny", device="cpu", setup=EngineSetup(slots=2))
    _MetricFamily.created = []
    answers: collections.deque = collections.deque()
    metrics = WhisperMetrics(_PbUtils, pipeline.engine, RequestLedger(4), None, answers, gpu="cpu",
                             instance="whisper_0_0", backend="sdpa", interval_s=3600)
    pipeline.close()
    times = [0.0004, 0.0015, 0.0015, 0.03, 4.0]
    answers.extend(times)
    metrics.publish()
    assert not answers  # drained: a second publish counts nothing again
    metrics.publish()
    series = {(m.family.name, m.labels.get("le")): m.value for m in _MetricFamily.created
              if m.family.name.startswith("whisper_answer_seconds")}
    metrics.close()
    for bound in ANSWER_BUCKETS:
        assert series["whisper_answer_seconds_bucket", format(bound, "g")] == sum(t <= bound for t in times), bound
    assert series["whisper_answer_seconds_count", None] == len(times)
    assert series["whisper_answer_seconds_sum", None] == pytest.approx(sum(times))


def test_closing_lets_go_of_every_metric_and_family():
    """Triton's stub crashes when a metric outlives `finalize` (its destructor then runs after the
    stub freed its shared memory), so `close` drops them all while the stub runs."""
    import weakref

    from python_backend_lib.transcription.pipeline import Pipeline

    pipeline = Pipeline.load("random:tiny", device="cpu", setup=EngineSetup(slots=2))
    _MetricFamily.created = []
    metrics = WhisperMetrics(_PbUtils, pipeline.engine, RequestLedger(4), gpu="cpu", instance="whisper_0_0", backend="sdpa", interval_s=3600)
    alive = [weakref.ref(m) for m in _MetricFamily.created] + [weakref.ref(m.family) for m in _MetricFamily.created]
    _MetricFamily.created = []
    metrics.close()
    pipeline.close()
    assert alive and not [ref for ref in alive if ref() is not None]
