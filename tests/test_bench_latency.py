"""bench.latency_breakdown: its interval arithmetic, and a real run of the engine on the CPU."""

from __future__ import annotations

import json

from bench.latency_breakdown import covered, main


def test_overlapping_kernels_count_once_and_gaps_not_at_all():
    assert covered([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (1.5, 2.5)]) == 4.0
    assert covered([]) == 0.0


def test_a_cpu_run_times_every_request_and_its_decoder_steps(tmp_path):
    main(["--model", "tiny-random", "--tokens-per-second", "2.732", "--device", "cpu",
          "--warmup", "1", "--requests", "2", "--profiled", "1", "--out", str(tmp_path)])  # fmt: skip
    record = json.loads((tmp_path / "latency-breakdown.json").read_text())
    engine = record["engine"]
    assert record["clip_s"] == 4.96
    assert engine["requests"] == 2 and 0 < engine["latency_ms"]["p50"] <= engine["latency_ms"]["p99"]
    steps = engine["engine_thread"]["decoder step (on the engine thread)"]
    # 2.732 text tokens per second of a 4.96 s clip: 14 forced tokens, one step each at least.
    assert steps["calls"] >= 14
    assert engine["graph_steps_per_request"] == 0  # no CUDA graphs on the CPU
    assert (tmp_path / "latency-breakdown.md").read_text().startswith("# Latency of one 4.96 s clip")
    assert (tmp_path / "latency-breakdown-trace.json.gz").stat().st_size > 0
