"""bench.suite_profile: CPU samples charged to the test their process worked for, and
bench.suite_clock, the plugin that logs when each test ran."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.suite_clock import CLOCK_FILE_ENV
from bench.suite_profile import (
    BETWEEN_TESTS,
    OUTSIDE,
    START_S,
    Birth,
    Sample,
    Span,
    Trace,
    by_command,
    by_file,
    charge,
    read_spans,
    read_trace,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
# Two workers (10, 20); worker 10 started a server (11) whose stub (12) does the work of
# worker 10's tests; 30 is a process of nobody's (the install, another user). At 150 s
# the pid 12 is taken again, by a child of 30's.
FORKS = {
    10: [Birth(0.0, 1)], 20: [Birth(0.0, 1)], 11: [Birth(90.0, 10)], 12: [Birth(91.0, 11), Birth(150.0, 30)],
    30: [Birth(0.0, 1)],
}  # fmt: skip
SPANS = [
    Span(10, 100.0, 110.0, "tests/served/test_a.py::test_one@session-server-1"),
    Span(10, 110.0, 120.0, "tests/served/test_a.py::test_two@session-server-1"),
    Span(20, 100.0, 130.0, "tests/unit/test_b.py::test_three"),
]


def test_a_servers_stub_is_charged_to_the_test_its_worker_runs():
    samples = [
        Sample(12, 105.0, "triton_python_b"),  # the stub, during test_one
        Sample(12, 115.0, "triton_python_b"),  # the stub, during test_two
        Sample(12, 115.5, "triton_python_b"),
        Sample(10, 101.0, "python"),  # worker 10 itself
        Sample(20, 101.0, "python"),  # worker 20 at the same time: its own test
        Sample(30, 101.0, "pip"),
        Sample(11, 200.0, "whisper-triton"),  # long after worker 10's last test
        Sample(12, 160.0, "sed"),  # the pid's new process: nobody's
    ]
    charged = charge(Trace(samples, FORKS), SPANS)
    assert charged == {
        "tests/served/test_a.py::test_one@session-server-1": 2,
        "tests/served/test_a.py::test_two@session-server-1": 2,
        "tests/unit/test_b.py::test_three": 1,
        OUTSIDE: 2,
        BETWEEN_TESTS: 1,
    }
    assert by_file(charged)["tests/served/test_a.py"] == 4


def test_samples_are_counted_by_command_and_their_processes_start():
    samples = [
        Sample(12, 100.0, "triton_python_b"),
        Sample(12, 100.0 + START_S - 0.1, "triton_python_b"),  # still starting
        Sample(12, 100.0 + START_S, "triton_python_b"),  # started
        Sample(13, 300.0, "triton_python_b"),  # another stub's first sample
        Sample(0, 100.0, "swapper"),
    ]
    commands, starting = by_command(Trace(samples, {}))
    assert commands == {"triton_python_b": 4, "swapper": 1}
    assert starting == {"triton_python_b": 3, "swapper": 1}


def test_perf_scripts_lines_and_the_clock_file_are_read(tmp_path):
    script = tmp_path / "trace.txt"
    script.write_text(
        "          python 12520 48372.119952: \n"
        " triton_python_b 399 48380.5: \n"
        "            bash  2498 50044.510141: PERF_RECORD_FORK(2500:2500):(2498:2498)\n"  # a process
        "            perf  2494 50044.414095: PERF_RECORD_FORK(2494:2499):(2494:2494)\n"  # a thread of 2494
        "         dirname  2501 50044.514943: PERF_RECORD_EXIT(2501:2501):(2500:2500)\n"
        "not a sample\n"
    )
    trace = read_trace(script)
    assert trace.samples == [Sample(12520, 48372.119952, "python"), Sample(399, 48380.5, "triton_python_b")]
    assert trace.forks == {2500: [Birth(50044.510141, 2498)]}
    clock = tmp_path / "clock.tsv"
    clock.write_text("7\t1.000\t2.500\ttests/x.py::test[a b]\n")
    assert read_spans(clock) == [Span(7, 1.0, 2.5, "tests/x.py::test[a b]")]


def test_the_plugin_logs_each_test_of_a_real_run(tmp_path):
    (tmp_path / "test_two.py").write_text("def test_first():\n    pass\n\n\ndef test_second():\n    pass\n")
    clock = tmp_path / "clock.tsv"
    environment = {**os.environ, CLOCK_FILE_ENV: str(clock), "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "bench.suite_clock", "test_two.py"],
        cwd=tmp_path, env=environment, check=True, capture_output=True,
    )  # fmt: skip
    spans = read_spans(clock)
    assert [span.nodeid for span in spans] == ["test_two.py::test_first", "test_two.py::test_second"]
    assert all(span.start <= span.end for span in spans) and spans[0].end <= spans[1].start
    assert len({span.worker for span in spans}) == 1
