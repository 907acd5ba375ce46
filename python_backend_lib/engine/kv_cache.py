"""A static pool of KV-cache slots, one slot per request being decoded.

Slot 0 is a zeroed scratch slot that padded batch rows point at; slots 1..S hold
requests. Per decoder layer the pool holds self-attention K/V for all 448 text
positions and cross-attention K/V for all 1,500 encoder positions:

    self_k[layer]:  [S + 1, n_text_ctx, heads, head_dim]   positions, then heads (NHD)
    cross_k[layer]: [S + 1, n_audio_ctx, heads, head_dim]  a view of storage held
                    heads first, [S + 1, heads, n_audio_ctx, head_dim] (HND)

Slot-major storage is also a paged layout, which is what FlashInfer's paged kernels
read. The self K/V, written a token at a time, are pages of PAGE_SIZE positions: viewed
as [(S + 1) * 28, PAGE_SIZE, heads, head_dim], slot s owns pages s * 28 + arange(n).
The cross K/V are written once per request, whole, and each decoder step reads all of
them: they are held heads first, each head's 1,500 keys contiguous, which FlashInfer's
decode kernel reads faster than pages of 16 positions with every head, and much faster
for FP8 values, whose 64-byte rows a position-major page interleaves
(`bench.cross_attention`, docs/gpu.md). FlashInfer sees them as pages of
`cross_page_size` (50) positions in its HND layout, through a strided view
(`cross_pages`): page j of head h of slot s starts where position 50 j of that head
does, so a slot is 30 pages, which the kernel can split between thread blocks when a
step has several rows. The same storage can be seen as one page of 1,500 a slot
(`PoolShape.cross_paging`), which one row reads faster from a CUDA graph
(`cuda_graphs.WHOLE_SLOT_CROSS_ROWS`). Nothing is allocated after construction, so
captured CUDA graphs stay valid.

The cross-attention K/V may be kept in FP8 (E4M3, `cross_dtype`): a decoder step
reads every row's 1,500 encoder positions in every layer, the largest part of a big
checkpoint's step, and FP8 halves those bytes. Values are stored as they are,
rounded to E4M3 and saturated at its largest (448): no scale, since the attention
kernels read them as plain numbers. Readers that cannot read FP8 cast back
(`SdpaAttention`, word alignment).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property

import torch

from python_backend_lib.core.model_facts import ModelDims
from python_backend_lib.engine.fp8_linear import FP8, FP8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU torch of a CI machine
    triton = None

SCRATCH_SLOT = 0
PAGE_SIZE = 16  # the self-attention K/V's pages; the cross K/V's are `PoolShape.cross_page_size`
SELF_LAYOUT, CROSS_LAYOUT = "NHD", "HND"  # FlashInfer's names for the two page layouts
CROSS_PAGE_SIZE = 50  # at most; a divisor of the encoder's positions (1,500)


def pages_for(positions: int) -> int:
    return -(-positions // PAGE_SIZE)


@dataclass(frozen=True)
class CrossPaging:
    """How FlashInfer reads the heads-first cross K/V: pages of `page_size` positions of
    every head, `pages_per_slot` to a slot, each slot's first page `stride` page numbers
    after the slot before's (`KVSlotPool.cross_pages`)."""

    page_size: int
    pages_per_slot: int
    stride: int


