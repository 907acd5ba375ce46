"""A pytest plugin for `bench.suite_profile`: each test's start and end, by the process
that ran it (an xdist worker), on CLOCK_MONOTONIC, the clock `perf record -k
CLOCK_MONOTONIC` stamps its samples with.

    SUITE_CLOCK_FILE=/tmp/clock.tsv python -m pytest -p bench.suite_clock ...

Lines are appended (workers write their own), tab-separated: pid, start, end, node id.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

CLOCK_FILE_ENV = "SUITE_CLOCK_FILE"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    start = time.clock_gettime(time.CLOCK_MONOTONIC)
    yield
    end = time.clock_gettime(time.CLOCK_MONOTONIC)
    path = os.environ.get(CLOCK_FILE_ENV)
    if path:
        with open(path, "a") as clock:
            clock.write(f"{os.getpid()}\t{start:.3f}\t{end:.3f}\t{item.nodeid}\n")
