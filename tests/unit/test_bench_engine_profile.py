"""bench.engine_profile's cut of a kernel timeline: busy time by stream, overlap, idle,
and the decoder's attention split into self- and cross-attention by order."""

from __future__ import annotations

import gzip
import json

import pytest

from bench.engine_profile import intersection_us, kernel_events, timeline, union_us


def kernel(name: str, stream: int, ts: float, dur: float) -> dict:
    return {"name": name, "stream": stream, "ts": ts, "dur": dur}


def ms_kernel(name: str, stream: int, start_ms: float, ms: float) -> dict:
    return kernel(name, stream, start_ms * 1e3, ms * 1e3)


def test_union_counts_overlapping_and_nested_intervals_once() -> None:
    assert union_us([(0, 10), (5, 15), (12, 14), (30, 35)]) == 20
    assert union_us([]) == 0


def test_intersection_is_the_time_both_lists_cover() -> None:
    assert intersection_us([(0, 10), (12, 14), (30, 35)], [(5, 15)]) == 7
    assert intersection_us([(0, 1)], [(2, 3)]) == 0


def test_timeline_cuts_the_wall_by_stream_and_finds_the_idle_time() -> None:
    # Two decoder steps of one layer (self, then cross attention each), an encoder
    # product on the side stream overlapping the first, a gap of 10 ms before the second.
    kernels = [
        ms_kernel("flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", 7, 0, 4),
        ms_kernel("flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", 7, 4, 6),
        ms_kernel("nvjet_sm90_gemm", 20, 5, 10),
        ms_kernel("flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", 7, 25, 2),
        ms_kernel("flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", 7, 27, 8),
        ms_kernel("vectorized_layer_norm_kernel", 7, 35, 5),
    ]
    cut = timeline(kernels, decode_stream=7, n_layers=1)
    wall = 40
    assert cut["percent_of_wall"] == {
        "decoder steps (any kernel on the decoding stream)": pytest.approx(100 * 25 / wall, abs=0.05),
        "admissions (any kernel on the side stream)": pytest.approx(100 * 10 / wall, abs=0.05),
        "both at once": pytest.approx(100 * 5 / wall, abs=0.05),
        "the GPU idle": pytest.approx(100 * 10 / wall, abs=0.05),
    }
    assert cut["decode_steps"] == 2
    assert cut["kernel_ms"]["decode"] == {"cross-attention": 14.0, "self-attention": 6.0, "layer norms": 5.0}
    assert cut["kernel_ms"]["side"] == {"matrix products": 10.0}
    top = cut["top_kernels"]["decode"]
    assert [(k["kernel"][:12], k["launches"], k["ms"], k["us_each"]) for k in top] == [
        ("flashinfer::", 4, 20.0, 5000.0), ("vectorized_l", 1, 5.0, 5000.0)]
    assert cut["wall_ms"] == wall


def test_kernel_events_reads_the_profilers_chrome_trace(tmp_path) -> None:
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "b", "ts": 5.0, "dur": 1.0, "args": {"stream": 7}},
        {"cat": "cpu_op", "name": "aten::add", "ts": 0.0, "dur": 9.0, "args": {}},
        {"cat": "kernel", "name": "a", "ts": 2.0, "dur": 2.0, "args": {"stream": 13}},
    ]}
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump(trace, handle)
    assert kernel_events(path) == [kernel("a", 13, 2.0, 2.0), kernel("b", 7, 5.0, 1.0)]
