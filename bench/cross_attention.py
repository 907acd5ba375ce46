"""The decoder's cross-attention kernel alone, at large-v3's shapes: FlashInfer's batch
decode over each row's 1,500 encoder positions, per way of storing them.

    python -m bench.cross_attention --rows 1 8 53 128 --page-sizes 16 50 1500 --out /tmp/cross-attention

A decoder step reads every row's cross-attention K and V in every layer, which makes
this kernel the largest part of a saturated large-v3 step (docs/performance.md). It is
bound by memory, so the figure that matters is the bytes it must read a second against
what a plain copy of as many bytes achieves on the same GPU. Cases:
- the K/V dtype: bfloat16 (exact) or FP8 E4M3 (`EngineSetup.fp8_cross_kv`);
- the layout: NHD (a page's positions, each with every head: the pool's before 651e607),
  HND (a page's heads, each with every position), or "pool": `KVSlotPool`'s own
  heads-first storage seen as HND pages through its strided view, planned with its
  `cross_table` (the page size then the largest divisor of 1,500 up to the one asked);
- the page size: 16, or larger pages (fewer page-table reads, but fewer pages for the
  kernel to split a row between thread blocks when a step has few rows);
- FlashInfer's CUDA-core decode kernel or its tensor-core one (`--tensor-cores`, whose
  module compiles on first use);
- launched directly, or (`--graphs`, the pool's cases again) as the engine launches it:
  planned for CUDA graphs over fixed table buffers and replayed from a captured graph,
  where FlashInfer always splits a row's keys between thread blocks and sizes the grid
  for the most it could need.

Each case is timed by `bench.kernel_timing.microseconds`, on K/V larger than the GPU's
L2. Writes `<out>/cross-attention.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from bench.kernel_timing import microseconds
from loadtest.provenance import provenance

CUDA = torch.device("cuda")
POSITIONS = 1500  # the encoder's, a window's
HEADS, HEAD_DIM = 20, 64  # large-v3's
WORKSPACE_BYTES = 128 * 1024 * 1024
DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class Case:
    rows: int
    kv_dtype: str
    layout: str  # "NHD", "HND" or "pool"
    page_size: int
    tensor_cores: bool
    graph: bool = False


@dataclass(frozen=True)
class Result:
    case: Case
    us: float
    read_gb_per_s: float  # the K/V bytes the kernel must read, a second
    copy_gb_per_s: float  # a copy of as many bytes (read and written), a second


def say(message: str) -> None:
    print(f"[bench.cross_attention {time.strftime('%H:%M:%S')}] {message}", flush=True)


def pool_cache(case: Case):
    """The pool's K/V pages and each row's table, slots 1..rows (`KVSlotPool.cross_pages`, `cross_table`)."""
    from python_backend_lib.engine import kv_cache
    from python_backend_lib.engine.flashinfer_attention import cross_table

    kv_cache.CROSS_PAGE_SIZE = case.page_size  # read whenever the pool's shape is asked: set for the whole case
    shape = kv_cache.PoolShape(n_slots=case.rows, n_layers=1, n_heads=HEADS, head_dim=HEAD_DIM, text_ctx=16,
                               audio_ctx=POSITIONS)
    dtype = DTYPES[case.kv_dtype]
    pool = kv_cache.KVSlotPool(shape, device=CUDA, dtype=torch.bfloat16, cross_dtype=dtype)
    values = [torch.randn(case.rows, POSITIONS, HEADS, HEAD_DIM, device=CUDA, dtype=torch.bfloat16) for _ in range(2)]
    pool.write_cross(torch.arange(1, case.rows + 1, device=CUDA), [tuple(values)])
    return pool.cross_pages(0), cross_table(range(1, case.rows + 1), shape)


def cache(case: Case) -> tuple[torch.Tensor, torch.Tensor, int]:
    """K and V pages of `case.rows` slots (random values in the case's dtype) and the pages per slot."""
    pages = -(-POSITIONS // case.page_size)
    shape = ((case.rows * pages, case.page_size, HEADS, HEAD_DIM) if case.layout == "NHD"
             else (case.rows * pages, HEADS, case.page_size, HEAD_DIM))
    k, v = (torch.randn(shape, device=CUDA, dtype=torch.bfloat16).to(DTYPES[case.kv_dtype]) for _ in range(2))
    return k, v, pages


def measure(case: Case) -> Result:
    import flashinfer

    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=CUDA)
    int32 = dict(dtype=torch.int32, device=CUDA)
    if case.layout == "pool":
        (k, v), table = pool_cache(case)
        layout, page_size = "HND", table.page_size
        tables = (torch.from_numpy(table.indptr).to(CUDA), torch.from_numpy(table.indices).to(CUDA),
                  torch.from_numpy(table.last_page_len).to(CUDA))
    else:
        k, v, pages = cache(case)
        layout, page_size = case.layout, case.page_size
        tables = (torch.arange(case.rows + 1, **int32) * pages, torch.arange(case.rows * pages, **int32),
                  torch.full((case.rows,), POSITIONS - (pages - 1) * case.page_size, **int32))
    fixed = {}
    if case.graph:  # the tables' buffers at fixed addresses, as a captured graph reads them
        fixed = dict(use_cuda_graph=True, paged_kv_indptr_buffer=tables[0].clone(),
                     paged_kv_indices_buffer=tables[1].clone(), paged_kv_last_page_len_buffer=tables[2].clone())
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, layout, use_tensor_cores=case.tensor_cores,
                                                            **fixed)
    wrapper.plan(*tables, HEADS, HEADS, HEAD_DIM, page_size,
                 q_data_type=torch.bfloat16, kv_data_type=DTYPES[case.kv_dtype])
    q = torch.randn(case.rows, HEADS, HEAD_DIM, device=CUDA, dtype=torch.bfloat16)
    if case.graph:
        wrapper.run(q, (k, v))  # lazy set-up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            wrapper.run(q, (k, v))
        us = microseconds(graph.replay)
    else:
        us = microseconds(lambda: wrapper.run(q, (k, v)))
    read = 2 * case.rows * POSITIONS * HEADS * HEAD_DIM * k.element_size()
    source = torch.empty(read, dtype=torch.uint8, device=CUDA)
    target = torch.empty_like(source)
    copy_us = microseconds(lambda: target.copy_(source))
    result = Result(case if page_size == case.page_size else replace(case, page_size=page_size),
                    round(us, 2), round(read / us / 1e3, 1), round(2 * read / copy_us / 1e3, 1))
    say(f"{case} {result.us:8.2f} us, reads {result.read_gb_per_s:7.1f} GB/s (a copy: {result.copy_gb_per_s:7.1f})")
    return result


