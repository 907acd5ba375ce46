"""bench.model_phases: the preprocessing and whisper models' phases over a window, from two
readings of their metrics."""

from __future__ import annotations

import pytest

from bench.latency_breakdown import phases_markdown
from bench.model_phases import PREPROCESSING, WHISPER, phase_means


def reading(requests: float, request_s: float, waits: float, wait_s: float, answers: float, answer_s: float) -> dict:
    """whisper_samples of a server whose histograms hold these counts and sums."""
    return {
        "whisper_request_duration_seconds_count": requests, "whisper_request_duration_seconds_sum": request_s,
        "whisper_queue_wait_seconds_count": waits, "whisper_queue_wait_seconds_sum": wait_s,
        "whisper_answer_seconds_count": answers, "whisper_answer_seconds_sum": answer_s,
        'whisper_requests_total{outcome="success"}': requests,
    }  # fmt: skip


def preprocessing_reading(requests: float, seconds: dict[str, float]) -> dict:
    """model_samples of preprocessing's four histograms, each with `requests` observations."""
    return {f"{name}_{part}": (requests if part == "count" else seconds[phase])
            for phase, name in PREPROCESSING.histograms.items() for part in ("count", "sum")}


def test_each_phase_is_its_mean_over_the_requests_between_two_readings():
    before = WHISPER.totals(reading(10, 1.0, 10, 0.2, 10, 0.01))
    after = WHISPER.totals(reading(14, 1.04, 18, 0.28, 14, 0.014))  # four requests, eight windows
    means = WHISPER.means(before, after)
    assert means["requests"] == 4
    assert means["request_ms"] == pytest.approx(10.0)
    assert means["queue_wait_ms"] == pytest.approx(10.0)  # per window: 80 ms over eight
    assert means["answer_ms"] == pytest.approx(1.0)


def test_a_phase_nothing_was_counted_in_is_left_out_and_a_server_without_them_reads_zero():
    empty = WHISPER.totals({})
    assert empty == {"request_ms": (0.0, 0.0), "queue_wait_ms": (0.0, 0.0), "answer_ms": (0.0, 0.0)}
    means = WHISPER.means(empty, WHISPER.totals(reading(2, 0.1, 2, 0.01, 0, 0.0)))
    assert means["requests"] == 2 and "answer_ms" not in means


def test_both_models_are_read_apart_and_preprocessings_parts_are_shown_in_its_table():
    before = {"whisper": WHISPER.totals(reading(10, 1.0, 10, 0.2, 10, 0.01)),
              "preprocessing": PREPROCESSING.totals(preprocessing_reading(
                  10, {"request_ms": 0.03, "decode_ms": 0.01, "log_mel_ms": 0.01, "send_ms": 0.005}))}
    after = {"whisper": WHISPER.totals(reading(12, 1.02, 12, 0.202, 12, 0.0102)),
             "preprocessing": PREPROCESSING.totals(preprocessing_reading(
                 12, {"request_ms": 0.036, "decode_ms": 0.011, "log_mel_ms": 0.012, "send_ms": 0.006}))}
    means = phase_means(before, after)
    assert means["whisper"] == {"requests": 2, "request_ms": 10.0, "queue_wait_ms": 1.0, "answer_ms": 0.1}
    assert means["preprocessing"] == {"requests": 2, "request_ms": 3.0, "decode_ms": 0.5, "log_mel_ms": 1.0,
                                      "send_ms": 0.5}
    table = "\n".join(phases_markdown(means["preprocessing"], "preprocessing"))
    assert "(`preprocessing_*` histograms)" in table and "| its call's log-mels, from the call's last file decoded | 1.0 |" in table
