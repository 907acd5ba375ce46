"""The CPU's decoder attention (`SdpaAttention`, row by row over each slot where it lies)
against the gathered call a GPU without FlashInfer runs: a row's self- and
cross-attention is the same bits alone and among any other rows, and within float32's
rounding of the gathered call's, decode rows and prompt rows, cached or not."""

from __future__ import annotations

import random

import pytest
import torch

from python_backend_lib.engine.attention import SdpaAttention, StepLayout
from python_backend_lib.engine.kv_cache import KVSlotPool, PoolShape

CPU = torch.device("cpu")
SHAPE = PoolShape(n_slots=12, n_layers=2, n_heads=3, head_dim=16, text_ctx=64, audio_ctx=40)


@pytest.fixture(scope="module")
def pool() -> KVSlotPool:
    pool = KVSlotPool(SHAPE, device=CPU, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    for tensor in (*pool.self_k, *pool.self_v, *pool._cross_k, *pool._cross_v):
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return pool


def random_rows(rng: random.Random, count: int) -> list[tuple[int, int, int]]:
    """(slot, new tokens, cached tokens) of `count` rows on distinct slots: mostly decode
    rows of one token, some prompts of several, at any point of the context."""
    rows = []
    for slot in rng.sample(range(1, SHAPE.n_slots + 1), count):
        query = 1 if rng.random() < 0.6 else rng.randint(2, 12)
        rows.append((slot, query, rng.randint(0, SHAPE.text_ctx - query)))
    return rows


def attend(pool: KVSlotPool, rows: list[tuple[int, int, int]], in_place: bool = True) -> list[torch.Tensor]:
    """Each layer's self-attention, then each layer's cross-attention, of one step of
    `rows`, each row's new tokens' q, k and v drawn from its own seed, so that a row
    brings the same tokens to every batch."""
    layout = StepLayout(torch.tensor([slot for slot, _, _ in rows]), tuple(q for _, q, _ in rows),
                        tuple(c for _, _, c in rows))  # fmt: skip

    def tokens(part: int) -> torch.Tensor:
        return torch.cat([torch.randn(query, SHAPE.n_heads, SHAPE.head_dim,
                                      generator=torch.Generator().manual_seed(1000 * slot + 10 * cached + part))
                          for slot, query, cached in rows])  # fmt: skip

    q, k, v = tokens(0), tokens(1), tokens(2)
    attention = SdpaAttention(pool)
    attention._in_place = in_place
    attention.begin_step(layout)
    self_out = [attention.self_attention(layer, q, k, v) for layer in range(SHAPE.n_layers)]
    return self_out + [attention.cross_attention(layer, q) for layer in range(SHAPE.n_layers)]


def row_of(outputs: list[torch.Tensor], rows: list[tuple[int, int, int]], index: int) -> list[torch.Tensor]:
    start = sum(query for _, query, _ in rows[:index])
    return [out[start : start + rows[index][1]] for out in outputs]


@pytest.mark.parametrize("seed", range(6))
def test_a_rows_attention_is_the_same_bits_alone_and_among_other_rows(pool, seed):
    """A row's result must not depend on its batch (tests/unit/test_transcribe.py's batch
    invariance, at the attention): not on the longest row's keys, nor on a prompt beside it."""
    rng = random.Random(seed)
    rows = random_rows(rng, rng.randint(2, SHAPE.n_slots))
    together = attend(pool, rows)
    for index, row in enumerate(rows):
        alone = attend(pool, [row])
        assert all(torch.equal(a, b) for a, b in zip(alone, row_of(together, rows, index))), (row, rows)


@pytest.mark.parametrize("seed", range(6))
def test_the_cpus_row_loop_agrees_with_the_gathered_call(pool, seed):
    """The gathered call pads every row to the step's longest query and keys (masked),
    so its sums run in another order: the same attention to float32's rounding."""
    rng = random.Random(seed)
    rows = random_rows(rng, rng.randint(1, SHAPE.n_slots))
    for loop, gathered in zip(attend(pool, rows), attend(pool, rows, in_place=False)):
        torch.testing.assert_close(loop, gathered, rtol=1e-5, atol=1e-6)