def cases(rows: list[int], page_sizes: list[int], layouts: list[str], tensor_cores: bool,
          graphs: bool = False) -> list[Case]:
    found = [Case(r, dtype, layout, page, False)
             for r in rows for dtype in DTYPES for layout in layouts for page in page_sizes]
    if graphs:
        found += [Case(r, dtype, "pool", page, False, graph=True) for r in rows for dtype in DTYPES for page in page_sizes]
    if tensor_cores:  # last: their module compiles on first use
        found += [Case(r, dtype, "NHD", page_sizes[0], True) for r in rows for dtype in DTYPES]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 53, 128])
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16, 50, 1500])
    parser.add_argument("--layouts", nargs="+", default=["NHD", "HND", "pool"], choices=["NHD", "HND", "pool"])
    parser.add_argument("--tensor-cores", action="store_true")
    parser.add_argument("--graphs", action="store_true", help="the pool's cases again, replayed from CUDA graphs")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    args.out.mkdir(parents=True, exist_ok=True)
    results, failed = [], []
    for case in cases(args.rows, args.page_sizes, args.layouts, args.tensor_cores, args.graphs):
        try:
            results.append(measure(case))
        except Exception as error:  # a kernel FlashInfer does not build for this case: recorded, not fatal
            failed.append({"case": asdict(case), "error": f"{type(error).__name__}: {error}"[:500]})
            say(f"{case} failed: {failed[-1]['error']}")
        torch.cuda.empty_cache()
    data = {"provenance": provenance(), "device": torch.cuda.get_device_name(), "positions": POSITIONS,
            "heads": HEADS, "head_dim": HEAD_DIM, "results": [asdict(r) for r in results], "failed": failed}
    (args.out / "cross-attention.json").write_text(json.dumps(data, indent=1) + "\n")
    say(f"wrote {args.out / 'cross-attention.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
