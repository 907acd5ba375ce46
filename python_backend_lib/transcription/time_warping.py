"""From the alignment heads' attention to each text token's start: the median filter
that smooths the attention over time, and the dynamic time warping that finds the
cheapest monotonic path from tokens to audio frames. Both equal openai-whisper's
(`whisper.timing.median_filter`, `dtw_cpu`; tests/unit/test_alignment.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Median over the last axis in a sliding window of `width` (odd), edges reflected."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    rows = x.reshape(-1, 1, x.shape[-1])  # reflect padding wants [batch, channels, length]
    padded = F.pad(rows, (pad, pad), mode="reflect")[:, 0]
    if x.device.type != "cpu":  # a few launches
        return padded.unfold(-1, width, 1).median(dim=-1).values.reshape(x.shape)
    # On the host, sorting the window's shifted copies with a network of minima and maxima
    # (odd-even transposition) gives the same medians several times faster.
    shifted = [padded[:, k : k + x.shape[-1]] for k in range(width)]
    for sweep in range(width):
        for k in range(sweep % 2, width - 1, 2):
            low, high = shifted[k], shifted[k + 1]
            shifted[k], shifted[k + 1] = torch.minimum(low, high), torch.maximum(low, high)
    return shifted[pad].reshape(x.shape)


def dynamic_time_warping(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path through `cost` [rows, cols] from the top-left
    to the bottom-right corner, stepping down, right or diagonally. Returns the
    row and column index of each step."""
    return dynamic_time_warping_many([cost])[0]


def dynamic_time_warping_many(costs: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """`dynamic_time_warping` of each matrix: those of like shape solved together, a row
    at a time, so that the host's per-row work is paid once for them (`_solved`)."""
    paths: list[tuple[np.ndarray, np.ndarray]] = [(np.empty(0), np.empty(0))] * len(costs)
    for group in _like_shapes([c.shape for c in costs]):
        for m, path in zip(group, _solved([costs[m] for m in group])):
            paths[m] = path
    return paths


def _like_shapes(shapes: Sequence[tuple[int, ...]]) -> list[list[int]]:
    """The matrices' indices in groups, by width, each padded to its largest at most
    doubling its cells: padding costs as much as the cells themselves."""
    groups: list[list[int]] = []
    own = 0
    for m in sorted(range(len(shapes)), key=lambda m: (shapes[m][1], shapes[m][0])):
        if groups:
            members = [*groups[-1], m]
            padded = len(members) * max(shapes[k][0] for k in members) * shapes[m][1]
            if padded <= 2 * (own + shapes[m][0] * shapes[m][1]):
                groups[-1].append(m)
                own += shapes[m][0] * shapes[m][1]
                continue
        groups.append([m])
        own = shapes[m][0] * shapes[m][1]
    return groups


def _solved(costs: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The matrices' paths, solved together.

    Each row is solved at once: going right accumulates cost, so the best way
    into cell j is min over k <= j of (best from above at k) + cost[k+1..j],
    a running minimum over a cumulative sum. The matrices are padded with zeros
    to the largest, below and to the right: a cell's best depends only on the
    cells above it and to its left, and running sums and minima run left to
    right, so each matrix's own cells come out as they would alone, bit for bit.
    """
    rows, cols = max(c.shape[0] for c in costs), max(c.shape[1] for c in costs)
    cost = np.zeros((len(costs), rows, cols))
    for m, c in enumerate(costs):
        cost[m, : c.shape[0], : c.shape[1]] = c
    total = np.full((len(costs), rows + 1, cols + 1), np.inf)
    total[:, 0, 0] = 0.0
    came_from = np.zeros((len(costs), rows + 1, cols + 1), dtype=np.int8)  # 0 diagonal, 1 down, 2 right
    for i in range(1, rows + 1):
        diagonal, down = total[:, i - 1, :-1], total[:, i - 1, 1:]
        from_above = np.minimum(diagonal, down) + cost[:, i - 1]
        running = np.cumsum(cost[:, i - 1], axis=1)
        entry = from_above - running
        best = np.minimum.accumulate(entry, axis=1)
        total[:, i, 1:] = best + running
        moved_right = np.pad(best[:, 1:] < entry[:, 1:], ((0, 0), (1, 0)))
        came_from[:, i, 1:] = np.where(moved_right, 2, np.where(diagonal <= down, 0, 1))
    # Walking back, a run of steps right along a row ends at the nearest cell to the left
    # that was not entered from the left: found for every cell at once, the walk takes
    # one step a row rather than one a cell.
    entered = np.where(came_from != 2, np.arange(cols + 1), 0)
    run_start = np.maximum.accumulate(entered, axis=2)
    return [_walk_back(came_from[m], run_start[m], *c.shape) for m, c in enumerate(costs)]


def _walk_back(came_from: np.ndarray, run_start: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """The path's row and column indices, from the corner (rows, cols) back to the start."""
    runs = []  # (row, first column, last column) of the path in each row, walking back
    i, j = rows, cols
    while i > 0 and j > 0:
        k = run_start[i, j]
        runs.append((i - 1, k - 1, j - 1))
        i, j = i - 1, (k - 1 if came_from[i, k] == 0 else k)
    runs.reverse()
    path_rows = np.concatenate([np.full(last - first + 1, row) for row, first, last in runs])
    path_cols = np.concatenate([np.arange(first, last + 1) for _, first, last in runs])
    return path_rows, path_cols
