"""Attention behind one small interface, so the model never branches on the platform.

Three kinds of attention run in Whisper:
- the encoder's own non-causal self-attention over 1,500 positions;
- decoder self-attention over each request's cached tokens (causal);
- decoder cross-attention over each request's 1,500 encoder positions.

Decoder queries arrive ragged: all rows' new tokens flattened into one
[tokens, heads, head_dim] tensor, row i owning `query_lens[i]` of them (1 per
row in a decode step, the prompt in a prefill). A backend is told the step's
layout once (`begin_step`) and then called per layer. `SdpaAttention` is the
reference and the CPU path; `flashinfer_attention.FlashInferAttention` is the
GPU path.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from python_backend_lib.engine.kv_cache import KVSlotPool


@dataclass(frozen=True)
class StepLayout:
    """Where one decoder step's tokens go.

    slots: [B] KV slot of each row (device tensor).
    query_lens: new tokens per row.
    cached_lens: tokens already in each row's cache before this step.
    slot_ids: the same slots on the host, for backends that plan on the host
        (empty: read from `slots`).
    """

    slots: torch.Tensor
    query_lens: tuple[int, ...]
    cached_lens: tuple[int, ...]
    slot_ids: tuple[int, ...] = ()

    def host_slots(self) -> tuple[int, ...]:
        return self.slot_ids or tuple(self.slots.tolist())

    @property
    def batch_size(self) -> int:
        return len(self.query_lens)

    @property
    def total_lens(self) -> tuple[int, ...]:
        return tuple(c + q for c, q in zip(self.cached_lens, self.query_lens))

    def positions(self, device: torch.device) -> torch.Tensor:
        """[tokens] the text position of every new token, rows concatenated."""
        return torch.cat(
            [torch.arange(c, c + q, device=device) for c, q in zip(self.cached_lens, self.query_lens)]
        )

    def last_token_index(self, device: torch.device) -> torch.Tensor:
        """[B] index of each row's last new token in the flattened token axis."""
        return torch.tensor(self.query_lens, device=device).cumsum(0) - 1


