"""FlashInfer attention over the KV slot pool: the GPU backend.

Decoder self- and cross-attention read the pool's slot-major tensors as pages
(`KVSlotPool.self_pages`, `cross_pages`): slot s owns self pages
s * 28 + arange(n) of 16 positions (layout NHD), and 30 cross pages of 50 encoder
positions, heads first (layout HND, `KVSlotPool.cross_pages`). FlashInfer is told the rows' page
tables on the host (`plan`) and reads them from device buffers when it runs.

One query per row goes through the CUDA-core batch decode kernel
(`BatchDecodeWithPagedKVCacheWrapper`), Whisper having one query head per KV
head. A step with prompt tokens (several new tokens in a row) runs, by default,
through the same kernel with one query per *token*: the token at position p is
a row of its own whose self-attention keys are positions 0..p of its slot,
which is causal attention, and whose cross-attention keys are its slot's 1,500
encoder positions. Prompts are a few tokens long, so this costs little, and it
needs only the decode module (JIT about 12 s per dtype, against about 80 s for
the fa3 prefill module). `PromptKernel.PREFILL` runs them through FlashInfer's
batch prefill kernels instead (causal self, non-causal cross).

The encoder's own attention goes through PyTorch SDPA (the default) or
FlashInfer's ragged prefill kernel, fa3 on Hopper (`core.encoder_kernel`,
`RaggedEncoderAttention`), eagerly here and in the captured encoder passes
(`encoder_graphs`). fa3 is the faster kernel there (docs/gpu.md), but its module
compiles on first use, which a new replica waits for at start.

flashinfer-python==0.6.4 is imported only when a backend is built, so this
module imports on machines without it. The pure bookkeeping (`page_table`,
`token_rows`) is unit-tested on the CPU.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from python_backend_lib.core.encoder_kernel import EncoderKernel
from python_backend_lib.engine.attention import StepLayout, sdpa_encoder_attention
from python_backend_lib.engine.kv_cache import (
    CROSS_LAYOUT,
    PAGE_SIZE,
    SELF_LAYOUT,
    CrossPaging,
    KVSlotPool,
    PoolShape,
    write_positions,
)

# One float workspace serves every wrapper (they run one after another on one
# stream); FlashInfer recommends 128 MiB and needs it zeroed before first use.
WORKSPACE_BYTES = 128 * 1024 * 1024
# Each decode wrapper also has an int workspace (and a pinned host copy of it)
# for its schedule: a few KiB at our batch sizes, 8 MiB by default.
DECODE_INT_WORKSPACE_BYTES = 1024 * 1024


class PromptKernel(str, enum.Enum):
    DECODE = "decode"  # one query per token through the decode kernel (see the module docstring)
    PREFILL = "prefill"  # BatchPrefillWithPagedKVCacheWrapper: causal self, non-causal cross


def import_flashinfer():
    try:
        import flashinfer
    except ImportError as error:
        raise ImportError(
            "the FlashInfer attention backend needs flashinfer-python==0.6.4 (pip install flashinfer-python==0.6.4)"
        ) from error
    return flashinfer


# ------------------------------------------------------------------ bookkeeping


@dataclass(frozen=True)
class PageTable:
    """FlashInfer's description of which pages each row reads (int32, host).

    indptr [rows + 1]: row i reads indices[indptr[i]:indptr[i + 1]].
    indices [pages]: page numbers in the pool's paged view.
    last_page_len [rows]: positions used in each row's last page (1..page_size).
    """

    indptr: np.ndarray
    indices: np.ndarray
    last_page_len: np.ndarray
    page_size: int

    @property
    def pages(self) -> np.ndarray:
        """[rows] pages per row."""
        return np.diff(self.indptr)


def page_table(
    slots: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray, pages_per_slot: int
) -> PageTable:
    """Pages of the first `lengths[i]` positions of slot `slots[i]`, for every row.

    Every row needs at least one position: FlashInfer skips a row of length 0,
    and a graph captured with one would skip it forever.
    """
    slots = np.asarray(slots, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if slots.shape != lengths.shape or slots.ndim != 1:
        raise ValueError(f"slots and lengths must be two equal 1-D sequences, got {slots.shape} and {lengths.shape}")
    if (lengths < 1).any():
        raise ValueError("every row must read at least one position")
    pages = -(-lengths // PAGE_SIZE)  # [rows]
    if (pages > pages_per_slot).any():
        raise ValueError(f"a row reads more than the {pages_per_slot} pages of its slot")
    indptr = np.zeros(len(slots) + 1, dtype=np.int64)
    np.cumsum(pages, out=indptr[1:])
    # Page j of row i is slots[i] * pages_per_slot + j, and it sits at indptr[i] + j.
    indices = np.repeat(slots * pages_per_slot - indptr[:-1], pages) + np.arange(indptr[-1])
    last_page_len = lengths - (pages - 1) * PAGE_SIZE
    return PageTable(indptr.astype(np.int32), indices.astype(np.int32), last_page_len.astype(np.int32), PAGE_SIZE)


def cross_table(slots: Sequence[int] | np.ndarray, shape: PoolShape, paging: CrossPaging | None = None) -> PageTable:
    """Every row reads all of its slot's encoder positions: its slot's cross pages,
    s * stride + arange(pages_per_slot) (`KVSlotPool.cross_pages`, the same `paging`,
    default `shape.cross_paging()`)."""
    slots = np.asarray(slots, dtype=np.int64)
    paging = paging or shape.cross_paging()
    pages = paging.pages_per_slot
    indices = slots[:, None] * paging.stride + np.arange(pages)[None, :]
    return PageTable(
        (np.arange(len(slots) + 1) * pages).astype(np.int32), indices.reshape(-1).astype(np.int32),
        np.full(len(slots), paging.page_size, dtype=np.int32), paging.page_size,
    )


@dataclass(frozen=True)
class TokenRows:
    """A step's new tokens, one row each (rows of the layout flattened).

    slots [tokens]: the KV slot of each token's request.
    positions [tokens]: each token's text position.
    cache_index [tokens]: where its K/V goes in the pool's flattened self cache
        (slot * n_text_ctx + position, see `KVSlotPool.self_positions`).
    """

    slots: np.ndarray
    positions: np.ndarray
    cache_index: np.ndarray

    @property
    def key_lens(self) -> np.ndarray:
        """[tokens] self-attention keys each token sees: itself and all before it."""
        return self.positions + 1


def token_rows(slots: Sequence[int], query_lens: Sequence[int], cached_lens: Sequence[int], text_ctx: int) -> TokenRows:
    slots_a = np.asarray(slots, dtype=np.int64)
    query = np.asarray(query_lens, dtype=np.int64)
    cached = np.asarray(cached_lens, dtype=np.int64)
    if ((cached + query) > text_ctx).any():
        raise ValueError(f"a row would exceed the {text_ctx} text positions")
    starts = np.cumsum(query) - query  # [B] first token of each row
    offsets = np.arange(int(query.sum())) - np.repeat(starts, query)  # [tokens] index within the row
    token_slots = np.repeat(slots_a, query)
    positions = np.repeat(cached, query) + offsets
    return TokenRows(token_slots, positions, token_slots * text_ctx + positions)


def _int32(array: np.ndarray, pinned: bool = False) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32))
    return tensor.pin_memory() if pinned else tensor


# ------------------------------------------------------------- decode kernels


class _PagedLayers:
    """What both kernels' steps share: each layer's pages of the pool, and the
    attention calls of a step once its wrappers are planned (`self_wrapper`,
    `cross_wrapper`, `cache_index`: where each row's new key and value go)."""

    self_wrapper: object
    cross_wrapper: object

    def __init__(self, pool: KVSlotPool, cross_paging: CrossPaging | None = None) -> None:
        n_layers = pool.shape.n_layers
        self.pool = pool
        self.cross_paging = cross_paging or pool.shape.cross_paging()
        self.dtype = pool.self_k[0].dtype
        self.cross_dtype = pool.cross_dtype  # FP8 when the pool keeps cross K/V so
        self.device = pool.self_k[0].device
        self._self_pages = [pool.self_pages(layer) for layer in range(n_layers)]
        self._cross_pages = [pool.cross_pages(layer, self.cross_paging) for layer in range(n_layers)]
        self._self_positions = [pool.self_positions(layer) for layer in range(n_layers)]
        self.cache_index: torch.Tensor | None = None  # [rows] long, set per step (or fixed)

    def self_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        write_positions(*self._self_positions[layer], self.cache_index, k, v)
        return self.self_wrapper.run(q, self._self_pages[layer])

    def cross_attention(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return self.cross_wrapper.run(q, self._cross_pages[layer])


class PagedDecode(_PagedLayers):
    """Self- and cross-attention of one query per row through FlashInfer's
    CUDA-core batch decode kernel, for every decoder layer of a step.

    With `graph_batch` set, the wrappers run over fixed device buffers for
    exactly that many rows, so their `run` can be captured in a CUDA graph and
    `plan` (host work) re-run between replays; `cache_index` is then a fixed
    buffer too, rewritten before each replay. `cross_paging`: how the cross K/V are
    paged for the kernel (default: the pool's pages of 50); its tables must be made
    with the same (`cross_table`).
    """

    def __init__(
        self,
        pool: KVSlotPool,
        workspace: torch.Tensor,
        *,
        graph_batch: int | None = None,
        cross_paging: CrossPaging | None = None,
    ) -> None:
        super().__init__(pool, cross_paging)
        flashinfer = import_flashinfer()
        shape = pool.shape
        self.graph_batch = graph_batch

        # (indptr [rows + 1], indices [rows * pages_per_slot], last_page_len [rows]) of
        # the self and cross tables: FlashInfer's own buffers in eager mode, ours
        # (fixed addresses a graph reads) in graph mode.
        self.self_buffers: tuple[torch.Tensor, ...] = ()
        self.cross_buffers: tuple[torch.Tensor, ...] = ()

        def wrapper(pages_per_slot: int, layout: str):
            if graph_batch is None:
                return flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, layout), ()
            int32 = dict(dtype=torch.int32, device=self.device)
            buffers = (
                torch.zeros(graph_batch + 1, **int32),
                torch.zeros(graph_batch * pages_per_slot, **int32),
                torch.ones(graph_batch, **int32),
            )
            made = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace,
                layout,
                use_cuda_graph=True,
                use_tensor_cores=False,
                paged_kv_indptr_buffer=buffers[0],
                paged_kv_indices_buffer=buffers[1],
                paged_kv_last_page_len_buffer=buffers[2],
            )
            small = torch.zeros(DECODE_INT_WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
            made.reset_workspace_buffer(workspace, small)
            return made, buffers

        self.self_wrapper, self.self_buffers = wrapper(shape.self_pages_per_slot, SELF_LAYOUT)
        self.cross_wrapper, self.cross_buffers = wrapper(self.cross_paging.pages_per_slot, CROSS_LAYOUT)
        if graph_batch is not None:
            self.cache_index = torch.zeros(graph_batch, dtype=torch.long, device=self.device)

    def _plan(self, wrapper, table: PageTable, kv_dtype: torch.dtype, indices: torch.Tensor | None = None) -> None:
        """indices: the table's page indices already on the device. With graphs the
        plan must not wait for the step still running: FlashInfer copies host
        indices synchronously, and the rest of the table from pinned memory
        asynchronously."""
        shape = self.pool.shape
        pinned = self.graph_batch is not None
        wrapper.plan(
            _int32(table.indptr, pinned),
            _int32(table.indices) if indices is None else indices,
            _int32(table.last_page_len, pinned),
            shape.n_heads,
            shape.n_heads,
            shape.head_dim,
            table.page_size,
            q_data_type=self.dtype,
            kv_data_type=kv_dtype,
        )

    def plan_self(self, table: PageTable, indices: torch.Tensor | None = None) -> None:
        self._plan(self.self_wrapper, table, self.dtype, indices)

    def plan_cross(self, table: PageTable) -> None:
        self._plan(self.cross_wrapper, table, self.cross_dtype)

    @property
    def plan_info(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The scheduling facts `plan` computed and `run` bakes into a launch
        (padded batch size, split-KV, workspace offsets), self then cross.
        Read from FlashInfer's private `_plan_info`: no public accessor exists."""
        return tuple(self.self_wrapper._plan_info), tuple(self.cross_wrapper._plan_info)


class PagedPrefill(_PagedLayers):
    """Prompt rows through FlashInfer's batch prefill kernels (fa3 on Hopper):
    causal self-attention over each row's cached and new tokens, non-causal
    cross-attention over its encoder positions."""

    def __init__(self, pool: KVSlotPool, workspace: torch.Tensor) -> None:
        super().__init__(pool)
        flashinfer = import_flashinfer()
        self.self_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, SELF_LAYOUT)
        self.cross_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, CROSS_LAYOUT)

    def plan(self, layout: StepLayout, slots: Sequence[int], tokens: TokenRows) -> None:
        shape = self.pool.shape
        qo_indptr = np.zeros(layout.batch_size + 1, dtype=np.int64)
        np.cumsum(layout.query_lens, out=qo_indptr[1:])
        for wrapper, table, causal, kv_dtype in (
            (self.self_wrapper, page_table(slots, layout.total_lens, shape.self_pages_per_slot), True, self.dtype),
            (self.cross_wrapper, cross_table(slots, shape), False, self.cross_dtype),
        ):
            wrapper.plan(
                _int32(qo_indptr),
                _int32(table.indptr),
                _int32(table.indices),
                _int32(table.last_page_len),
                shape.n_heads,
                shape.n_heads,
                shape.head_dim,
                table.page_size,
                causal=causal,
                q_data_type=self.dtype,
                kv_data_type=kv_dtype,
            )
        self.cache_index = torch.from_numpy(tokens.cache_index).to(self.device, non_blocking=True)


