"""Batch-size buckets of captured CUDA graphs: a graph is captured for a fixed
number of rows, so a table captures a few sizes and runs a batch in the
smallest that holds it, padded."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

# Padded batch sizes with a captured decode step; a table takes those up to its
# largest batch and the largest batch itself.
DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)


def bucket_sizes(max_batch: int, candidates: Sequence[int] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The padded batch sizes of a table whose largest batch is `max_batch`."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    return tuple(sorted({b for b in candidates if b < max_batch} | {max_batch}))


def choose_bucket(buckets: Sequence[int], n: int) -> int | None:
    """The smallest bucket holding n rows (buckets sorted); None when none does."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if n >= 1 and i < len(buckets) else None
