"""One kernel (or a few launches) timed on the GPU alone: `microseconds`."""

from __future__ import annotations

from collections.abc import Callable

import torch

WARMUP, REPEATS = 5, 50


def microseconds(run: Callable[[], object], warmup: int = WARMUP, repeats: int = REPEATS) -> float:
    """Device microseconds a call of `run`: `warmup` calls, then `repeats` between two CUDA
    events, as the GPU ran them (the host's launches overlap them)."""
    for _ in range(warmup):
        run()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        run()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3 / repeats
