"""Draws at a temperature that a request can reproduce: noise as a pure function of a seed.

A row's token at a temperature is drawn from noise that depends only on the
request's `seed`, the window and fallback attempt (`window_seed`), the row's
place among its request's rows (best_of samples are rows of their own: its
`stream`) and the index of the token it chooses (`draw_key`), and on the token id
(`uniform`). Nothing depends on the batch a row shares or on the order rows join
it, so the same request draws the same tokens alone or under load, on the CPU or
a GPU; only the logits the noise meets move with float arithmetic.

The hash works on 32-bit values held in int64 (Python ints and int64 tensors
alike), with multipliers below 2**31 so that no product overflows: the same
bits on the host, on the CPU and on a GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from python_backend_lib.engine.rows import Row

MASK32 = 0xFFFF_FFFF

Word = TypeVar("Word", int, torch.Tensor)


def mix32(x: Word) -> Word:
    """A 32-bit integer hash (xor-shift-multiply rounds) of values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & MASK32
    return x ^ (x >> 16)


def window_seed(seed: int, seek: int, attempt: int) -> int:
    """The seed of one decode of one window: the request's seed, where the window starts
    (in mel frames) and which temperature of the fallback it is."""
    return mix32(mix32(mix32(seed & MASK32) ^ (seek & MASK32)) ^ (attempt & MASK32))


def draw_key(seed: int, stream: int, index: int) -> int:
    """The key of one draw: a window's seed, the row's stream among its request's rows,
    and the index of the token it chooses."""
    return mix32(mix32(mix32(seed & MASK32) ^ (stream & MASK32)) ^ (index & MASK32))


@functools.lru_cache(maxsize=8)
def _token_hashes(vocab: int, device: torch.device) -> torch.Tensor:
    """mix32 of every token id, hashed once per vocabulary and device, not at every draw."""
    return mix32(torch.arange(vocab, dtype=torch.int64, device=device))


def uniform(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] int64 keys -> [B, vocab] float64 noise, uniform in (0, 1), each a function of the
    row's key and the token id alone."""
    bits = mix32((keys[:, None] & MASK32) ^ _token_hashes(vocab, keys.device)[None, :])
    return (bits.double() + 0.5) / 2.0**32


def draw_tensors(rows: Sequence[Row], device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The rows' temperatures and draw keys (`Row.draw_key`) for `rules.sample`, or
    (None, None) when every row is greedy."""
    if all(row.options.temperature == 0 for row in rows):
        return None, None
    temperatures = torch.tensor([row.options.temperature for row in rows], device=device)
    return temperatures, torch.tensor([row.draw_key() for row in rows], dtype=torch.long, device=device)
