"""bench.latency_breakdown: its interval arithmetic, and a real run of the engine on the CPU."""

from __future__ import annotations

import functools
import json
import shutil
import time
from pathlib import Path

import pytest
from conftest import launch_server, lean_model_repository

from bench import latency_breakdown, latency_rounds, latency_variants
from bench.latency_breakdown import covered, main
from bench.load import request_id, window_request_ids
from bench.triton_trace import Trace, read_trace, timeline, trace_files
from clients.api import WhisperClient, new_request_id
from python_backend_lib.apps.triton_output import TRACE_LOG_FREQUENCY


def test_overlapping_kernels_count_once_and_gaps_not_at_all():
    assert covered([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0), (1.5, 2.5)]) == 4.0
    assert covered([]) == 0.0


def test_the_timeline_holds_exactly_the_requests_sent_inside_the_point_s_window():
    """The client's latencies count the requests sent inside a point's window; the trace's
    timeline must cover the same ones, not its warm-up's nor another point's."""
    traces: dict[int, Trace] = {}
    for point, in_window, latency_ms in [("7-1", True, 10.0), ("7-1", True, 20.0), ("7-1", False, 900.0),
                                         ("7-10", True, 800.0), ("7-2", True, 700.0)]:  # fmt: skip
        ensemble_id = len(traces) + 1
        identity = request_id(point, in_window, 0, ensemble_id)
        stamps = {"GRPC_WAITREAD_END": 0, "GRPC_SEND_END": int(latency_ms * 1e6)}
        traces[ensemble_id] = Trace("transcribe", None, identity, stamps)
        traces[ensemble_id + 100] = Trace("whisper", ensemble_id, identity, {"QUEUE_START": 1_000_000})
    line = timeline(traces, "transcribe", window_request_ids("7-1"))
    assert line.requests == 2
    assert {event.label: event.median_ms for event in line.events} == {"gRPC sent the answer": 15.0, "whisper: queued": 1.0}


def test_every_trace_file_triton_wrote_is_read_in_order(tmp_path):
    """Triton writes traces to PATH.0, PATH.1, ... as it goes (`serve --trace-file PATH`), and
    to PATH alone where it writes only on stopping; a trace's events may span two files."""
    path = tmp_path / "trace.json"
    with pytest.raises(FileNotFoundError):
        read_trace(path)
    parts = {"2": [{"id": 1, "model_name": "transcribe", "request_id": "r"}],
             "10": [{"id": 1, "timestamps": [{"name": "GRPC_SEND_END", "ns": 9}]}]}  # fmt: skip
    for index, records in parts.items():
        (tmp_path / f"trace.json.{index}").write_text(json.dumps(records))
    (tmp_path / "trace.json.gz").write_bytes(b"")  # not Triton's: never read
    assert trace_files(path) == [tmp_path / "trace.json.2", tmp_path / "trace.json.10"]
    trace = read_trace(path)[1]
    assert (trace.model, trace.request_id, trace.ns) == ("transcribe", "r", {"GRPC_SEND_END": 9})


def test_the_record_names_another_checkout_s_engine_and_its_commit(tmp_path, monkeypatch):
    """Run from another checkout's folder, the engine measured is that checkout's: the record
    says so, with the commit beside it, and never passes it off as this repository's."""
    import python_backend_lib

    assert latency_breakdown.library_record() == {}
    (tmp_path / "python_backend_lib").mkdir()
    (tmp_path / "COMMIT").write_text("0aec2f4\n")
    monkeypatch.setattr(python_backend_lib, "__file__", str(tmp_path / "python_backend_lib" / "__init__.py"))
    library = latency_breakdown.library_record()
    assert library == {"checkout": str(tmp_path), "checkout_commit": "0aec2f4"}
    assert f"another checkout: {tmp_path}, commit 0aec2f4" in "\n".join(latency_breakdown.library_line(library))


def test_repeated_runs_of_a_variant_are_one_row_with_each_run_s_figure(tmp_path):
    """bench.latency_variants: runs of one label and model are repeats, shown each and in the
    mean; a run from another checkout is credited to that checkout's commit."""

    def run(p50: float, model: str = "tiny", checkout: str | None = None) -> dict:
        kernels = {"kernels_per_step": 90.0, "gpu_busy_ms_per_request": 4.5}
        return {"model": model, "clip_s": 4.96, "machine": "GPU, 16 CPUs",
                "library": {"checkout": "/c", "checkout_commit": checkout} if checkout else {},
                "provenance": {"commit": "a" * 40, "date": "now", "call": None},
                "engine": {"latency_ms": {"p50": p50}, "kernels": kernels}}  # fmt: skip

    paths = []
    for i, (label, record) in enumerate([("before", run(10.0, checkout="b" * 40)), ("after", run(9.0)),
                                         ("before", run(12.0, checkout="b" * 40)), ("after", run(8.0)),
                                         ("after", run(50.0, model="large"))]):  # fmt: skip
        path = tmp_path / f"{i}.json"
        path.write_text(json.dumps(record))
        paths.append(f"{label}={path}")
    latency_variants.main(["--out", str(tmp_path / "out"), "--note", "by hand", *paths])
    assert latency_variants.rows(json.loads((tmp_path / "out" / "latency-variants.json").read_text())["runs"]) == [
        ["tiny", "before", "bbbbbbb", "10.0 / 12.0", 11.0, 90.0, 4.5],
        ["tiny", "after", "aaaaaaa", "9.0 / 8.0", 8.5, 90.0, 4.5],
        ["large", "after", "aaaaaaa", "50.0", 50.0, 90.0, 4.5],
    ]
    assert "by hand" in (tmp_path / "out" / "latency-variants.md").read_text()
    assert (tmp_path / "out" / "latency-variants.png").stat().st_size > 0


