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
  each row's new K/V goes to, which row of the step before each row follows,
  and the logit rules' per-row facts. Filled from a pinned host copy once per
  step (one host-to-device copy).
- `picks` [max_batch] long and `carried` [N_RULE_FACTS, max_batch] long, shared by
  every bucket: the tokens the step launched last chose and the rule facts it ran
  with, in its row order. The next step reads the tokens and facts of the rows that
  follow from here (`overlap.fed_inputs`), so it is launched before the host has
  seen them.
- Runs (`overlap`): the buckets of at most RUN_ROWS rows also hold a graph of
  RUN_STEPS steps, each step after the first fed by the one before (every row
  following itself, one position further: `run_meta`, made on the device from
  `meta`). A run's rows stay within their last self page (`overlap.plan_step`
  keeps them so), so every step of it reads the tables planned for its first; each
  step's feed writes the last pages' fill for its own positions.
- FlashInfer's page-table buffers, one int32 block per bucket: the self table
  is re-planned only when a row's page count or slot changes (every 16 tokens);
  the last pages' fill, which changes at every step, the step's first kernel
  writes from the rows' positions (`step_kernels`); the cross table has as many
  pages per row whatever happens (30 of 50 positions, or one of 1,500 in the buckets
  of at most WHOLE_SLOT_CROSS_ROWS rows, none as shipped), so it is planned once at capture and
  afterwards only its page indices are rewritten, when slots change.
- Padded rows point at the scratch slot 0 with one self position and the full
  1,500 encoder positions, never 0 (a row of length 0 would be skipped).
- Plan, copy and replay on one stream (the current one). A step is planned
  while the one before it still runs (`engine.overlap`), so nothing the host
  writes may wait for the stream or be rewritten under a copy still queued:
  every host-to-device copy comes from pinned memory that no later step rewrites
  before the copy ran (each bucket's `PinnedRing` of staging buffers, or memory
  allocated for that copy, which PyTorch's pinned allocator keeps), FlashInfer gets its
  page indices on the device (it copies host indices synchronously), and a
  re-plan of a bucket first waits for its previous plan's copies (FlashInfer
  reuses one pinned buffer per wrapper).