@dataclass(frozen=True)
class PoolShape:
    n_slots: int  # request slots, the scratch slot not counted
    n_layers: int
    n_heads: int
    head_dim: int
    text_ctx: int
    audio_ctx: int

    @classmethod
    def for_model(cls, dims: ModelDims, n_slots: int) -> "PoolShape":
        return cls(n_slots, dims.n_text_layer, dims.n_text_head, dims.head_dim, dims.n_text_ctx, dims.n_audio_ctx)

    @property
    def self_pages_per_slot(self) -> int:
        return pages_for(self.text_ctx)

    def cross_paging(self, page_size: int | None = None) -> CrossPaging:
        """The cross K/V as pages of `page_size` positions, a divisor of audio_ctx
        (default: `cross_page_size`; audio_ctx: one page a slot)."""
        size = page_size or self.cross_page_size
        if self.audio_ctx % size:
            raise ValueError(f"cross pages of {size} positions do not tile {self.audio_ctx}")
        pages = self.audio_ctx // size
        return CrossPaging(size, pages, self.n_heads * pages)

    # Cached: the decode step's page tables read these; a frozen dataclass still takes them.
    @cached_property
    def cross_pages_per_slot(self) -> int:
        return self.audio_ctx // self.cross_page_size

    @cached_property
    def cross_page_size(self) -> int:
        """The largest divisor of audio_ctx up to CROSS_PAGE_SIZE: a head's pages tile its positions exactly."""
        return next(size for size in range(min(CROSS_PAGE_SIZE, self.audio_ctx), 0, -1) if self.audio_ctx % size == 0)

    @cached_property
    def cross_page_stride(self) -> int:
        """Page numbers from one slot's first cross page to the next's (`KVSlotPool.cross_pages`)."""
        return self.n_heads * self.cross_pages_per_slot

    def bytes_per_slot(self, dtype: torch.dtype, cross_dtype: torch.dtype | None = None) -> int:
        """Bytes of one slot, self-attention K/V in `dtype`, cross-attention K/V in
        `cross_dtype` (default: `dtype`)."""
        self_item = torch.empty((), dtype=dtype).element_size()
        cross_item = torch.empty((), dtype=cross_dtype or dtype).element_size()
        position_bytes = self.self_pages_per_slot * PAGE_SIZE * self_item + self.audio_ctx * cross_item
        return 2 * self.n_layers * self.n_heads * self.head_dim * position_bytes


