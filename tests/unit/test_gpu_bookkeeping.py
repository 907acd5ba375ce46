"""The GPU engine's host-side bookkeeping, which needs no GPU: FlashInfer page
tables over the slot pool, per-token rows of a prompt step, batch buckets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from python_backend_lib.checkpoints.configs import load_config
from python_backend_lib.devices.buckets import bucket_sizes, choose_bucket
from python_backend_lib.engine.cuda_graphs import cross_paging_for
from python_backend_lib.engine.flashinfer_attention import cross_table, page_table, token_rows
from python_backend_lib.engine.kv_cache import PAGE_SIZE, CrossPaging, KVSlotPool, PoolShape, pages_for


def _pages_by_hand(slot: int, length: int, pages_per_slot: int) -> list[int]:
    return [slot * pages_per_slot + j for j in range((length + PAGE_SIZE - 1) // PAGE_SIZE)]


@pytest.mark.parametrize(
    "slots, lengths",
    [([3], [1]), ([1, 4, 2], [16, 17, 448]), ([0, 0, 5], [1, 1, 33]), ([2, 7], [1500, 1500])],
)
def test_page_table_lists_each_rows_pages(slots, lengths) -> None:
    pages_per_slot = pages_for(max(lengths))
    table = page_table(slots, lengths, pages_per_slot)
    expected = [p for s, n in zip(slots, lengths) for p in _pages_by_hand(s, n, pages_per_slot)]
    assert table.indices.tolist() == expected
    assert table.indptr.tolist() == [0, *np.cumsum([pages_for(n) for n in lengths]).tolist()]
    assert table.last_page_len.tolist() == [n - (pages_for(n) - 1) * PAGE_SIZE for n in lengths]
    assert all(a.dtype == np.int32 for a in (table.indptr, table.indices, table.last_page_len))


def test_page_table_cross_geometry() -> None:
    """1,500 encoder positions: 30 pages of 50 a row, every page full."""
    shape = PoolShape.for_model(load_config("random:tiny").dims, 4)
    table = cross_table([2, 4, 2], shape)
    assert shape.cross_pages_per_slot == 30 and shape.cross_page_size == 50 and shape.self_pages_per_slot == 28
    assert table.pages.tolist() == [30] * 3 and table.last_page_len.tolist() == [50] * 3
    stride = shape.n_heads * 30
    assert table.indices[:30].tolist() == list(range(2 * stride, 2 * stride + 30)) and table.page_size == 50


@pytest.mark.parametrize("whole_slot", [False, True], ids=["pages of 50", "one page a slot"])
@pytest.mark.parametrize("audio_ctx", [1500, 20])
def test_the_cross_pages_a_row_reads_are_its_slots_positions(audio_ctx, whole_slot) -> None:
    """What FlashInfer reads through `cross_table` and `KVSlotPool.cross_pages` (HND
    pages over the heads-first storage, in place) is each row's slot's K, position by
    position, as every other reader indexes it: in the pool's pages, and in one page a
    slot (`cuda_graphs.WHOLE_SLOT_CROSS_ROWS`)."""
    shape = PoolShape(n_slots=4, n_layers=1, n_heads=3, head_dim=4, text_ctx=8, audio_ctx=audio_ctx)
    pool = KVSlotPool(shape, device=torch.device("cpu"), dtype=torch.float32)
    values = torch.randn(4, audio_ctx, 3, 4)
    pool.write_cross(torch.tensor([1, 2, 3, 4]), [(values, -values)])
    paging = shape.cross_paging(audio_ctx) if whole_slot else None
    k_pages, v_pages = pool.cross_pages(0, paging)
    slots = [2, 4, 1, 2]
    table = cross_table(slots, shape, paging)
    assert table.pages.tolist() == [1 if whole_slot else shape.cross_pages_per_slot] * 4
    for row, slot in enumerate(slots):
        pages = table.indices[table.indptr[row]: table.indptr[row + 1]].tolist()
        for paged, view, wanted in ((k_pages, pool.cross_k[0], values), (v_pages, pool.cross_v[0], -values)):
            read = paged[pages].permute(0, 2, 1, 3).reshape(-1, 3, 4)  # [positions, heads, head_dim]
            assert torch.equal(read, wanted[slot - 1]) and torch.equal(read, view[slot])


def test_buckets_up_to_the_threshold_read_whole_slot_cross_pages_and_larger_ones_pages_of_50(monkeypatch) -> None:
    from python_backend_lib.engine import cuda_graphs

    shape = PoolShape.for_model(load_config("random:large-v3").dims, 8)
    assert cuda_graphs.WHOLE_SLOT_CROSS_ROWS == 0 and cross_paging_for(1, shape) == shape.cross_paging()  # shipped
    monkeypatch.setattr(cuda_graphs, "WHOLE_SLOT_CROSS_ROWS", 1)
    assert cross_paging_for(1, shape) == CrossPaging(page_size=1500, pages_per_slot=1, stride=shape.n_heads)
    assert cross_paging_for(2, shape) == shape.cross_paging() == CrossPaging(50, 30, 30 * shape.n_heads)
    with pytest.raises(ValueError, match="do not tile 1500"):
        shape.cross_paging(64)


@pytest.mark.parametrize("slots, lengths", [([1], [0]), ([1], [449])])
def test_page_table_rejects_empty_and_overlong_rows(slots, lengths) -> None:
    with pytest.raises(ValueError):
        page_table(slots, lengths, 28)


def test_token_rows_make_prompt_steps_causal() -> None:
    # Row 0: a 4-token prompt in slot 5; row 1: one token at position 9 of slot 2.
    rows = token_rows([5, 2], [4, 1], [0, 9], text_ctx=448)
    assert rows.slots.tolist() == [5, 5, 5, 5, 2]
    assert rows.positions.tolist() == [0, 1, 2, 3, 9]
    assert rows.key_lens.tolist() == [1, 2, 3, 4, 10]  # each token sees itself and what precedes it
    assert rows.cache_index.tolist() == [5 * 448 + p for p in range(4)] + [2 * 448 + 9]


def test_token_rows_reject_overflow() -> None:
    with pytest.raises(ValueError):
        token_rows([1], [2], [447], text_ctx=448)


def test_buckets() -> None:
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(20) == (1, 2, 4, 8, 12, 16, 20)
    assert bucket_sizes(64)[-3:] == (32, 48, 64)
    buckets = bucket_sizes(100)
    assert [choose_bucket(buckets, n) for n in (1, 3, 9, 64, 65, 100)] == [1, 4, 12, 64, 96, 100]
    assert choose_bucket(buckets, 101) is None and choose_bucket(buckets, 0) is None
    with pytest.raises(ValueError):
        bucket_sizes(0)
