"""An idle engine gives the host memory its windows freed back to the system
(`devices.host_memory`, `engine.scheduler.IDLE_RELEASE_S`): a server that served a
burst of large requests does not hold the burst's peak once it is idle."""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from reference import clips

from python_backend_lib.core.options import DecodingOptions
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
