"""bench.whisper_phases: the whisper model's phases over a window, from two readings of its metrics."""

from __future__ import annotations

import pytest

from bench.whisper_phases import phase_means, phase_totals


def reading(requests: float, request_s: float, waits: float, wait_s: float, answers: float, answer_s: float) -> dict:
    """whisper_samples of a server whose histograms hold these counts and sums."""
    return {
        "whisper_request_duration_seconds_count": requests, "whisper_request_duration_seconds_sum": request_s,
        "whisper_queue_wait_seconds_count": waits, "whisper_queue_wait_seconds_sum": wait_s,
        "whisper_answer_seconds_count": answers, "whisper_answer_seconds_sum": answer_s,
        'whisper_requests_total{outcome="success"}': requests,
    }  # fmt: skip


def test_each_phase_is_its_mean_over_the_requests_between_two_readings():
    before = phase_totals(reading(10, 1.0, 10, 0.2, 10, 0.01))
    after = phase_totals(reading(14, 1.04, 18, 0.28, 14, 0.014))  # four requests, eight windows
    means = phase_means(before, after)
    assert means["requests"] == 4
    assert means["request_ms"] == pytest.approx(10.0)
    assert means["queue_wait_ms"] == pytest.approx(10.0)  # per window: 80 ms over eight
    assert means["answer_ms"] == pytest.approx(1.0)


def test_a_phase_nothing_was_counted_in_is_left_out_and_a_server_without_them_reads_zero():
    empty = phase_totals({})
    assert empty == {"request_ms": (0.0, 0.0), "queue_wait_ms": (0.0, 0.0), "answer_ms": (0.0, 0.0)}
    means = phase_means(empty, phase_totals(reading(2, 0.1, 2, 0.01, 0, 0.0)))
    assert means["requests"] == 2 and "answer_ms" not in means
