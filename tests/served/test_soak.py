"""The soak test (loadtest/soak.py) against the session server: mixed load (short
clips, a long recording, word timestamps, bad input, cancels, clients that hang
up, injected faults), then every request accounted for, nothing left in the
whisper model, the server ready and its memory back near where it was.

The short run (a minute of load) runs with the suite. The 10-minute one is the
record in docs/benchmarks/soak.md (`python -m loadtest.soak --serve --seconds 600
--record docs/benchmarks/soak`); here it runs with `--soak-seconds=600`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import FAULT_PROMPT

REPO_ROOT = Path(__file__).resolve().parents[2]
# loadtest/ is a folder of the checkout, not part of the installed package.
sys.path.insert(0, str(REPO_ROOT))

from loadtest.soak import Server, soak  # noqa: E402
from loadtest.soak_report import JUDGED_MODELS, SoakReport  # noqa: E402
from loadtest.soak_requests import WEIGHTS, Result  # noqa: E402

# The warm-up sends each kind once however short it is (loadtest.soak.warmup_kinds), and
# memory is read with the server settled, once its idle engine gave freed memory back:
# also once in the middle of the short soak, so that its settled checkpoints run served.
SHORT_WARMUP_S, SHORT_SOAK_S, SHORT_SETTLE_EVERY_S = 10.0, 40.0, 20.0


def session(server) -> Server:
    return Server(server.http_url, server.grpc_url, server.metrics_url, FAULT_PROMPT)


def check(report: SoakReport) -> None:
    assert report.problems() == [], "\n".join(report.problems())
    every_kind = {kind for counts in (report.counts, report.warmup_counts) for kind in counts}
    assert every_kind == set(WEIGHTS), f"kinds never sent: {set(WEIGHTS) - every_kind}"
    totals = {result: sum(by.get(result.value, 0) for by in report.counts.values()) for result in Result}
    assert totals[Result.UNEXPECTED] == 0
    assert totals[Result.TRANSCRIBED] > 0 and totals[Result.REFUSED] > 0 and totals[Result.CANCELLED] > 0, totals
    assert report.after.counters['whisper_requests_total{outcome="success"}'] > report.before.counters[
        'whisper_requests_total{outcome="success"}'
    ]
    for _, checkpoint in report.checkpoints:
        assert checkpoint.idle and checkpoint.ready and set(JUDGED_MODELS) <= set(checkpoint.rss_mib)


@pytest.mark.server
def test_a_minute_of_mixed_load_leaves_every_request_accounted_for(server):
    report = soak(session(server), SHORT_SOAK_S, warmup_seconds=SHORT_WARMUP_S, settle_every=SHORT_SETTLE_EVERY_S)
    check(report)
    assert [second for second, _ in report.checkpoints] == [SHORT_SETTLE_EVERY_S]


@pytest.mark.server
@pytest.mark.slow
def test_a_long_soak(server, request):
    seconds = request.config.getoption("--soak-seconds")
    if not seconds:
        pytest.skip("the long soak runs with --soak-seconds=600 (its record: python -m loadtest.soak --serve --seconds 600)")
    check(soak(session(server), seconds))