- Outputs live in the graphs' private memory pool: the filtered logits
  [batch, vocab] and `picked` [N_PICKED, batch] (token, log-probability,
  no-speech probability, detected language and its probability). After the
  replay, rows at a temperature draw their token on the device, and `picked`
  is copied into pinned memory (the bucket's ring of landing buffers) behind an
  event: the host reads a step's tokens without waiting for the step queued after it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch

from python_backend_lib.core.model_facts import ModelConfig
from python_backend_lib.devices.buckets import DEFAULT_BUCKETS, bucket_sizes, choose_bucket
from python_backend_lib.devices.graph_capture import CapturedGraph, capture_graphs
from python_backend_lib.devices.transfers import PinnedRing, pinned, to_device
from python_backend_lib.engine import step_kernels as fused_tail
from python_backend_lib.engine.flashinfer_attention import FlashInferAttention, PagedDecode, cross_table, page_table
from python_backend_lib.engine.graph_io import (
    META_CACHE_INDEX,
    META_FOLLOWS,
    META_POSITION,
    META_RULES,
    META_TOKEN,
    N_META,
    N_PICKED,
    PICKED_LANGUAGE,
    PICKED_LANGUAGE_PROBABILITY,
    PICKED_LOGPROB,
    PICKED_NO_SPEECH,
    PICKED_TOKEN,
    GraphStep,
    PendingStep,
    Prepared,
    StepInputs,
)
from python_backend_lib.engine.kv_cache import PAGE_SIZE, SCRATCH_SLOT, CrossPaging, PoolShape
from python_backend_lib.engine.model import Whisper
from python_backend_lib.engine.overlap import fed_inputs
from python_backend_lib.engine.rows import Row
from python_backend_lib.engine.rules import N_RULE_FACTS, LogitRules, RuleFacts, sample

log = logging.getLogger(__name__)

# Decode steps in a run (`overlap`), and the largest bucket that holds runs. A run saves
# the host's work for every step but its first, where that work outlasts the GPU's: at
# a few rows. A row's last token is seen once its run ends, so longer runs keep an
# answer waiting longer.
RUN_STEPS = 2
RUN_ROWS = 8

# Buckets of at most this many rows read each slot's cross K/V as one page of every
# position; larger ones as the pool's pages of 50, which FlashInfer splits between
# thread blocks and merges after. The kernel alone read one row's whole slot sooner,
# but in the engine the split's merge went away and the attention cost the same, a
# lone clip no sooner (docs/performance.md, the lone clip): 0, none, is shipped.
WHOLE_SLOT_CROSS_ROWS = 0


def cross_paging_for(batch: int, shape: PoolShape) -> CrossPaging:
    """How a bucket of `batch` rows pages the cross K/V for FlashInfer."""
    return shape.cross_paging(shape.audio_ctx if batch <= WHOLE_SLOT_CROSS_ROWS else None)

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
    cross_page_size: int


class _PaddedRows(NamedTuple):
    slots: np.ndarray  # [batch]
    lengths: np.ndarray  # [batch] self-attention keys, the new token included


class _Entry:
    """One bucket: its graphs' buffers and FlashInfer wrappers."""

    def __init__(self, key: GraphKey, attention: FlashInferAttention, steps: int) -> None:
        """steps: the longest launch it holds (RUN_STEPS for a bucket with runs, else 1)."""
        pool = attention.pool
        shape = pool.shape
        device = attention.workspace.device
        b = key.batch
        self.key = key
        paging = shape.cross_paging(key.cross_page_size)
        self.decode = PagedDecode(pool, attention.workspace, graph_batch=b, cross_paging=paging)
        self.meta = torch.zeros(N_META, b, dtype=torch.long, device=device)
        self.decode.cache_index = self.meta[META_CACHE_INDEX]
        self.steps = steps
        if steps > 1:
            # A run's step i > 0: meta * run_keep + run_shift[i], every row following itself
            # i positions (and cache indices) further; written into run_meta[i] on the device.
            self.run_meta = torch.zeros(steps, N_META, b, dtype=torch.long, device=device)
            self.run_keep = torch.ones(N_META, b, dtype=torch.long, device=device)
            self.run_keep[META_FOLLOWS] = 0
            self.run_shift = torch.zeros(steps, N_META, b, dtype=torch.long, device=device)
            self.run_shift[:, META_POSITION] = torch.arange(steps, device=device)[:, None]
            self.run_shift[:, META_CACHE_INDEX] = torch.arange(steps, device=device)[:, None]
            self.run_shift[:, META_FOLLOWS] = torch.arange(b, device=device)
        # FlashInfer's self page indices, copied here from pinned memory before each re-plan.
        self.self_indices = torch.zeros(b * shape.self_pages_per_slot, dtype=torch.int32, device=device)
        self.planned: torch.cuda.Event | None = None  # after the last plan's copies
        self.staging = PinnedRing((N_META, b), torch.long)  # each step's metadata, on its way in
        self.landing = PinnedRing((N_PICKED, b), torch.float32)  # each step's picks, on their way out
        self.run_landing = PinnedRing((steps, N_PICKED, b), torch.float32) if steps > 1 else None
        self.pad = np.zeros(N_META, dtype=np.int64)  # token 0 at position 0 of the scratch slot
        self.pad[META_CACHE_INDEX] = SCRATCH_SLOT * shape.text_ctx
        self.pad[META_FOLLOWS] = -1
        self.shape = shape
        # The rows' slots and self pages (as bytes) when the self / cross tables were last written.
        self.self_state: tuple[bytes, bytes] | None = None
        self.cross_slots: bytes | None = None
        self.captured_plan: tuple | None = None

    def prepare(self, inputs: StepInputs) -> Prepared:
        """Write the step's plans for `inputs` (the rest of the bucket padding) and
        its staged metadata; nothing here waits for the device."""
        n = len(inputs.slots)
        if inputs.steps not in (1, self.steps):
            raise ValueError(f"a launch of {inputs.steps} steps in a bucket of single steps and runs of {self.steps}")
        lease = self.staging.take()
        st = lease.buffer.numpy()
        st[:, n:] = self.pad[:, None]
        st[META_TOKEN, :n] = inputs.tokens
        st[META_POSITION, :n] = inputs.positions
        st[META_CACHE_INDEX, :n] = inputs.slots * self.shape.text_ctx + inputs.positions
        st[META_FOLLOWS, :n] = inputs.follows
        st[META_RULES:, :n] = inputs.facts
        # The tables change only with the rows' slots and self pages (the padding's never
        # do); otherwise the step's first kernel writes the last pages' fill from the
        # positions (`_forward`). Keyed on the real rows, most steps build nothing more.
        slot_key = inputs.slots.tobytes()
        self_state = (slot_key, (inputs.positions // PAGE_SIZE).tobytes())
        padded: _PaddedRows | None = None  # built once, and only for a table that changes
        if self_state != self.self_state:
            padded = self._padded(inputs)
            self_table = page_table(padded.slots, padded.lengths, self.shape.self_pages_per_slot)
            if self.planned is not None:  # FlashInfer's pinned schedule buffer is about to be rewritten
                self.planned.synchronize()
            indices = self.self_indices[: len(self_table.indices)]
            indices.copy_(pinned(self_table.indices), non_blocking=True)
            self.decode.plan_self(self_table, indices=indices)
            self.self_state = self_state
            self._check_plan()
            self.planned = torch.cuda.Event()
            self.planned.record()
        if slot_key != self.cross_slots:
            if padded is None:
                padded = self._padded(inputs)
            table = cross_table(padded.slots, self.shape, self.decode.cross_paging)
            if self.cross_slots is None:  # at capture, before any step is in flight
                self.decode.plan_cross(table)
                self._check_plan()
            else:  # as many pages a row whatever the slots: the schedule stands, the indices move
                self.decode.cross_buffers[1].copy_(pinned(table.indices), non_blocking=True)
            self.cross_slots = slot_key
        return Prepared(self, inputs, lease.buffer, lease)

    def _padded(self, inputs: StepInputs) -> _PaddedRows:
        """Every row of the bucket: the step's, then padding in the scratch slot."""
        n, b = len(inputs.slots), self.key.batch
        slots = np.full(b, SCRATCH_SLOT, dtype=np.int64)
        lengths = np.ones(b, dtype=np.int64)  # self-attention keys, the new token included
        slots[:n] = inputs.slots
        lengths[:n] = inputs.positions + 1
        return _PaddedRows(slots, lengths)

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
        step_kernels: bool = True,
        run_steps: int = RUN_STEPS,
    ) -> None:
        """step_kernels: the step's tail (feed, rules, choice) in `step_kernels`' four
        kernels when Triton is installed; False, or without Triton: PyTorch's ~80.
        run_steps: steps in a run (`overlap`) in the buckets of at most RUN_ROWS rows; 1: none."""
        self.model = model
        self.config = config
        self.attention = attention
        device = attention.workspace.device
        self.rules = LogitRules(config, device)
        self.kernels = None
        if step_kernels and fused_tail.available():
            self.kernels = fused_tail.StepKernels(config, device)
        elif step_kernels:
            log.warning("Triton is not installed: each decode step applies the logit rules with PyTorch, more slowly")
        special = config.special
        self.no_speech = special.nospeech
        self.language_tokens = (
            torch.tensor(special.language_tokens, device=attention.workspace.device) if config.multilingual else None
        )
        self.buckets = bucket_sizes(max_batch, buckets)
        self.timestamp_begin = config.special.timestamp_begin
        self.picks = torch.zeros(self.max_batch, dtype=torch.long, device=attention.workspace.device)
        self.carried = torch.zeros(N_RULE_FACTS, self.max_batch, dtype=torch.long, device=attention.workspace.device)
        self.run_steps = run_steps
        self.run_buckets = tuple(b for b in self.buckets if b <= RUN_ROWS) if run_steps > 1 else ()
        # Each bucket's graph, its buffers (`_Entry`) and outputs (filtered logits, picked);
        # the runs' graphs of the buckets that hold them, on the same buffers.
        self._by_batch: dict[int, CapturedGraph[_Entry, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._runs: dict[int, CapturedGraph[_Entry, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0  # device memory the captured graphs hold

    def key(self, batch: int) -> GraphKey:
        shape = self.attention.pool.shape
        paging = cross_paging_for(batch, shape)
        return GraphKey(
            batch=batch,
            dtype=self.attention.pool.self_k[0].dtype,
            n_heads=shape.n_heads,
            head_dim=shape.head_dim,
            vocab=self.config.dims.n_vocab,
            page_size=PAGE_SIZE,
            self_pages_per_slot=shape.self_pages_per_slot,
            cross_pages_per_slot=paging.pages_per_slot,
            cross_page_size=paging.page_size,
        )

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def fits(self, n: int) -> bool:
        return choose_bucket(self.buckets, n) is not None

    def fits_run(self, n: int) -> bool:
        """Whether a run of `n` rows has a graph."""
        return choose_bucket(self.buckets, n) in self._runs

    def replay(self, n: int) -> None:
        """Replay the graph that holds `n` rows on its buffers as they stand: nothing
        written in, nothing read back (a benchmark times the GPU's part of a step)."""
        self._by_batch[choose_bucket(self.buckets, n)].replay()

    # capture ---------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket (`devices.graph_capture`). Call after the weights and
        the KV pool exist and FlashInfer has been JIT-compiled; nothing may be
        reallocated afterwards."""
        device = self.attention.workspace.device
        self._by_batch, cost = capture_graphs(self.buckets, self._entry, self._forward, device)
        runs_cost = None
        if self.run_buckets:
            self._runs, runs_cost = capture_graphs(
                self.run_buckets, lambda batch: self._by_batch[batch].buffers, self._forward_run, device
            )
        self.capture_seconds = cost.seconds + (runs_cost.seconds if runs_cost else 0.0)
        self.capture_bytes = cost.bytes + (runs_cost.bytes if runs_cost else 0)
        log.info(
            "captured %d decode graphs (batch %s) and %d runs of %d steps in %.2f s, holding %.1f MiB",
            len(self.buckets),
            ",".join(map(str, self.buckets)),
            len(self._runs),
            self.run_steps,
            self.capture_seconds,
            self.capture_bytes / 2**20,
        )

    def _entry(self, batch: int) -> _Entry:
        """A bucket's buffers, every row padding, planned: its plans are the ones captured."""
        entry = _Entry(self.key(batch), self.attention, self.run_steps if batch in self.run_buckets else 1)
        nothing = np.zeros(0, dtype=np.int64)
        empty = StepInputs(nothing, nothing, nothing, np.zeros((N_RULE_FACTS, 0), np.int64), np.zeros(0), nothing,
                           draw_keys=nothing)
        entry.meta.copy_(entry.prepare(empty).pinned)
        entry.captured_plan = entry.decode.plan_info
        return entry

    def _forward(self, entry: _Entry) -> tuple[torch.Tensor, torch.Tensor]:
        """One step over the bucket: (filtered logits [batch, vocab], picked [N_PICKED, batch])."""
        picked = torch.zeros(N_PICKED, entry.key.batch, dtype=torch.float32, device=entry.meta.device)
        logits = self._step(entry.meta, entry.decode, picked, languages=True)
        return logits, picked

    def _forward_run(self, entry: _Entry) -> tuple[torch.Tensor, torch.Tensor]:
        """A run over the bucket: (the last step's filtered logits, picked [steps, N_PICKED, batch])."""
        picked = torch.zeros(entry.steps, N_PICKED, entry.key.batch, dtype=torch.float32, device=entry.meta.device)
        decode = entry.decode
        logits = self._step(entry.meta, decode, picked[0], languages=False)
        try:
            for i in range(1, entry.steps):
                meta = torch.addcmul(entry.run_shift[i], entry.meta, entry.run_keep, out=entry.run_meta[i])
                decode.cache_index = meta[META_CACHE_INDEX]  # where this step's new K/V go
                logits = self._step(meta, decode, picked[i], languages=False)
        finally:
            decode.cache_index = entry.meta[META_CACHE_INDEX]
        return logits, picked

    def _step(self, meta: torch.Tensor, decode: PagedDecode, picked: torch.Tensor, *, languages: bool) -> torch.Tensor:
        """One decode step over the rows of `meta`, their picks written into `picked`
        [N_PICKED, batch] (the language's where `languages`), `picks` and `carried`;
        returns the filtered logits. `picked` is float32 for one readback: token and
        language ids are below 2**24, which it holds exactly."""
        b = meta.shape[1]
        last_page_len = decode.self_buffers[2]  # what FlashInfer reads of each row's last self page
        if self.kernels is not None:
            tokens, facts = self.kernels.feed(meta, self.picks, self.carried, last_page_len=last_page_len)
        else:
            tokens, facts = fed_inputs(meta, self.picks, self.carried, self.timestamp_begin)
            last_page_len.copy_(meta[META_POSITION] % PAGE_SIZE + 1)
        hidden = self.model.decoder(tokens, meta[META_POSITION], decode)
        raw = self.model.raw_logits(hidden)  # [batch, vocab] in the model's dtype
        logits = torch.empty(raw.shape, dtype=torch.float32, device=raw.device)
        if self.kernels is not None:
            self.kernels.choose(
                raw,
                facts,
                logits=logits,
                picks=self.picks[:b],
                token_values=picked[PICKED_TOKEN],
                logprobs=picked[PICKED_LOGPROB],
                no_speech=picked[PICKED_NO_SPEECH],
            )
        else:
            # Read where <|startoftranscript|> was fed; the same arithmetic as the eager path.
            picked[PICKED_NO_SPEECH] = raw.float().softmax(dim=-1)[:, self.no_speech]
            logits.copy_(self.rules.apply(raw.float(), RuleFacts.from_table(facts)))
            greedy, picked[PICKED_LOGPROB] = sample(logits)
            picked[PICKED_TOKEN] = greedy.float()
            self.picks[:b].copy_(greedy)  # for the next step's following rows
        if languages and self.language_tokens is not None:
            language = raw[:, self.language_tokens].float().softmax(dim=-1).max(dim=-1)
            picked[PICKED_LANGUAGE] = language.indices.float()
            picked[PICKED_LANGUAGE_PROBABILITY] = language.values
        self.carried[:, :b].copy_(facts)  # what the rows that follow in the next step move on from
        return logits

    # steps -----------------------------------------------------------------

    @torch.inference_mode()
    def prepare(self, inputs: StepInputs) -> Prepared:
        """Plan a step for `inputs` in the smallest bucket that holds it, without waiting
        for the device (a step still running keeps its own plans)."""
        n = len(inputs.slots)
        batch = choose_bucket(self.buckets, n)
        if batch is None:
            raise ValueError(f"{n} rows do not fit the largest captured batch {self.max_batch}")
        return self._by_batch[batch].buffers.prepare(inputs)

    @torch.inference_mode()
    def launch(self, prepared: Prepared, *, replay: bool = True, keep_logits: bool = False) -> PendingStep:
        """Queue the step: its metadata, the graph, the draws of rows at a temperature,
        the copy of its picks to the host. Returns at once.

        replay=False launches the captured step's kernels directly instead of
        replaying the graph, on the same buffers: the same kernels on the same
        inputs, which must give the same bits (tests check it).
        keep_logits: keep a copy of the filtered logits (the next step overwrites the graph's).
        """
        entry, inputs = prepared.entry, prepared.inputs
        if inputs.steps > 1 and inputs.temperatures.any():
            raise ValueError("a run draws nothing: its rows must be greedy")
        entry.meta.copy_(prepared.pinned, non_blocking=True)
        entry.staging.queued(prepared.lease)
        if inputs.steps > 1:  # a run: every row follows, greedy (`overlap`)
            logits, picked = self._runs[entry.key.batch].replay() if replay else self._forward_run(entry)
            landing = entry.run_landing.take()
            return PendingStep(len(inputs.slots), picked, None, self.language_tokens is not None, landing=landing)
        if replay:
            logits, picked = self._by_batch[entry.key.batch].replay()
        else:
            logits, picked = self._forward(entry)
        if inputs.temperatures.any():  # rows at a temperature draw from the filtered logits, as `sample` does eagerly
            hot = np.flatnonzero(inputs.temperatures)  # temperatures are never negative
            device = logits.device
            index = to_device(hot, device)
            temperatures = to_device(inputs.temperatures[hot].astype(np.float32), device)
            drawn, drawn_logprobs = sample(logits[index], temperatures, to_device(inputs.draw_keys[hot], device))
            picked[PICKED_TOKEN].index_copy_(0, index, drawn.float())
            picked[PICKED_LOGPROB].index_copy_(0, index, drawn_logprobs)
            self.picks.index_copy_(0, index, drawn)
        n = len(inputs.slots)
        kept = logits[:n].clone() if keep_logits else None
        return PendingStep(n, picked, kept, self.language_tokens is not None, landing=entry.landing.take())

    def run(self, rows: Sequence[Row], *, replay: bool = True) -> GraphStep:
        """One step feeding each row's first pending token, waited for (its logits kept)."""
        prepared = self.prepare(StepInputs.of_rows(rows, self.timestamp_begin))
        return self.launch(prepared, replay=replay, keep_logits=True).result()