# ------------------------------------------------------------------- backend


def _check_pool(pool: KVSlotPool) -> None:
    device, dtype = pool.self_k[0].device, pool.self_k[0].dtype
    if device.type != "cuda":
        raise ValueError(f"FlashInfer attention needs a CUDA device, got {device}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"FlashInfer attention needs float16 or bfloat16, got {dtype}")


class RaggedEncoderAttention:
    """The encoder's self-attention through FlashInfer's ragged prefill kernel (fa3 on
    Hopper): every clip's positions attend over its own, without a mask.

    `plan` tells FlashInfer the batch's shape on the host; `encoder_attention` then only
    launches, so a captured encoder pass holds one of these per admission size, planned
    before its capture, and every replay reuses that plan (`encoder_graphs`). Its
    schedule lives in the wrapper's own int workspace; the float workspace may be shared
    with wrappers that never run at the same time.
    """

    def __init__(self, workspace: torch.Tensor) -> None:
        self._wrapper = import_flashinfer().BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        self._planned: tuple[torch.Size, torch.dtype] | None = None

    def plan(self, shape: Sequence[int], dtype: torch.dtype) -> None:
        """Plan for q, k and v of `shape` [B, T, heads, head_dim] and `dtype` (nothing to do
        when that is planned already)."""
        planned = (torch.Size(shape), dtype)
        if planned == self._planned:
            return
        b, t, h, d = planned[0]
        indptr = torch.arange(b + 1, dtype=torch.int32) * t  # every clip has all T positions
        self._wrapper.plan(indptr, indptr, h, h, d, causal=False, q_data_type=dtype, kv_data_type=dtype)
        self._planned = planned

    def encoder_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v: [B, T, heads, head_dim], as planned -> [B, T, heads, head_dim]."""
        if (q.shape, q.dtype) != self._planned:
            raise ValueError(f"encoder attention planned for {self._planned}, called with {(q.shape, q.dtype)}")
        b, t, h, d = q.shape
        out = self._wrapper.run(q.reshape(b * t, h, d), k.reshape(b * t, h, d), v.reshape(b * t, h, d))
        return out.view(b, t, h, d)


class FlashInferAttention:
    """`AttentionBackend` on FlashInfer's paged kernels (CUDA only, fp16 or bf16).

    Every step is planned on the host in `begin_step`; `cuda_graphs.DecodeGraphs`
    reuses the same kernels over fixed buffers for captured decode steps.
    """

    def __init__(
        self,
        pool: KVSlotPool,
        *,
        encoder: EncoderKernel = EncoderKernel.SDPA,
        prompt: PromptKernel = PromptKernel.DECODE,
        workspace_bytes: int = WORKSPACE_BYTES,
    ) -> None:
        device = pool.self_k[0].device
        _check_pool(pool)
        import_flashinfer()
        self.pool = pool
        self.encoder = EncoderKernel(encoder)
        self.prompt = PromptKernel(prompt)
        if self.prompt is PromptKernel.PREFILL and pool.cross_dtype != pool.self_k[0].dtype:
            raise ValueError("the prefill prompt kernel is not set up for an FP8 cross-attention cache")
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)
        self._decode = PagedDecode(pool, self.workspace)
        self._prefill: PagedPrefill | None = None
        self._encoder: RaggedEncoderAttention | None = None
        self._step: PagedDecode | PagedPrefill = self._decode

    # encoder ------------------------------------------------------------

    def encoder_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v: [B, T, heads, head_dim] -> [B, T, heads, head_dim]."""
        if self.encoder is EncoderKernel.SDPA:
            return sdpa_encoder_attention(q, k, v)
        if self._encoder is None:
            self._encoder = RaggedEncoderAttention(self.workspace)
        self._encoder.plan(q.shape, q.dtype)
        return self._encoder.encoder_attention(q, k, v)

    # decoder ------------------------------------------------------------

    def begin_step(self, layout: StepLayout) -> None:
        shape = self.pool.shape
        slots = layout.host_slots()
        tokens = token_rows(slots, layout.query_lens, layout.cached_lens, shape.text_ctx)
        if self.prompt is PromptKernel.PREFILL and max(layout.query_lens) > 1:
            if self._prefill is None:
                self._prefill = PagedPrefill(self.pool, self.workspace)
            self._prefill.plan(layout, slots, tokens)
            self._step = self._prefill
            return
        self._decode.plan_self(page_table(tokens.slots, tokens.key_lens, shape.self_pages_per_slot))
        self._decode.plan_cross(cross_table(tokens.slots, shape))
        self._decode.cache_index = torch.from_numpy(tokens.cache_index).to(self.workspace.device, non_blocking=True)
        self._step = self._decode

    def self_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._step.self_attention(layer, q, k, v)

    def cross_attention(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        return self._step.cross_attention(layer, q)