def slots_for_memory(
    dims: ModelDims, dtype: torch.dtype, budget_bytes: int, max_slots: int, cross_dtype: torch.dtype | None = None
) -> int:
    """How many request slots fit in a memory budget (the scratch slot included)."""
    per_slot = PoolShape.for_model(dims, 1).bytes_per_slot(dtype, cross_dtype)
    return max(1, min(max_slots, budget_bytes // per_slot - 1))


class KVSlotPool:
    def __init__(
        self, shape: PoolShape, *, device: torch.device, dtype: torch.dtype, cross_dtype: torch.dtype | None = None
    ) -> None:
        """cross_dtype: the cross-attention K/V's, `dtype` or FP8 (default: `dtype`)."""
        cross_dtype = cross_dtype or dtype
        if cross_dtype not in (dtype, FP8):
            raise ValueError(f"the cross-attention K/V are kept in the model's dtype or {FP8}, not {cross_dtype}")
        self.shape = shape
        rows = shape.n_slots + 1
        self_kv = (rows, shape.text_ctx, shape.n_heads, shape.head_dim)
        cross_kv = (rows, shape.n_heads, shape.audio_ctx, shape.head_dim)  # heads first (CROSS_LAYOUT)
        self.self_k = [torch.zeros(self_kv, device=device, dtype=dtype) for _ in range(shape.n_layers)]
        self.self_v = [torch.zeros(self_kv, device=device, dtype=dtype) for _ in range(shape.n_layers)]
        self._cross_k = [torch.zeros(cross_kv, device=device, dtype=cross_dtype) for _ in range(shape.n_layers)]
        self._cross_v = [torch.zeros(cross_kv, device=device, dtype=cross_dtype) for _ in range(shape.n_layers)]
        # As every reader indexes them: [S + 1, audio_ctx, heads, head_dim].
        self.cross_k = [t.transpose(1, 2) for t in self._cross_k]
        self.cross_v = [t.transpose(1, 2) for t in self._cross_v]
        self._free = list(range(shape.n_slots, 0, -1))  # pop() hands out slot 1 first
        self._lock = threading.Lock()

    @property
    def n_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        with self._lock:
            if not self._free:
                raise RuntimeError("no free KV slot")
            return self._free.pop()

    def release(self, slot: int) -> None:
        # Both are bugs of ours, never a request's fault: RuntimeError, reported as INTERNAL.
        if slot == SCRATCH_SLOT:
            raise RuntimeError("the scratch slot is never allocated")
        with self._lock:
            if slot in self._free:
                raise RuntimeError(f"slot {slot} is already free")
            self._free.append(slot)

    def reset(self) -> None:
        """Free every slot (after the engine failed everything it held)."""
        with self._lock:
            self._free = list(range(self.shape.n_slots, 0, -1))

    @property
    def cross_dtype(self) -> torch.dtype:
        return self._cross_k[0].dtype

    def write_cross(self, slots: torch.Tensor, layer_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store each layer's cross-attention K/V ([B, audio_ctx, heads, head_dim]) in `slots`
        (in FP8, rounded and saturated: `stored_cross`)."""
        for layer, (k, v) in enumerate(layer_kv):
            for storage, view, values in ((self._cross_k[layer], self.cross_k[layer], k),
                                          (self._cross_v[layer], self.cross_v[layer], v)):
                if triton is not None and storage.is_cuda:
                    _copy_into_slots(values if storage.dtype == FP8 else values.to(storage.dtype), storage, slots)
                else:
                    _bytes(view).index_copy_(0, slots, _bytes(stored_cross(values, storage.dtype)))

    def copy_cross(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Give `targets` the cross-attention K/V of `sources` (slot ids, [k] each): one
        request's audio for each of its beams or samples."""
        for layer in range(self.shape.n_layers):
            for kv in (_bytes(self._cross_k[layer]), _bytes(self._cross_v[layer])):
                kv.index_copy_(0, targets, kv.index_select(0, sources))

    def copy_self(self, sources: torch.Tensor, targets: torch.Tensor, positions: int) -> None:
        """Give `targets` the self-attention K/V of `sources` at the first `positions`
        (slot ids, [k] each; a slot may be both): beams taking other beams' text."""
        for layer in range(self.shape.n_layers):
            for kv in (self.self_k[layer], self.self_v[layer]):
                head = kv[:, :positions]
                head.index_copy_(0, targets, head.index_select(0, sources))

    def self_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's self-attention K and V seen as pages: [(S + 1) * 28, PAGE_SIZE, heads, head_dim]."""
        return _as_pages(self.self_k[layer]), _as_pages(self.self_v[layer])

    def cross_pages(self, layer: int, paging: CrossPaging | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's cross-attention K and V as FlashInfer's HND pages, [pages, heads,
        page_size, head_dim] (`paging`, default `shape.cross_paging()`), viewing the
        heads-first storage in place: slot s's pages are s * stride + arange(pages_per_slot).
        The numbers in between name pages that start inside other heads' keys, which no
        table holds."""
        paging = paging or self.shape.cross_paging()
        return (_as_cross_pages(self._cross_k[layer], self.shape, paging),
                _as_cross_pages(self._cross_v[layer], self.shape, paging))

    def self_positions(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's self-attention K and V with slot and position flattened:
        [(S + 1) * n_text_ctx, heads, head_dim]; slot s, position p is row s * n_text_ctx + p."""
        k, v = self.self_k[layer], self.self_v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])


def stored_cross(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` as the pool keeps them in `dtype`: in FP8, saturated at FP8_MAX, then
    rounded to the nearest E4M3 value (what `_copy_rows` stores on a GPU)."""
    if dtype == FP8:
        values = values.float().clamp(-FP8_MAX, FP8_MAX)
    return values.to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as bytes, which index_select and index_copy_ take everywhere; others as they are."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _as_cross_pages(t: torch.Tensor, shape: PoolShape, paging: CrossPaging) -> torch.Tensor:
    """[slots, heads, audio_ctx, head_dim] -> [pages, heads, page, head_dim], in place:
    a page is `page` positions of every head, the heads audio_ctx positions apart. The
    last page numbered is slot S's last (its head 0's), so the view ends where the
    storage does."""
    page, dim = paging.page_size, shape.head_dim
    pages = (t.shape[0] - 1) * paging.stride + paging.pages_per_slot
    return t.as_strided((pages, shape.n_heads, page, dim), (page * dim, shape.audio_ctx * dim, dim, 1))


def _as_pages(t: torch.Tensor) -> torch.Tensor:
    """[slots, positions, heads, head_dim] (positions a multiple of PAGE_SIZE) -> [pages, PAGE_SIZE, heads, head_dim]"""
    return t.view(-1, PAGE_SIZE, t.shape[-2], t.shape[-1])


def write_positions(
    k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_cache[index[i]] = k[i], and v_cache's the same: each row's new token, its K and V
    [rows, heads, head_dim] written to flattened positions (`KVSlotPool.self_positions`).
    On a GPU in one kernel, where `index_copy_` takes one for K and one for V: a decoder
    step over a few rows is bound by how many kernels it launches. The same bits either way."""
    if triton is None or k.device.type != "cuda" or not _rows_of_heads(k, k_cache) or not _rows_of_heads(v, v_cache):
        k_cache.index_copy_(0, index, k)
        v_cache.index_copy_(0, index, v)
        return
    write_positions_kernel(k_cache, v_cache, index, k, v)


def write_positions_kernel(
    k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """`write_positions` through `_write_positions` on the tensors' device (the CPU in Triton's
    interpreter, for tests), for K and V whose rows are their heads back to back (`_rows_of_heads`)."""
    width = k.shape[1] * k.shape[2]
    _write_positions[(k.shape[0],)](
        k_cache, v_cache, index, k, v, k.stride(0), v.stride(0), width, BLOCK=triton.next_power_of_2(width)
    )


def _rows_of_heads(values: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether each row of `values` is its heads back to back, as a position of `cache` is."""
    dim = values.shape[2]
    return values.dtype == cache.dtype and values.stride(1) == dim and values.stride(2) == 1 and cache.is_contiguous()


# Positions each program of `_copy_rows` copies, of one head.
COPY_POSITIONS = 64


def _copy_into_slots(values: torch.Tensor, storage: torch.Tensor, slots: torch.Tensor) -> None:
    """storage[slots[i]] = values[i] transposed to heads first, converted to FP8 on the way
    when the storage is (`stored_cross`). One kernel reads each clip's positions in
    blocks and writes each head's part where that head's keys lie; `index_copy_` into
    the transposed view would copy an element at a time."""
    values = values.contiguous()  # [clips, audio_ctx, heads, head_dim]
    clips, positions, heads, head_dim = values.shape
    _copy_rows[(clips, heads, triton.cdiv(positions, COPY_POSITIONS))](
        values, storage, slots, positions, heads * head_dim, storage.stride(0), storage.stride(1),
        TO_FP8=storage.dtype == FP8, FP8_MAX=FP8_MAX, HEAD_DIM=head_dim, POSITIONS=COPY_POSITIONS,
    )


if triton is not None:

    @triton.jit
    def _copy_rows(values_ptr, storage_ptr, slots_ptr, positions, position_stride, slot_stride, head_stride,
                   TO_FP8: tl.constexpr, FP8_MAX: tl.constexpr, HEAD_DIM: tl.constexpr, POSITIONS: tl.constexpr):
        # One head's HEAD_DIM values at POSITIONS positions of one clip: read from the
        # position-major values, written to the slot's heads-first storage.
        clip, head = tl.program_id(0), tl.program_id(1)
        position = tl.program_id(2) * POSITIONS + tl.arange(0, POSITIONS)[:, None]
        dim = tl.arange(0, HEAD_DIM)[None, :]
        inside = position < positions
        slot = tl.load(slots_ptr + clip).to(tl.int64)
        read = clip.to(tl.int64) * positions * position_stride + position * position_stride + head * HEAD_DIM + dim
        block = tl.load(values_ptr + read, mask=inside)
        if TO_FP8:
            block = tl.minimum(tl.maximum(block.to(tl.float32), -FP8_MAX), FP8_MAX).to(tl.float8e4nv)
        written = slot * slot_stride + head * head_stride + position * HEAD_DIM + dim
        tl.store(storage_ptr + written, block, mask=inside)

    @triton.jit
    def _write_positions(k_cache_ptr, v_cache_ptr, index_ptr, k_ptr, v_ptr, k_stride, v_stride, width,
                         BLOCK: tl.constexpr):  # fmt: skip
        # One row's K and V, each `width` values, to the position index[row] of each cache.
        row = tl.program_id(0).to(tl.int64)
        column = tl.arange(0, BLOCK)
        inside = column < width
        written = tl.load(index_ptr + row).to(tl.int64) * width + column
        tl.store(k_cache_ptr + written, tl.load(k_ptr + row * k_stride + column, mask=inside), mask=inside)
        tl.store(v_cache_ptr + written, tl.load(v_ptr + row * v_stride + column, mask=inside), mask=inside)
