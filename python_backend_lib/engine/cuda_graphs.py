"""A table of captured decode steps, one CUDA graph per padded batch size.

A decode step (one new token per row) is the whole decoder forward, the tied
output projection, Whisper's logit rules and the greedy choice, plus what the
start of a transcript needs (the no-speech probability, the language logits):
hundreds of small kernels for a small model, so launching them costs more than
running them. Rows feeding a short prompt step through the same graph, one
prompt token a step. Each bucket of the table holds one captured step for exactly `batch`
rows; a step of n rows replays the smallest bucket with batch >= n, the
remaining rows padded.

What a graph bakes in, and so what the key (`GraphKey`) must hold: every
tensor shape (batch, heads, head dim, vocabulary), dtype and page geometry,
and FlashInfer's launch configuration. For the CUDA-core decode kernel with
`use_cuda_graph=True` that configuration (padded batch size, split-KV, the
workspace offsets: its "plan info") depends only on the batch size, head count,
dtype and page size; lengths, page indices and the KV chunk size are read from
device buffers that `plan` rewrites. After each re-plan the plan info is
checked against the captured one.

Static buffers, and the rules for them:
- `meta` [N_META, batch] long: token ids, positions, the flat self-cache index
  each row's new K/V goes to, and the logit rules' per-row facts. Filled from a
  pinned host copy once per step (one host-to-device copy).
- FlashInfer's page-table buffers, one int32 block per bucket: the self table
  is re-planned only when a row's page count or slot changes (every 16 tokens),
  otherwise only the last-page lengths change; the cross table has 94 pages
  per row whatever happens, so it is planned once at capture and afterwards
  only its page indices are rewritten, when slots change.
- Padded rows point at the scratch slot 0 with one self position and the full
  1,500 encoder positions, never 0 (a row of length 0 would be skipped).
- Plan, copy and replay on one stream (the current one); at most one step is
  in flight, since each step ends by reading its tokens back, so the pinned
  staging buffers are never rewritten under a pending copy.
- Outputs live in the graphs' private memory pool: the filtered logits
  [batch, vocab], the raw logits of the language tokens [batch, languages]
  (multilingual checkpoints), and (token, log-probability, no-speech
  probability) [3, batch], read back in one small device-to-host copy.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from python_backend_lib.core.model_facts import ModelConfig
from python_backend_lib.engine.flashinfer_attention import FlashInferAttention, PagedDecode, page_table
from python_backend_lib.engine.kv_cache import PAGE_SIZE, SCRATCH_SLOT
from python_backend_lib.engine.model import Whisper
from python_backend_lib.engine.rows import Row
from python_backend_lib.engine.rules import N_RULE_FACTS, LogitRules, RuleFacts, sample

log = logging.getLogger(__name__)

# Padded batch sizes with a captured step; a table takes those up to its
# largest batch and the largest batch itself.
DEFAULT_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)

# Rows of the `meta` buffer.
META_TOKEN, META_POSITION, META_CACHE_INDEX = 0, 1, 2
META_RULES = 3  # N_RULE_FACTS rows from here, in RuleFacts field order
N_META = META_RULES + N_RULE_FACTS


def bucket_sizes(max_batch: int, candidates: Sequence[int] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The padded batch sizes of a table whose largest batch is `max_batch`."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    return tuple(sorted({b for b in candidates if b < max_batch} | {max_batch}))


def choose_bucket(buckets: Sequence[int], n: int) -> int | None:
    """The smallest bucket holding n rows (buckets sorted); None when none does."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if n >= 1 and i < len(buckets) else None


@dataclass(frozen=True)
class GraphKey:
    """Everything a captured step's launches depend on."""

    batch: int
    dtype: torch.dtype
    n_heads: int
    head_dim: int
    vocab: int
    page_size: int
    self_pages_per_slot: int
    cross_pages_per_slot: int


# Rows of the `picked` output, read back after every replay.
PICKED_TOKEN, PICKED_LOGPROB, PICKED_NO_SPEECH = 0, 1, 2


