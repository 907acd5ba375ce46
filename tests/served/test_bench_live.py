"""bench.live_latency's batch clients against the real server: every request they send is
answered or counted failed with its reason, and none waits past the bench's timeout."""

from __future__ import annotations

import asyncio

import pytest
from conftest import RunningServer

from bench import live_latency

pytestmark = pytest.mark.server


def test_every_batch_request_is_answered_or_counted_failed_with_its_reason(server: RunningServer, monkeypatch):
    load = asyncio.run(live_latency.batch_load(server.grpc_url, concurrency=2, seconds=2.0))
    assert load.requests > 0 and load.audio_s > 0 and load.failed == {}

    # A timeout no answer can meet: each request fails at its deadline and is counted, by its reason.
    monkeypatch.setattr(live_latency, "BATCH_TIMEOUT_S", 0.001)
    load = asyncio.run(live_latency.batch_load(server.grpc_url, concurrency=2, seconds=1.0))
    assert load.requests == 0 and load.audio_s == 0.0
    assert sum(load.failed.values()) >= 2 and all(r.startswith("DEADLINE_EXCEEDED") for r in load.failed), load.failed
