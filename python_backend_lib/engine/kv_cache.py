"""A static pool of KV-cache slots, one slot per request being decoded.

Slot 0 is a zeroed scratch slot that padded batch rows point at; slots 1..S hold
requests. Per decoder layer the pool holds self-attention K/V for all 448 text
positions and cross-attention K/V for all 1,500 encoder positions:

    self_k[layer]:  [S + 1, n_text_ctx, heads, head_dim]
    cross_k[layer]: [S + 1, n_audio_ctx, heads, head_dim]

Slot-major storage is also a paged layout: viewed as [(S + 1) * pages_per_slot,
PAGE_SIZE, heads, head_dim], slot s owns pages s * pages_per_slot + arange(n),
which is what FlashInfer's paged kernels read. The 1,500 encoder positions are
not a whole number of pages, so each slot's cross storage is padded to 94 pages
(1,504 positions); `cross_k` is a view of the first 1,500, and the paged
kernels are told that the last page holds 12. Nothing is allocated after
construction, so captured CUDA graphs stay valid.

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

import torch

from python_backend_lib.core.model_facts import ModelDims
from python_backend_lib.engine.fp8_linear import FP8, FP8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU torch of a CI machine
    triton = None

SCRATCH_SLOT = 0
PAGE_SIZE = 16


def pages_for(positions: int) -> int:
    return -(-positions // PAGE_SIZE)


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

    @property
    def cross_pages_per_slot(self) -> int:
        return pages_for(self.audio_ctx)

    def bytes_per_slot(self, dtype: torch.dtype, cross_dtype: torch.dtype | None = None) -> int:
        """Bytes of one slot, self-attention K/V in `dtype`, cross-attention K/V in
        `cross_dtype` (default: `dtype`)."""
        self_item = torch.empty((), dtype=dtype).element_size()
        cross_item = torch.empty((), dtype=cross_dtype or dtype).element_size()
        position_bytes = (self.self_pages_per_slot * self_item + self.cross_pages_per_slot * cross_item) * PAGE_SIZE
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
        # Whole pages per slot; the encoder positions are the first audio_ctx of them.
        cross_kv = (rows, shape.cross_pages_per_slot * PAGE_SIZE, shape.n_heads, shape.head_dim)
        self.self_k = [torch.zeros(self_kv, device=device, dtype=dtype) for _ in range(shape.n_layers)]
        self.self_v = [torch.zeros(self_kv, device=device, dtype=dtype) for _ in range(shape.n_layers)]
        self._cross_k = [torch.zeros(cross_kv, device=device, dtype=cross_dtype) for _ in range(shape.n_layers)]
        self._cross_v = [torch.zeros(cross_kv, device=device, dtype=cross_dtype) for _ in range(shape.n_layers)]
        self.cross_k = [t[:, : shape.audio_ctx] for t in self._cross_k]  # [S + 1, audio_ctx, heads, head_dim]
        self.cross_v = [t[:, : shape.audio_ctx] for t in self._cross_v]
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

    def cross_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's cross-attention K and V seen as pages: [(S + 1) * 94, PAGE_SIZE, heads, head_dim]."""
        return _as_pages(self._cross_k[layer]), _as_pages(self._cross_v[layer])

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


def _as_pages(t: torch.Tensor) -> torch.Tensor:
    """[slots, positions, heads, head_dim] (positions a multiple of PAGE_SIZE) -> [pages, PAGE_SIZE, heads, head_dim]"""
    return t.view(-1, PAGE_SIZE, t.shape[-2], t.shape[-1])


# Elements each program of `_copy_rows` copies.
COPY_BLOCK = 4096


def _copy_into_slots(values: torch.Tensor, storage: torch.Tensor, slots: torch.Tensor) -> None:
    """storage[slots[i], :audio_ctx] = values[i], converted to FP8 on the way when the
    storage is (`stored_cross`). `index_copy_` into the padded view copies two bytes at
    a time (the view is not contiguous across slots); each slot's first audio_ctx
    positions are contiguous, so a kernel copies whole vectors."""
    values = values.contiguous()
    clips, per_clip = values.shape[0], values[0].numel()
    _copy_rows[(clips, triton.cdiv(per_clip, COPY_BLOCK))](
        values, storage, slots, per_clip, storage.stride(0), TO_FP8=storage.dtype == FP8, FP8_MAX=FP8_MAX,
        BLOCK=COPY_BLOCK,
    )


if triton is not None:

    @triton.jit
    def _copy_rows(values_ptr, storage_ptr, slots_ptr, per_clip, slot_stride, TO_FP8: tl.constexpr,
                   FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
        clip = tl.program_id(0)
        offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < per_clip
        slot = tl.load(slots_ptr + clip).to(tl.int64)
        row = tl.load(values_ptr + clip.to(tl.int64) * per_clip + offsets, mask=inside)
        if TO_FP8:
            row = tl.minimum(tl.maximum(row.to(tl.float32), -FP8_MAX), FP8_MAX).to(tl.float8e4nv)
        tl.store(storage_ptr + slot * slot_stride + offsets, row, mask=inside)
