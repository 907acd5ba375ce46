"""bench.live_latency's arithmetic: which delta carried which spoken word, and the summary."""

from __future__ import annotations

import numpy as np
import pytest

from bench.live_latency import (
    CpuUse,
    InstanceReading,
    ReferenceWord,
    SessionResult,
    Stream,
    cpu_use,
    instance_fields,
    session_shares,
    summarize,
    word_latencies,
)


def test_each_word_is_timed_by_the_delta_that_carried_it():
    words = tuple(ReferenceWord(key, end) for key, end in [("and", 1.0), ("so", 1.5), ("my", 2.0), ("fellow", 2.5)])
    # "am I" for "my": those two words match nothing; the others are timed from the stream's start (100.0).
    deltas = [(102.0, "And so,"), (104.0, " am I fellow")]
    assert word_latencies(deltas, words, started=100.0) == pytest.approx([1.0, 0.5, 1.5])


def test_the_summary_reads_halves_turns_and_the_slowest_send():
    stream = Stream(pcm=np.zeros(24_000 * 4, "<i2"), words=(ReferenceWord("a", 1.0),) * 4)
    results = [SessionResult(word_latencies_s=[1.0, 2.0, 3.0, 4.0], matched=4, reference_words=4, first_delta_s=2.0,
                             turn_latencies_s=[0.5], turns=1, max_send_lag_s=0.01),
               SessionResult(word_latencies_s=[1.0, 1.0], matched=2, reference_words=4, first_delta_s=3.0,
                             turn_latencies_s=[1.5], turns=2, max_send_lag_s=0.2)]  # a turn never completed
    summary = summarize(results, stream, batch_concurrency=0)
    assert (summary.sessions, summary.words, summary.matched, summary.turns) == (2, 8, 6, 3)
    assert summary.completed_turns == 2
    assert summary.stream_s == 4.0 and summary.max_send_lag_s == 0.2
    assert summary.first_half_p50_s == 1.0 and summary.second_half_p50_s == 3.0  # [1, 2, 1] and [3, 4, 1]
    assert summary.turn_latency_max_s == 1.5 and summary.word_latency_max_s == 4.0


def test_the_gateways_cores_are_summed_over_its_processes_and_the_busiest_named():
    # The parent idles; two workers ran 1.5 and 0.5 cores over 10 s; a worker that ended is left out.
    before = {10: 1.0, 11: 2.0, 12: 3.0, 13: 4.0}
    after = {10: 1.1, 11: 17.0, 12: 8.0, 13: None}
    use = cpu_use(before, after, client_cores=[0.3, 0.1], wall_s=10.0)
    assert use == CpuUse(gateway_cores=2.01, gateway_busiest_core=1.5, client_cores=0.4, client_busiest_core=0.3)
    assert cpu_use({}, {}, client_cores=[0.1], wall_s=10.0) == CpuUse(None, None, 0.1, 0.1)  # no gateway started here


def test_sessions_are_dealt_to_as_few_processes_as_hold_them():
    assert session_shares(1, per_process=50) == [[0]]
    assert session_shares(100, per_process=50) == [list(range(0, 100, 2)), list(range(1, 100, 2))]
    shares = session_shares(201, per_process=50)
    assert len(shares) == 5 and max(map(len, shares)) <= 50
    assert sorted(i for share in shares for i in share) == list(range(201))


def test_a_rows_answers_are_counted_per_instance_and_a_stalled_one_named():
    before = InstanceReading({"gpu0/whisper_0_0": 10.0, "gpu0/whisper_0_1": 12.0}, [])
    after = InstanceReading({"gpu0/whisper_0_0": 110.0, "gpu0/whisper_0_1": 12.0}, ["gpu0/whisper_0_1"])
    assert instance_fields(before, after) == {
        "answered_per_instance": {"gpu0/whisper_0_0": 100, "gpu0/whisper_0_1": 0},
        "stalled_instances": ["gpu0/whisper_0_1"]}
    assert instance_fields(before, "URLError: <urlopen error timed out>") == {
        "metrics_error": "URLError: <urlopen error timed out>"}
    assert instance_fields(None, None) == {}  # a server not started here, and no --metrics-url
