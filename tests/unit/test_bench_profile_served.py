"""bench.profile_served's py-spy command and its summary of the collapsed stacks."""

from __future__ import annotations

from pathlib import Path

from bench.profile_served import py_spy_command, summarize

ENGINE = "Thread 7 (idle): whisper-engine"
MAIN = "Thread 1: MainThread"
POLLER = "Thread 9: whisper-metrics"
RAW = "\n".join([
    f"{ENGINE};_run (python_backend_lib/engine/scheduler.py:10);_run (python_backend_lib/engine/scheduler.py:12);"
    "step (python_backend_lib/engine/batch.py:20) 60",  # _run twice in one stack: counted once
    f"{ENGINE};_run (python_backend_lib/engine/scheduler.py:10);compression_ratio "
    "(python_backend_lib/transcription/longform.py:72) 30",
    f"{ENGINE};_run (python_backend_lib/engine/scheduler.py:11);synchronize (torch/cuda/streams.py:254) 10",
    f"{MAIN};execute (model_repository/whisper/1/model.py:39) 5",
    f"{MAIN} 15",  # in the stub's own C++ loop: no Python frame
    f"{POLLER};_run (python_backend_lib/serving/prometheus.py:50);Condition.wait (threading.py:355) 99",
    f"{POLLER};_run (python_backend_lib/serving/prometheus.py:51) 1",
    "a line without a count",
])  # fmt: skip


def test_the_summary_shows_each_thread_s_own_frames_and_our_functions_under_them():
    summary = summarize(RAW)
    engine = summary[summary.index(f"### {ENGINE} [_run]: 100 samples"):]
    engine = engine[: engine.index("\n### ")] if "\n### " in engine else engine
    assert "| 60.0 | `step (python_backend_lib/engine/batch.py:20)` |" in engine
    assert "| 30.0 | `compression_ratio (python_backend_lib/transcription/longform.py:72)` |" in engine
    # a function is counted once a sample, whatever line of it the sample was on
    assert "| 100.0 | `_run (python_backend_lib/engine/scheduler.py)` |" in engine
    assert f"### {MAIN} [execute]: 5 samples" in summary and f"### {MAIN} [other]: 15 samples" in summary
    assert "| 100.0 | `(none)` |" in summary
    assert POLLER not in summary  # asleep in a wait 99 samples of 100: left out
    assert summary.index(ENGINE) < summary.index(f"{MAIN} [other]") < summary.index(f"{MAIN} [execute]")


def test_py_spy_samples_idle_frames_unless_asked_for_time_on_a_core():
    idle = py_spy_command(42, 400, 8.7, False, Path("out.txt"))
    busy = py_spy_command(42, 400, 8.7, True, Path("out.txt"))
    assert "--idle" in idle and "--idle" not in busy
    assert busy[:4] == ["py-spy", "record", "--pid", "42"] and "--nonblocking" in busy
    assert busy[busy.index("--duration") + 1] == "8" and busy[busy.index("--output") + 1] == "out.txt"
