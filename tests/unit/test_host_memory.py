"""An idle engine gives the host memory its windows freed back to the system
(`devices.host_memory`, IDLE_RELEASE_S): a server that served a burst of large
requests does not hold the burst's peak once it is idle. `IdleRelease` does the same
for work that arrives on several threads (the preprocessing model's)."""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from reference import clips

from python_backend_lib.core.options import DecodingOptions
from python_backend_lib.devices.host_memory import IdleRelease
from python_backend_lib.engine import scheduler
from python_backend_lib.transcription.pipeline import Pipeline

# The burst's windows free far more than this (each window's features and encoder
# activations, six windows at once, twice); without the release none of it goes back.
MIN_RELEASED_MIB = 32.0


def resident_mib() -> float:
    """This process's resident memory (the second field of /proc/self/statm, in pages)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_an_idle_engine_gives_the_memory_of_its_last_burst_back(monkeypatch):
    # Idle a while longer than served, so that the memory is surely read before the release.
    monkeypatch.setattr(scheduler, "IDLE_RELEASE_S", 3.0)
    pipeline = Pipeline.load("default", device="cpu")
    audio = [clip.read() for clip in clips()[:6]]
    try:
        with ThreadPoolExecutor(len(audio)) as pool:
            for _ in range(2):
                list(pool.map(lambda recording: pipeline.transcribe(recording, DecodingOptions()), audio))
        busy_mib, releases = resident_mib(), pipeline.engine.stats.memory_releases
        deadline = time.monotonic() + 10 * scheduler.IDLE_RELEASE_S
        while pipeline.engine.stats.memory_releases == releases and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pipeline.engine.stats.memory_releases == releases + 1
        assert resident_mib() < busy_mib - MIN_RELEASED_MIB
    finally:
        pipeline.close()


class CountedRelease:
    """A release that counts its calls, and can be held mid-call."""

    def __init__(self) -> None:
        self.calls = 0
        self.proceed = threading.Event()
        self.proceed.set()

    def __call__(self) -> bool:
        self.calls += 1
        self.proceed.wait()
        return True


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


IDLE_S = 0.1


def test_memory_goes_back_once_a_pause_lasts_and_once_per_pause():
    release = CountedRelease()
    idle = IdleRelease(IDLE_S, release)
    try:
        time.sleep(3 * IDLE_S)
        assert release.calls == 0  # nothing was done yet: nothing to give back
        idle.begin()
        time.sleep(3 * IDLE_S)
        assert release.calls == 0  # busy, however long
        idle.end()
        assert wait_until(lambda: release.calls == 1) and idle.releases == 1
        time.sleep(3 * IDLE_S)
        assert release.calls == 1  # once per pause
        for _ in range(2):  # two pieces of work at once: the pause starts when both ended
            idle.begin()
        idle.end()
        time.sleep(3 * IDLE_S)
        assert release.calls == 1
        idle.end()
        assert wait_until(lambda: release.calls == 2)
    finally:
        idle.close()


def test_work_that_begins_within_the_pause_puts_the_release_off():
    release = CountedRelease()
    idle = IdleRelease(IDLE_S, release)
    try:
        idle.begin()
        idle.end()
        idle.begin()  # within the pause: it ends without a release
        time.sleep(3 * IDLE_S)
        assert release.calls == 0
        idle.end()
        assert wait_until(lambda: release.calls == 1)
    finally:
        idle.close()


def test_work_may_begin_while_memory_is_given_back():
    release = CountedRelease()
    release.proceed.clear()
    idle = IdleRelease(IDLE_S, release)
    try:
        idle.begin()
        idle.end()
        assert wait_until(lambda: release.calls == 1)
        begun = threading.Thread(target=idle.begin)
        begun.start()
        begun.join(timeout=5)
        assert not begun.is_alive(), "begin() waited for the release"
        release.proceed.set()
        idle.end()
        assert wait_until(lambda: release.calls == 2)
    finally:
        release.proceed.set()
        idle.close()
