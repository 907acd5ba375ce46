"""The served benchmark against the real thing: `whisper-triton serve` (the stand-in repository and
a random-weight checkpoint with forced lengths), the load generator's processes, the engine alone and
transformers, on the CPU. The whole run is `python -m bench.served --quick --device cpu`."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import lean_model_repository

from bench.clips import load_clips
from bench.engine_alone import EnginePlan, run_engine
from bench.jobs import forced_jobs, real_jobs
from bench.load import LoadGenerator, PointPlan
from bench.server_process import ServeCommand, ServerProcess
from bench.standin import canned_check, canned_verbose_json, write_standin_repository
from bench.stats import OK
from bench.transcripts import text_tokens
from bench.transformers_sweep import TransformersPlan, run_transformers
from python_backend_lib.checkpoints.configs import load_config
from python_backend_lib.checkpoints.weights import hf_directory

pytestmark = [pytest.mark.slow, pytest.mark.server]
STARTUP_S = 600.0


@pytest.fixture(scope="module")
def short_clips():
    return [c for c in load_clips() if c.clip.duration_s <= 4.0][::6]


def quiet(message: str) -> None:
    pass


def test_the_stand_in_answers_every_request_at_once_with_the_canned_transcript(tmp_path, short_clips):
    eot = load_config("default").special.eot
    canned = canned_check(eot)
    requests = [j.load_request() for j in real_jobs(short_clips, eot)]
    requests = [dataclasses.replace(r, check=canned) for r in requests]
    # The tests' instance counts (tests/conftest.py), as every server of the tests runs.
    command = ServeCommand("default", write_standin_repository(tmp_path / "repository", lean_model_repository(tmp_path)))
    with ServerProcess(command, tmp_path / "serve.log", STARTUP_S) as server, \
            LoadGenerator(command.grpc_url, requests, processes=2) as load:
        assert server.metadata()["version"] == "2.51.0"
        result = load.run(PointPlan(concurrency=4, warmup_s=1.0, duration_s=4.0, timeout_s=60.0))
    stats = result.stats
    assert stats.sent > 4 and set(stats.statuses) == {OK}, stats.problems
    assert stats.mean_tokens == canned.expected_tokens == text_tokens(canned_verbose_json(), eot)
    assert result.processes == 2 and result.client_cpu_cores > 0


def test_random_weights_decode_exactly_the_forced_text_tokens_through_the_server(tmp_path, short_clips):
    from python_backend_lib.checkpoints.served_random import write_served_checkpoint

    folder = write_served_checkpoint("random:tiny:0", tmp_path / "checkpoint", emit_text=True)
    eot = load_config(str(folder)).special.eot
    jobs = forced_jobs(short_clips, eot, tokens_per_second=3.0)
    command = ServeCommand(str(folder), lean_model_repository(tmp_path))
    with ServerProcess(command, tmp_path / "serve.log", STARTUP_S), \
            LoadGenerator(command.grpc_url, [j.load_request() for j in jobs], processes=1) as load:
        stats = load.run(PointPlan(concurrency=2, warmup_s=0.5, duration_s=4.0, timeout_s=120.0)).stats
    assert stats.sent >= 2 and set(stats.statuses) == {OK}, stats.problems  # every answer had its forced length
    expected = {j.check.expected_tokens for j in jobs}
    assert min(expected) <= stats.mean_tokens <= max(expected)


def test_the_engine_alone_and_transformers_transcribe_the_same_clips(short_clips):
    jobs = real_jobs(short_clips[:3], load_config("default").special.eot)
    engine = run_engine(jobs, EnginePlan("default", "cpu", min_requests=3), quiet)
    assert engine["requests"] == 3 and engine["processes"] == 1 and not engine["failed"] and engine["rtfx"] > 0
    hf = run_transformers(jobs, TransformersPlan(hf_directory("default"), "cpu", (1, 2), min_batches=3), quiet,
                          deadline=float("inf"))
    # timestamps as served (on), then off; no compiled variant on the CPU
    assert [(r["variant"], r["batch"]) for r in hf["rows"]] == [
        ("dynamic cache, eager, timestamps on", 1), ("dynamic cache, eager, timestamps on", 2),
        ("dynamic cache, eager, timestamps off", 1), ("dynamic cache, eager, timestamps off", 2)]
    assert all(r["batches"] >= 3 for r in hf["rows"]) and hf["best"]["rtfx"] > 0
    # greedy tiny.en, the same clips: transformers writes as many text tokens as the library does
    assert hf["rows"][0]["mean_tokens"] == pytest.approx(engine["mean_tokens"], abs=0.5)


def test_the_engine_alone_runs_as_many_processes_as_asked(short_clips):
    jobs = real_jobs(short_clips[:2], load_config("default").special.eot)
    engine = run_engine(jobs, EnginePlan("default", "cpu", min_requests=2, processes=2), quiet)
    # each process ran every clip once (2 requests each), each transcript checked
    assert engine["processes"] == 2 and engine["requests"] == 4 and not engine["failed"]
    assert engine["wall_s"] > 0 and engine["rtfx"] > 0
