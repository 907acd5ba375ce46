"""bench.live_latency against the real server and gateway: its batch clients account for
every request they send, none waiting past the bench's timeout, and its live sessions run
in processes of their own."""

from __future__ import annotations

import asyncio

import pytest
from conftest import RunningServer

from bench import live_latency
from bench.gpu_soak import settle

pytestmark = pytest.mark.server


def test_every_batch_request_is_answered_or_counted_failed_with_its_reason(server: RunningServer, monkeypatch):
    # A timeout no answer can meet: each request fails at its deadline and is counted, by its reason.
    # For a tenth of a second only: each cancelled request still waits in preprocessing's queue
    # (256), so a whole second's 600 overflowed it (refused as overloaded, not late), and a storm
    # of deadlines that long once crashed Triton 2.51's gRPC server, shared by the tests after it
    # (an upstream race between a cancellation and the response, fixed after 2.51: reliability.md).
    with monkeypatch.context() as patch:
        patch.setattr(live_latency, "BATCH_TIMEOUT_S", 0.001)
        load = asyncio.run(live_latency.batch_load(server.grpc_url, concurrency=2, seconds=0.1))
    assert load.answered == load.requests == 0 and load.audio_s == 0.0
    assert sum(load.failed.values()) == load.sent >= 2, load
    assert all(reason.startswith("DEADLINE_EXCEEDED") for reason in load.failed), load.failed

    # The server decodes on what those clients gave up on, as it does what earlier tests of
    # the shared server left: once nothing is held, the instances' counts in the window are
    # this load's requests alone, as a row reads them (the stub publishes every second).
    assert not any(settle(server.metrics_url)["held_after"].values())
    before = live_latency.read_instances(server.metrics_url)
    load = asyncio.run(live_latency.batch_load(server.grpc_url, concurrency=2, seconds=2.0))
    assert load.sent >= 2 and load.answered == load.sent and load.failed == {}, load
    assert not any(settle(server.metrics_url)["held_after"].values())
    fields = live_latency.instance_fields(before, live_latency.read_instances(server.metrics_url))
    assert sum(fields["answered_per_instance"].values()) == load.answered and fields["stalled_instances"] == []


def test_live_sessions_run_in_processes_of_their_own_and_complete_their_turns(gateway: str):
    """Two sessions, one a process, streaming jfk.wav at the speed of speech through the
    real gateway: each completes its turn without an error, its deltas carry the file's
    words, and each process reports the cores it kept busy."""
    stream = live_latency.reference_stream(gateway, names=("jfk.wav",))
    url = gateway.replace("http://", "ws://") + "/realtime?intent=transcription"
    results, cores = asyncio.run(live_latency.sessions_apart(url, stream, sessions=2, per_process=1))
    assert len(results) == 2 and len(cores) == 2 and all(0 < c < 1.5 for c in cores), cores
    for result in results:
        assert result.errors == [] and result.turns >= 1, result
        assert len(result.turn_latencies_s) == result.turns, "a turn never completed"
        assert result.matched >= 0.8 * len(stream.words), (result.matched, len(stream.words))