class EncoderAttention(Protocol):
    """What the encoder's layers call: every backend, and the captured encoder passes' own."""

    def encoder_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v: [B, T, heads, head_dim] -> [B, T, heads, head_dim]."""


class AttentionBackend(EncoderAttention, Protocol):
    pool: KVSlotPool

    def begin_step(self, layout: StepLayout) -> None:
        """Prepare for the decoder layers of one step."""

    def self_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append k, v ([tokens, heads, head_dim]) to the rows' caches, then attend
        causally: q [tokens, heads, head_dim] -> [tokens, heads, head_dim]."""

    def cross_attention(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [tokens, heads, head_dim] over each row's encoder K/V -> same shape."""


def sdpa_encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The encoder's full (non-causal) attention through PyTorch SDPA; q, k, v:
    [B, T, heads, head_dim] -> [B, T, heads, head_dim]. Every backend's default."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


class SdpaAttention:
    """PyTorch scaled-dot-product attention over the slot pool, on any device.

    Rows are padded to the longest query of the step; a boolean mask hides both
    the padding and the future, so a row's result does not depend on its batch.
    """

    def __init__(self, pool: KVSlotPool) -> None:
        self.pool = pool
        self._layout: StepLayout | None = None
        # On the CPU a loop over rows costs little and saves copies: each row attends over
        # its own slot where it lies, where a batched call would gather every row's keys
        # and values, padded to the longest row (`_in_place_*`). A GPU would rather run
        # one kernel over the gathered rows.
        self._in_place = pool.cross_k[0].device.type == "cpu"

    def encoder_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sdpa_encoder_attention(q, k, v)

    def begin_step(self, layout: StepLayout) -> None:
        device = layout.slots.device
        self._layout = layout
        lens = torch.tensor(layout.query_lens, device=device)
        # Slot and cache position of every new token, in flattened order: where its K/V go.
        self._token_slots = torch.repeat_interleave(layout.slots, lens)
        self._token_positions = layout.positions(device)
        if self._in_place:
            self._rows = _rows(layout)
            return
        max_query = max(layout.query_lens)
        max_total = max(layout.total_lens)
        cached = torch.tensor(layout.cached_lens, device=device)
        query_index = torch.arange(max_query, device=device)
        # [B, max_query]: which padded query cells hold a real token.
        self._valid = query_index[None, :] < lens[:, None]
        # Key j is visible to the query at position p when j <= p.
        query_positions = cached[:, None] + query_index[None, :]  # [B, max_query]
        key_positions = torch.arange(max_total, device=device)
        self._causal = key_positions[None, None, :] <= query_positions[:, :, None]  # [B, Lq, Lk]
        self._max_total = max_total

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, H, D] -> [B, H, max_query, D], zeros in the padding."""
        b, lq = self._valid.shape
        padded = x.new_zeros(b, lq, *x.shape[1:])
        padded[self._valid] = x
        return padded.transpose(1, 2)

    def _unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, max_query, D] -> [tokens, H, D]."""
        return x.transpose(1, 2)[self._valid]

    def self_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pool = self.pool
        pool.self_k[layer][self._token_slots, self._token_positions] = k.to(pool.self_k[layer].dtype)
        pool.self_v[layer][self._token_slots, self._token_positions] = v.to(pool.self_v[layer].dtype)
        if self._in_place:
            return self._self_attention_in_place(layer, q)
        slots = self._layout.slots
        keys = pool.self_k[layer][slots, : self._max_total].transpose(1, 2)  # [B, H, Lk, D]
        values = pool.self_v[layer][slots, : self._max_total].transpose(1, 2)
        out = F.scaled_dot_product_attention(self._pad(q), keys, values, attn_mask=self._causal[:, None])
        return self._unpad(out)

    def cross_attention(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        if self._in_place:
            return self._cross_attention_in_place(layer, q)
        slots = self._layout.slots
        keys = self.pool.cross_k[layer][slots].transpose(1, 2).to(q.dtype)  # [B, H, 1500, D]; FP8 kept: cast back
        values = self.pool.cross_v[layer][slots].transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(self._pad(q), keys, values)
        return self._unpad(out)

    def _self_attention_in_place(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Row by row over the keys and values of each row's slot where they lie: the
        batched call copies every row's up to the longest row's length, each layer and step."""
        keys, values = self.pool.self_k[layer], self.pool.self_v[layer]  # [S + 1, text_ctx, H, D]
        out = [
            F.scaled_dot_product_attention(
                q[row.start : row.start + row.query].transpose(0, 1)[None],  # [1, H, query, D]
                keys[row.slot, : row.keys].transpose(0, 1)[None].to(q.dtype),
                values[row.slot, : row.keys].transpose(0, 1)[None].to(q.dtype),
                attn_mask=row.mask,
            )[0].transpose(0, 1)
            for row in self._rows
        ]  # each [query, H, D]
        return torch.cat(out)

    def _cross_attention_in_place(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Row by row over each slot's K/V where it lies: gathering the rows'
        1,500 positions into one tensor would copy 2.3 MB per row, layer and
        step for K and again for V, more memory traffic than the attention's own."""
        keys, values = self.pool.cross_k[layer], self.pool.cross_v[layer]
        out = [
            F.scaled_dot_product_attention(
                q[row.start : row.start + row.query].transpose(0, 1)[None],  # [1, H, query, D]
                keys[row.slot : row.slot + 1].transpose(1, 2).to(q.dtype),
                values[row.slot : row.slot + 1].transpose(1, 2).to(q.dtype),
            )[0].transpose(0, 1)
            for row in self._rows
        ]  # each [query, H, D]
        return torch.cat(out)


class _Row(NamedTuple):
    """One row of a step, as `SdpaAttention`'s row loops read it."""

    slot: int
    start: int  # its first token in the step's flattened tokens
    query: int  # its new tokens
    keys: int  # its tokens cached before the step and new in it
    mask: torch.Tensor | None  # [query, keys]: which keys each new token sees; None: all


def _rows(layout: StepLayout) -> list[_Row]:
    """What the row loops read: each row's slot, where its tokens start in the step's
    flattened tokens, its keys' count, and the causal mask of a row of several new
    tokens (None for one token, which sees every key cached before it)."""
    device = layout.slots.device
    starts = itertools.accumulate(layout.query_lens, initial=0)
    return [
        _Row(slot, start, query, cached + query, None if query == 1 else _causal_mask(cached, query, device))
        for slot, start, query, cached in zip(layout.host_slots(), starts, layout.query_lens, layout.cached_lens)
    ]


def _causal_mask(cached: int, query: int, device: torch.device) -> torch.Tensor:
    """[query, cached + query]: key j is visible to the new token at position cached + p when j <= cached + p."""
    return torch.arange(cached + query, device=device)[None, :] <= cached + torch.arange(query, device=device)[:, None]