@dataclass(frozen=True)
class GraphStep:
    """What one replay hands back, for the n real rows."""

    tokens: list[int]  # greedy choices
    logprobs: list[float]  # their log-probabilities under the filtered logits
    no_speech: list[float]  # the no-speech probability, meaningful where <|startoftranscript|> was fed
    logits: torch.Tensor  # [n, vocab] float32 filtered logits (a view of the graph's output)
    language_logits: torch.Tensor | None  # [n, languages] raw logits (a view); None on English-only checkpoints


class _Entry:
    """One bucket: its graph, buffers and FlashInfer wrappers."""

    def __init__(self, key: GraphKey, attention: FlashInferAttention) -> None:
        pool = attention.pool
        shape = pool.shape
        device = attention.workspace.device
        b = key.batch
        self.key = key
        self.decode = PagedDecode(pool, attention.workspace, graph_batch=b)
        self.meta = torch.zeros(N_META, b, dtype=torch.long, device=device)
        self.decode.cache_index = self.meta[META_CACHE_INDEX]
        self.staging = torch.zeros(N_META, b, dtype=torch.long).pin_memory()
        self.staging_np = self.staging.numpy()
        self.pad = np.zeros(N_META, dtype=np.int64)  # token 0 at position 0 of the scratch slot
        self.pad[META_CACHE_INDEX] = SCRATCH_SLOT * shape.text_ctx
        self.self_pages_per_slot = shape.self_pages_per_slot
        self.cross_pages_per_slot = shape.cross_pages_per_slot
        self.audio_ctx = shape.audio_ctx
        self.text_ctx = shape.text_ctx
        # The rows' state when the self / cross tables were last written.
        self.self_state: tuple | None = None
        self.cross_slots: tuple | None = None
        self.captured_plan: tuple | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.picked: torch.Tensor | None = None
        self.language_logits: torch.Tensor | None = None

    def prepare(self, rows: Sequence[Row], timestamp_begin: int) -> None:
        """Write the step's inputs for `rows` (the rest padding) into the buffers."""
        n, b = len(rows), self.key.batch
        st = self.staging_np
        st[:, n:] = self.pad[:, None]
        slots = np.full(b, SCRATCH_SLOT, dtype=np.int64)
        lengths = np.ones(b, dtype=np.int64)  # self-attention keys, the new token included
        if n:
            slots[:n] = [r.slot for r in rows]
            cached = np.fromiter((r.cached for r in rows), dtype=np.int64, count=n)
            st[META_TOKEN, :n] = [r.pending[0] for r in rows]
            st[META_POSITION, :n] = cached
            st[META_CACHE_INDEX, :n] = slots[:n] * self.text_ctx + cached
            st[META_RULES:, :n] = np.array([r.rule_facts(timestamp_begin) for r in rows], dtype=np.int64).T
            lengths[:n] = cached + 1
        self.meta.copy_(self.staging, non_blocking=True)

        slot_key = tuple(slots.tolist())
        pages = -(-lengths // PAGE_SIZE)
        self_state = (slot_key, tuple(pages.tolist()))
        self_table = page_table(slots, lengths, self.self_pages_per_slot)
        if self_state != self.self_state:
            self.decode.plan_self(self_table)
            self.self_state = self_state
            self._check_plan()
        else:  # same pages: only the last page's fill moved
            indptr, indices, last = self.decode.self_buffers
            last.copy_(torch.from_numpy(self_table.last_page_len))
        if slot_key != self.cross_slots:
            cross_table = page_table(slots, np.full(b, self.audio_ctx), self.cross_pages_per_slot)
            if self.cross_slots is None:
                self.decode.plan_cross(cross_table)
                self._check_plan()
            else:  # 94 pages a row whatever the slots: the schedule stands, the indices move
                self.decode.cross_buffers[1].copy_(torch.from_numpy(cross_table.indices))
            self.cross_slots = slot_key

    def _check_plan(self) -> None:
        if self.captured_plan is not None and self.decode.plan_info != self.captured_plan:
            raise RuntimeError(
                f"FlashInfer re-planned batch {self.key.batch} differently from its captured graph: "
                f"{self.decode.plan_info} != {self.captured_plan}"
            )


class DecodeGraphs:
    """Captured decode steps for batches of 1..max_batch rows, over one
    FlashInfer backend's KV pool and workspace."""

    def __init__(
        self,
        model: Whisper,
        config: ModelConfig,
        attention: FlashInferAttention,
        *,
        max_batch: int,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
    ) -> None:
        self.model = model
        self.config = config
        self.attention = attention
        self.rules = LogitRules(config, attention.workspace.device)
        special = config.special
        self.no_speech = special.nospeech
        self.language_tokens = (
            torch.tensor(special.language_tokens, device=attention.workspace.device) if config.multilingual else None
        )
        self.buckets = bucket_sizes(max_batch, buckets)
        self.timestamp_begin = config.special.timestamp_begin
        self._entries: dict[GraphKey, _Entry] = {}
        self._mempool = None
        self.capture_seconds = 0.0
        self.capture_bytes = 0  # device memory the captured graphs hold

    def key(self, batch: int) -> GraphKey:
        shape = self.attention.pool.shape
        return GraphKey(
            batch=batch,
            dtype=self.attention.pool.self_k[0].dtype,
            n_heads=shape.n_heads,
            head_dim=shape.head_dim,
            vocab=self.config.dims.n_vocab,
            page_size=PAGE_SIZE,
            self_pages_per_slot=shape.self_pages_per_slot,
            cross_pages_per_slot=shape.cross_pages_per_slot,
        )

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def fits(self, n: int) -> bool:
        return choose_bucket(self.buckets, n) is not None

    # capture ---------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, into one private memory pool.
        Call after the weights and the KV pool exist and FlashInfer has been
        JIT-compiled; nothing may be reallocated afterwards."""
        start = time.perf_counter()
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        self._mempool = torch.cuda.graph_pool_handle()
        for batch in sorted(self.buckets, reverse=True):
            self._capture(batch)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = torch.cuda.memory_reserved() - reserved
        log.info(
            "captured %d decode graphs (batch %s) in %.2f s, holding %.1f MiB",
            len(self.buckets),
            ",".join(map(str, self.buckets)),
            self.capture_seconds,
            self.capture_bytes / 2**20,
        )

    def _capture(self, batch: int) -> None:
        key = self.key(batch)
        entry = _Entry(key, self.attention)
        entry.prepare([], self.timestamp_begin)  # every row padding
        entry.captured_plan = entry.decode.plan_info
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy initialisation stays out of the graph
                self._forward(entry)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            entry.logits, entry.picked, entry.language_logits = self._forward(entry)
        entry.graph = graph
        self._entries[key] = entry

    def _forward(self, entry: _Entry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        meta = entry.meta
        hidden = self.model.decoder(meta[META_TOKEN], meta[META_POSITION], entry.decode)
        raw = self.model.logits(hidden)  # [batch, vocab] float32
        # Read where <|startoftranscript|> was fed; the same arithmetic as the eager path.
        no_speech = raw.softmax(dim=-1)[:, self.no_speech]
        languages = raw[:, self.language_tokens] if self.language_tokens is not None else None
        logits = self.rules.apply(raw, RuleFacts.from_table(meta[META_RULES:]))
        greedy, logprobs = sample(logits)
        # Token ids are below 2**24, so float32 holds them exactly: one readback.
        return logits, torch.stack([greedy.float(), logprobs, no_speech]), languages

    # replay ----------------------------------------------------------------

    @torch.inference_mode()
    def run(self, rows: Sequence[Row], *, replay: bool = True) -> GraphStep:
        """One decode step feeding each row's first pending token.

        replay=False launches the captured step's kernels directly instead of
        replaying the graph, on the same buffers: the same kernels on the same
        inputs, which must give the same bits (tests check it).
        """
        n = len(rows)
        batch = choose_bucket(self.buckets, n)
        if batch is None:
            raise ValueError(f"{n} rows do not fit the largest captured batch {self.max_batch}")
        entry = self._entries[self.key(batch)]
        entry.prepare(rows, self.timestamp_begin)
        if replay:
            entry.graph.replay()
            logits, picked, languages = entry.logits, entry.picked, entry.language_logits
        else:
            logits, picked, languages = self._forward(entry)
        host = picked[:, :n].cpu()
        return GraphStep(
            tokens=host[PICKED_TOKEN].long().tolist(),
            logprobs=host[PICKED_LOGPROB].tolist(),
            no_speech=host[PICKED_NO_SPEECH].tolist(),
            logits=logits[:n],
            language_logits=None if languages is None else languages[:n],
        )