def test_each_step_part_is_also_shown_against_its_own_runs_admission(tmp_path):
    """bench.latency_variants' host table: a part's time a call, and that time over the same
    run's admission, averaged over the runs; a host twice as slow in one run moves the first
    figure, not the second. The checkpoint before each step counts with the step's parts
    (it took over one of them); the engine loop's other parts are left out, and so is a
    part that not every run has (a version that split its step otherwise)."""

    def run(admit_ms: float, prepare_ms: float, remember: bool) -> dict:
        thread = {"admit (encoder launched)": admit_ms, "engine loop: collect new windows": 0.05,
                  "engine loop: checkpoint the rows": 0.01,
                  "decoder step (on the engine thread)": 4 * prepare_ms, "  step: prepare (page tables, staging)": prepare_ms,
                  **({"  step: remember the rows": 0.03} if remember else {})}
        return {"model": "tiny", "clip_s": 4.96, "machine": "GPU, 16 CPUs", "library": {},
                "provenance": {"commit": "a" * 40, "date": "now", "call": None},
                "engine": {"latency_ms": {"p50": 8.0}, "kernels": {"kernels_per_step": 90.0, "gpu_busy_ms_per_request": 4.5},
                           "engine_thread": {k: {"ms_per_call": v} for k, v in thread.items()}}}  # fmt: skip

    runs = [{"label": "before", "record": run(0.5, 0.05, True)}, {"label": "before", "record": run(1.0, 0.10, True)},
            {"label": "after", "record": run(0.5, 0.04, False)}]  # fmt: skip
    assert latency_variants.host_rows(runs) == [["tiny", "before", "10.0 (0.015)", "300.0 (0.400)", "75.0 (0.100)"],
                                                ["tiny", "after", "10.0 (0.020)", "160.0 (0.320)", "40.0 (0.080)"]]  # fmt: skip
    assert latency_variants.host_rows(runs[:2])[0][-1] == "30.0 (0.045)"  # every run has it: shown
    assert latency_variants.host_rows([{"label": "x", "record": {**run(0.5, 0.04, False), "engine": {"latency_ms": {}}}}]) == []
    path = tmp_path / "record.json"
    path.write_text(json.dumps({"runs": runs, "note": None}))
    latency_variants.main(["--out", str(tmp_path / "out"), "--from-record", str(path)])
    assert "| tiny | after | 10.0 (0.020) | 160.0 (0.320) | 40.0 (0.080) |" in (tmp_path / "out" / "latency-variants.md").read_text()


