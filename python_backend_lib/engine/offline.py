"""A decode batch driven to completion without the engine's thread: for tests and benchmarks
that decode a list of windows and want every result."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from python_backend_lib.core.options import DecodingOptions, DecodingResult
from python_backend_lib.engine import beams
from python_backend_lib.engine.batch import DecodeBatch
from python_backend_lib.engine.prompt import Prompt
from python_backend_lib.engine.rows import Admission


def decode(
    batch: DecodeBatch, requests: Sequence[tuple[torch.Tensor, DecodingOptions, Prompt]]
) -> list[DecodingResult]:
    """Decode (features, options, prompt) requests to completion, admitting as
    many at a time as the batch has free slots."""
    queue = [Admission(i, *request) for i, request in enumerate(requests)]
    results: dict[int, DecodingResult] = {}
    while queue or batch.rows:
        # Into an empty batch one at least: a request with more rows than slots raises there.
        n = beams.admissible([a.options for a in queue], batch.free_slots) if batch.accepting else 0
        n = n or (0 if batch.rows else 1)
        batch.admit(queue[:n])
        queue = queue[n:]
        results.update(batch.step())
    results.update(batch.drain())
    return [results[i] for i in range(len(requests))]
