"""Where the test suite's CPU goes, test by test: machine-wide CPU samples charged to
the test each sample's process was working for.

On a 2-core machine the suite keeps both cores busy, so its wall time follows the CPU
it spends, and a test's own duration misleads: a served test's work is done by the
server's stubs, which belong to the worker that started the server. So a sample of any
process goes up its parent chain to an xdist worker, and is charged to the test that
worker was running at the sample's time. perf's own fork records give each process's
parent as it was then (pids are reused in a run this long). The recipe
(docs/benchmarks/test-suite.md):

    perf record -k CLOCK_MONOTONIC -F 29 -a -o perf.data -- env SUITE_CLOCK_FILE=clock.tsv \\
        python -m pytest -n 2 --dist loadgroup -p bench.suite_clock
    perf script -i perf.data --show-task-events -F comm,pid,time > trace.txt
    python -m bench.suite_profile trace.txt clock.tsv
"""

from __future__ import annotations

import argparse
import bisect
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

BETWEEN_TESTS = "(between tests)"  # collection, fixtures' teardown after the last test, xdist
OUTSIDE = "(outside the workers)"  # pytest's controller, the install, other work on the machine
# A test's end is taken when its report is made; what its teardown leaves running (a
# server stopping) lands just after.
END_GRACE_S = 0.5
SAMPLE = re.compile(r"\s*(?P<command>.+?)\s+(?P<pid>\d+)\s+(?P<time>[\d.]+):\s*$")
# A new process (its pid equals its thread id; a new thread keeps its process's pid).
FORK = re.compile(r"\s*.+?\s+\d+\s+(?P<time>[\d.]+): PERF_RECORD_FORK\((?P<pid>\d+):(?P=pid)\):\((?P<parent>\d+):")


@dataclass(frozen=True)
class Sample:
    pid: int
    time: float
    command: str


@dataclass(frozen=True)
class Span:
    worker: int
    start: float
    end: float
    nodeid: str


class Birth(NamedTuple):
    """A process that got a pid: when, and from which parent (ordered by time, for bisect)."""

    time: float
    parent: int


@dataclass(frozen=True)
class Trace:
    samples: list[Sample]
    forks: dict[int, list[Birth]]  # pid -> each process that had it, in time order


def read_trace(path: Path) -> Trace:
    """`perf script --show-task-events -F comm,pid,time`: samples and new processes."""
    samples, forks = [], {}
    for line in path.read_text(errors="replace").splitlines():
        if match := FORK.match(line):
            forks.setdefault(int(match["pid"]), []).append(Birth(float(match["time"]), int(match["parent"])))
        elif match := SAMPLE.match(line):
            samples.append(Sample(int(match["pid"]), float(match["time"]), match["command"]))
    return Trace(samples, {pid: sorted(births) for pid, births in forks.items()})


def read_spans(path: Path) -> list[Span]:
    """`bench.suite_clock`'s lines."""
    spans = []
    for line in path.read_text().splitlines():
        pid, start, end, nodeid = line.split("\t", 3)
        spans.append(Span(int(pid), float(start), float(end), nodeid))
    return spans


def parent_at(pid: int, time: float, forks: dict[int, list[Birth]]) -> int:
    """The parent of the process that had `pid` at `time` (0 where none is known)."""
    births = forks.get(pid, [])
    index = bisect.bisect_right(births, Birth(time, float("inf"))) - 1
    return births[index].parent if index >= 0 else 0


def worker_of(pid: int, time: float, workers: set[int], forks: dict[int, list[Birth]]) -> int | None:
    """The worker `pid` is, or descended from at `time`; None for any other process."""
    seen = set()
    while pid and pid not in seen:
        if pid in workers:
            return pid
        seen.add(pid)
        pid = parent_at(pid, time, forks)
    return None


def charge(trace: Trace, spans: list[Span]) -> Counter[str]:
    """Samples per test node id, plus BETWEEN_TESTS and OUTSIDE."""
    by_worker: dict[int, list[Span]] = {}
    for span in sorted(spans, key=lambda s: s.start):
        by_worker.setdefault(span.worker, []).append(span)
    workers = set(by_worker)
    starts = {worker: [span.start for span in runs] for worker, runs in by_worker.items()}
    charged: Counter[str] = Counter()
    for sample in trace.samples:
        worker = worker_of(sample.pid, sample.time, workers, trace.forks)
        if worker is None:
            charged[OUTSIDE] += 1
            continue
        index = bisect.bisect_right(starts[worker], sample.time) - 1
        span = by_worker[worker][index] if index >= 0 else None
        inside = span is not None and sample.time <= span.end + END_GRACE_S
        charged[span.nodeid if inside else BETWEEN_TESTS] += 1
    return charged


def by_file(charged: Counter[str]) -> Counter[str]:
    """Per test file (the node id up to `::`, without xdist's `@group`)."""
    files: Counter[str] = Counter()
    for nodeid, count in charged.items():
        files[nodeid.split("::")[0].split("@")[0]] += count
    return files


# A process's start, for `by_command`: imports, a model's load.
START_S = 5.0


def by_command(trace: Trace) -> tuple[Counter[str], Counter[str]]:
    """Samples per command name (perf's `comm`; `swapper` is an idle CPU), and those of
    them in the first START_S seconds of their process's samples."""
    commands: Counter[str] = Counter()
    starting: Counter[str] = Counter()
    first_seen: dict[int, float] = {}
    for sample in trace.samples:
        commands[sample.command] += 1
        if sample.time - first_seen.setdefault(sample.pid, sample.time) < START_S:
            starting[sample.command] += 1
    return commands, starting


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.suite_profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="perf script --show-task-events -F comm,pid,time output")
    parser.add_argument("clock", type=Path, help="bench.suite_clock's file")
    parser.add_argument("--hz", type=float, default=29.0, help="perf record's -F")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    trace = read_trace(args.trace)
    charged = charge(trace, read_spans(args.clock))
    print(f"{sum(charged.values()) / args.hz:.0f} CPU-s sampled\n")
    commands, starting = by_command(trace)
    print(f"| CPU-s | of it in a process's first {START_S:.0f} s | command |\n| ---: | ---: | --- |")
    for name, count in commands.most_common(args.top):
        print(f"| {count / args.hz:.1f} | {starting[name] / args.hz:.1f} | {name} |")
    print("\n| CPU-s | file |\n| ---: | --- |")
    for name, count in by_file(charged).most_common(args.top):
        print(f"| {count / args.hz:.1f} | {name} |")
    print("\n| CPU-s | test |\n| ---: | --- |")
    for name, count in charged.most_common(args.top):
        print(f"| {count / args.hz:.1f} | {name} |")


if __name__ == "__main__":
    main()