def test_variants_run_each_from_its_own_checkout_in_turn(tmp_path):
    """bench.latency_variants --variant: each run imports its own folder's library (another
    commit's checkout, or this repository's), rounds alternating the variants; the record
    credits each run to its code."""
    checkout = tmp_path / "checkout"
    shutil.copytree(Path(latency_breakdown.__file__).resolve().parents[1] / "python_backend_lib",
                    checkout / "python_backend_lib", ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    (checkout / "COMMIT").write_text("0aec2f4\n")
    latency_variants.main(["--out", str(tmp_path / "out"), "--model", "tiny-random", "--tokens-per-second", "2.732",
                           "--rounds", "2", "--variant", f"before={checkout}", "--variant", "after=.",
                           "--breakdown-args", "--device", "cpu", "--warmup", "0", "--requests", "1", "--profiled", "1"])  # fmt: skip
    runs = json.loads((tmp_path / "out" / "latency-variants.json").read_text())["runs"]
    assert [run["label"] for run in runs] == ["before", "after", "before", "after"]
    libraries = [run["record"]["library"] for run in runs]
    assert libraries[0] == libraries[2] == {"checkout": str(checkout), "checkout_commit": "0aec2f4"}
    assert libraries[1] == libraries[3] == {}  # this repository's own
    assert [row[2] for row in latency_variants.rows(runs)][0] == "0aec2f4"


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


@pytest.mark.server
def test_the_trace_is_on_disk_while_the_server_still_runs(tmp_path):
    """A GPU server is often stopped past Triton's exit timeout, and Triton writes what it
    holds back only on a clean stop: with `serve --trace-file`, each TRACE_LOG_FREQUENCY
    traced requests are on disk as they come. Cancels to `whisper` are answered at once,
    which makes them the quickest requests to trace."""
    path = tmp_path / "trace.json"
    with launch_server(tmp_path, arguments=(f"--trace-file={path}", "--trace-rate=1")) as launched:
        with WhisperClient(launched.server.grpc_url, "grpc", timeout_s=60) as client:
            for _ in range(TRACE_LOG_FREQUENCY + 5):
                client.cancel(new_request_id())
        deadline = time.monotonic() + 30
        while not trace_files(path) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert launched.process.poll() is None, "the server stopped: the trace proves nothing"
        traces = read_trace(path)
    assert sum(trace.model == "whisper" for trace in traces.values()) >= TRACE_LOG_FREQUENCY


@pytest.mark.server
def test_a_served_run_reads_tritons_trace_and_statistics_of_every_model(tmp_path, monkeypatch):
    """`--served` starts the real server with `--trace-file`: every measured request's timeline
    has the ensemble's and the models' events, in the order a request goes through them, and
    Triton's statistics of the window count each request once in every model."""
    monkeypatch.setattr(latency_breakdown, "STATE_DIR", tmp_path / "state")
    # The tests' instance counts (tests/conftest.py), as every server of the tests runs.
    serve = functools.partial(latency_rounds.ServeCommand, model_repository=lean_model_repository(tmp_path))
    monkeypatch.setattr(latency_rounds, "ServeCommand", serve)
    main(["--model", "tiny-random", "--tokens-per-second", "2.732", "--device", "cpu", "--warmup", "1",
          "--requests", "1", "--profiled", "1", "--served", "--served-seconds", "2", "--out", str(tmp_path)])  # fmt: skip
    served = json.loads((tmp_path / "latency-breakdown.json").read_text())["served"]
    trace = served["trace"]
    # On a busy machine one request can outlast the window: one request or more, the same
    # ones the client measured and Triton's statistics count.
    assert trace["requests"] == served["models"]["transcribe"]["requests"] >= 1
    at = {event["label"]: event["median_ms"] for event in trace["events"]}
    assert 0 <= at["ensemble starts"] <= at["preprocessing: queued"] <= at["preprocessing: execute starts"]
    # whisper gets the waveform only once preprocessing answered, and the ensemble its answer from whisper.
    assert at["preprocessing: execute starts"] < at["whisper: queued"] <= at["whisper: execute starts"]
    assert at["whisper: execute starts"] < at["ensemble has the answer"] <= at["gRPC sent the answer"]
    # Each model's own events, as its Python backend makes them in every request, in order:
    # the stub has the inputs, returns from `execute`, the backend returns, the request ends.
    for name in ("preprocessing", "whisper", "postprocessing"):
        steps = ("queued", "execute starts", "inputs handed over", "stub returned", "execute returns", "released")
        assert [at[f"{name}: {step}"] for step in steps] == sorted(at[f"{name}: {step}"] for step in steps)
    # The client sent each request before the front end read it, and had its answer only
    # once the front end began to send it: per request, and so in the medians of the same
    # requests, its latency covers the server's span up to then. (The front end marks the
    # send's end once its write completes, which on a busy machine can come after the
    # client has read the answer.)
    assert at["gRPC sends the answer"] <= served["latency_ms"]["p50"]
    # The whisper model's own metrics over the same window: each request counted once, its
    # answer's way to Triton a part of the time it spent in the model, that part of the client's.
    phases = served["whisper_phases"]
    assert phases["requests"] == served["models"]["whisper"]["requests"]
    assert 0 < phases["answer_ms"] < phases["request_ms"] <= served["latency_ms"]["mean"]
    # preprocessing's: its requests the same, its parts within its whole (one request an
    # execute call: no wait for another file), the whole within the client's time.
    pre = served["preprocessing_phases"]
    assert pre["requests"] == served["models"]["preprocessing"]["requests"]
    parts = pre["decode_ms"] + pre["log_mel_ms"] + pre["send_ms"]
    assert min(pre["decode_ms"], pre["log_mel_ms"], pre["send_ms"]) > 0
    assert parts <= pre["request_ms"] * 1.001 + 0.01 and pre["request_ms"] < served["latency_ms"]["mean"]
    # Triton's statistics of the same window: every request went through the three models once.
    models = served["models"]
    assert {"transcribe", "preprocessing", "whisper", "postprocessing"} <= set(models)
    for name in ("preprocessing", "whisper", "postprocessing"):
        assert models[name]["requests"] == models["transcribe"]["requests"]
        assert models[name]["failures"] == 0 and models[name]["execute_ms"] > 0
    report = (tmp_path / "latency-breakdown.md").read_text()
    assert "## The served request, by Triton's statistics" in report
    assert "## The served request, by Triton's trace" in report
    assert "## Inside the preprocessing model, by its own metrics" in report
