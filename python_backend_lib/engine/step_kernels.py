"""The tail of a captured decode step in four Triton kernels: what each row feeds,
Whisper's logit rules, the greedy choice and the no-speech probability.

Done with PyTorch operations (`overlap.fed_inputs`, `rules.LogitRules`,
`rules.sample`), that tail is about 80 kernels a step: the rules' masks over
[rows, vocab], and five reductions over the vocabulary that each run one row on
one block of threads; at small batches that tail was a large share of a graph
step's GPU time (docs/gpu.md). Here:

- `_feed`: each row's token and rule facts, for rows that follow the picks of the
  step before and the facts it ran with moved on past them (what
  `overlap.fed_inputs` computes), and the fill of its last self-attention page,
  which FlashInfer reads (so the host copies none);
- `_chunk_stats`: one program per (row, chunk of the vocabulary) masks its chunk
  by the masking rules (`_masked`), writes it out, and reduces it: the best token
  below the timestamps and the sums of exponentials that a softmax needs, for the
  tokens below the timestamps, the timestamps, and the raw logits;
- `_row_choice`: one program per row merges its chunks, applies the rule that
  forces a timestamp when the timestamps together outweigh every token below them
  (`_force_a_timestamp`),
  and writes the token, its log-probability and the no-speech probability;
- `_forced_text_mask`: masks everything but the timestamps in the written
  logits of the rows forced to a timestamp (what the rule's masked_fill does).

Tokens equal the PyTorch path's: the masks are the same, a maximum is exact
whatever the order it is taken in, and ties go to the lower token id as
`argmax`'s do. Log-probabilities, the no-speech probability and the timestamp
test sum their exponentials in another order: they agree to float32 rounding
(tests/unit/test_step_kernels.py compares both paths; on a machine without a GPU,
in Triton's interpreter). Each rule of `rules.DECODING_RULES` has its Triton twin
here, and tests/unit/test_rule_table.py compares them rule by rule.
"""

from __future__ import annotations

import torch

from python_backend_lib.core.model_facts import ModelConfig
from python_backend_lib.engine.graph_io import META_FOLLOWS, META_POSITION, META_RULES, META_TOKEN
from python_backend_lib.engine.kv_cache import PAGE_SIZE
from python_backend_lib.engine.rules import N_RULE_FACTS, RuleFacts

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU torch of a CI machine, or a GPU image without Triton
    triton = None

# The vocabulary is reduced in chunks of this many tokens, one program each, so a
# single row spreads over 26 programs (multilingual vocabulary) instead of one.
CHUNK = 2048
# What `_chunk_stats` leaves of each chunk for `_row_choice`, at these offsets: 0-2 the
# tokens below the timestamps (their maximum, sum of exp(x - maximum), first best token),
# 3-5 the same for the timestamps, 6-7 the raw logits' maximum and sum of exponentials
# (for the no-speech probability).
N_STATS = 8
# Bits of the static token flags: suppressed by the checkpoint, or blank at the first step.
SUPPRESSED, BLANK = 1, 2
_FACT = {name: i for i, name in enumerate(RuleFacts._fields)}


def available() -> bool:
    """Whether Triton is installed, so that a CUDA engine can use these kernels."""
    return triton is not None


if triton is not None:

    # Strides, row counts and the picked rows' offsets vary with the bucket: without
    # do_not_specialize, Triton would compile a variant per divisibility class.
    @triton.jit(do_not_specialize=["meta_stride", "carried_stride", "facts_stride", "rows"])
    def _feed(
        meta_ptr, meta_stride, picks_ptr, carried_ptr, carried_stride, tokens_ptr, facts_ptr, facts_stride,
        last_page_len_ptr, rows, timestamp_begin, META_TOKEN: tl.constexpr, META_POSITION: tl.constexpr,
        META_FOLLOWS: tl.constexpr, META_RULES: tl.constexpr, N_FACTS: tl.constexpr, AT_BEGIN: tl.constexpr,
        LAST_IS_TIMESTAMP: tl.constexpr, PENULTIMATE_IS_TIMESTAMP: tl.constexpr, LAST_TIMESTAMP: tl.constexpr,
        END_ALLOWED: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = i < rows
        # The new token sits at its position: the last page holds position % PAGE_SIZE + 1 keys.
        position = tl.load(meta_ptr + META_POSITION * meta_stride + i, mask=inside, other=0)
        tl.store(last_page_len_ptr + i, (position % PAGE_SIZE + 1).to(tl.int32), mask=inside)
        follows = tl.load(meta_ptr + META_FOLLOWS * meta_stride + i, mask=inside, other=-1)
        fed = follows >= 0
        at = tl.maximum(follows, 0)
        chosen = tl.load(picks_ptr + at, mask=inside, other=0)
        own = tl.load(meta_ptr + META_TOKEN * meta_stride + i, mask=inside, other=0)
        tl.store(tokens_ptr + i, tl.where(fed, chosen, own), mask=inside)
        stamp = (chosen >= timestamp_begin).to(tl.int64)
        was_begin = tl.load(carried_ptr + AT_BEGIN * carried_stride + at, mask=inside, other=0)
        was_stamp = tl.load(carried_ptr + LAST_IS_TIMESTAMP * carried_stride + at, mask=inside, other=0)
        for k in tl.static_range(N_FACTS):
            fact = tl.load(meta_ptr + (META_RULES + k) * meta_stride + i, mask=inside, other=0)
            if k == AT_BEGIN:
                moved = tl.zeros_like(fact)
            elif k == LAST_IS_TIMESTAMP:
                moved = stamp
            elif k == PENULTIMATE_IS_TIMESTAMP:
                moved = was_begin | was_stamp
            elif k == LAST_TIMESTAMP:
                before = tl.load(carried_ptr + k * carried_stride + at, mask=inside, other=0)
                moved = tl.where(stamp != 0, chosen, before)
            elif k == END_ALLOWED:
                moved = fact  # the host counts the row's tokens
            else:
                moved = tl.load(carried_ptr + k * carried_stride + at, mask=inside, other=0)
            tl.store(facts_ptr + k * facts_stride + i, tl.where(fed, moved, fact), mask=inside)

    @triton.jit
    def _fact(facts_ptr, facts_stride, row, k: tl.constexpr):
        return tl.load(facts_ptr + k * facts_stride + row)

    @triton.jit
    def _sum_exp(x, top):
        """sum(exp(x - top)) over x's finite entries; 0 when none is."""
        safe = tl.where(top == float("-inf"), 0.0, top)
        return tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - safe)), axis=0)

    @triton.jit
    def _first_max(x, index, top):
        """The lowest index where x equals its maximum `top` (as argmax breaks ties)."""
        return tl.min(tl.where(x == top, index, 2**30), axis=0)

    # The rules of `rules.DECODING_RULES`, each the twin of its PyTorch function there.
    # A masking rule takes the token classes' fields (`rules.TokenClasses`: [BLOCK]
    # vectors over a chunk of the vocabulary) and then the row's facts (`rules.RuleFacts`,
    # scalars), in their order, and returns the tokens it bars.

    @triton.jit
    def _blank_at_begin(ids, is_timestamp, is_text, is_no_timestamps, is_end, suppressed, blank,
                        at_begin, suppress_blank, timestamps, last_is, penultimate_is, last, max_initial, end_allowed):
        return (at_begin & suppress_blank) & blank

    @triton.jit
    def _suppressed_tokens(ids, is_timestamp, is_text, is_no_timestamps, is_end, suppressed, blank,
                           at_begin, suppress_blank, timestamps, last_is, penultimate_is, last, max_initial,
                           end_allowed):
        return suppressed

    @triton.jit
    def _end_before_min_new_tokens(ids, is_timestamp, is_text, is_no_timestamps, is_end, suppressed, blank,
                                   at_begin, suppress_blank, timestamps, last_is, penultimate_is, last, max_initial,
                                   end_allowed):
        return (~end_allowed) & is_end

    @triton.jit
    def _no_timestamps_token(ids, is_timestamp, is_text, is_no_timestamps, is_end, suppressed, blank,
                             at_begin, suppress_blank, timestamps, last_is, penultimate_is, last, max_initial,
                             end_allowed):
        return timestamps & is_no_timestamps

    @triton.jit
    def _text_after_a_timestamp_pair(ids, is_timestamp, is_text, is_no_timestamps, is_end, suppressed, blank,
                                     at_begin, suppress_blank, timestamps, last_is, penultimate_is, last, max_initial,
                                     end_allowed):
        return (timestamps & last_is & penultimate_is) & is_timestamp

    @triton.jit
    def _timestamp_or_end_after_a_lone_one(ids, is_timestamp, is_text, is_no_timestamps, is_end, suppressed, blank,
                                           at_begin, suppress_blank, timestamps, last_is, penultimate_is, last,
                                           max_initial, end_allowed):
        return (timestamps & last_is & (~penultimate_is)) & is_text

    @triton.jit
    def _timestamps_never_go_back(ids, is_timestamp, is_text, is_no_timestamps, is_end, suppressed, blank,
                                  at_begin, suppress_blank, timestamps, last_is, penultimate_is, last, max_initial,
                                  end_allowed):
        after_single = timestamps & last_is & (~penultimate_is)
        floor = tl.where(after_single, last, last + 1)
        return (timestamps & (last >= 0)) & is_timestamp & (ids < floor)

    @triton.jit
    def _first_a_timestamp_not_too_late(ids, is_timestamp, is_text, is_no_timestamps, is_end, suppressed, blank,
                                        at_begin, suppress_blank, timestamps, last_is, penultimate_is, last,
                                        max_initial, end_allowed):
        return (timestamps & at_begin) & ((~is_timestamp) | (ids > max_initial))

    @triton.jit
    def _masked(ids, is_timestamp, is_text, is_no_timestamps, is_end, suppressed, blank,
                at_begin, suppress_blank, timestamps, last_is, penultimate_is, last, max_initial, end_allowed):
        """The tokens the masking rules bar together, in `rules.DECODING_RULES`' order."""
        masked = ids < 0
        masked |= _blank_at_begin(ids, is_timestamp, is_text, is_no_timestamps, is_end, suppressed, blank, at_begin,
            suppress_blank, timestamps, last_is, penultimate_is, last, max_initial, end_allowed)
        masked |= _suppressed_tokens(ids, is_timestamp, is_text, is_no_timestamps, is_end, suppressed, blank,
            at_begin, suppress_blank, timestamps, last_is, penultimate_is, last, max_initial, end_allowed)
        masked |= _end_before_min_new_tokens(ids, is_timestamp, is_text, is_no_timestamps, is_end, suppressed,
            blank, at_begin, suppress_blank, timestamps, last_is, penultimate_is, last, max_initial, end_allowed)
        masked |= _no_timestamps_token(ids, is_timestamp, is_text, is_no_timestamps, is_end, suppressed, blank,
            at_begin, suppress_blank, timestamps, last_is, penultimate_is, last, max_initial, end_allowed)
        masked |= _text_after_a_timestamp_pair(ids, is_timestamp, is_text, is_no_timestamps, is_end, suppressed,
            blank, at_begin, suppress_blank, timestamps, last_is, penultimate_is, last, max_initial, end_allowed)
        masked |= _timestamp_or_end_after_a_lone_one(ids, is_timestamp, is_text, is_no_timestamps, is_end,
            suppressed, blank, at_begin, suppress_blank, timestamps, last_is, penultimate_is, last, max_initial,
            end_allowed)
        masked |= _timestamps_never_go_back(ids, is_timestamp, is_text, is_no_timestamps, is_end, suppressed, blank,
            at_begin, suppress_blank, timestamps, last_is, penultimate_is, last, max_initial, end_allowed)
        masked |= _first_a_timestamp_not_too_late(ids, is_timestamp, is_text, is_no_timestamps, is_end, suppressed,
            blank, at_begin, suppress_blank, timestamps, last_is, penultimate_is, last, max_initial, end_allowed)
        return masked

    @triton.jit
    def _force_a_timestamp(timestamp_mass, best_below, timestamps):
        """Whether a row must take a timestamp: the timestamps' summed log-probability
        against the likeliest token below them (text, <|endoftext|> or another special
        token: `rules.force_a_timestamp` compares with all)."""
        return timestamps & (timestamp_mass > best_below)

    @triton.jit(do_not_specialize=["facts_stride"])
    def _chunk_stats(
        raw_ptr, raw_stride, facts_ptr, facts_stride, flags_ptr, logits_ptr, logits_stride, stats_ptr,
        vocab, eot, no_timestamps, timestamp_begin, chunks,
        AT_BEGIN: tl.constexpr, SUPPRESS_BLANK: tl.constexpr, TIMESTAMPS: tl.constexpr,
        LAST_IS_TIMESTAMP: tl.constexpr, PENULTIMATE_IS_TIMESTAMP: tl.constexpr, LAST_TIMESTAMP: tl.constexpr,
        MAX_INITIAL: tl.constexpr, END_ALLOWED: tl.constexpr, SUPPRESSED_BIT: tl.constexpr, BLANK_BIT: tl.constexpr,
        N_STATS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        v = chunk * BLOCK + tl.arange(0, BLOCK)
        inside = v < vocab
        raw = tl.load(raw_ptr + row * raw_stride + v, mask=inside, other=float("-inf")).to(tl.float32)
        flags = tl.load(flags_ptr + v, mask=inside, other=0)
        at_begin = _fact(facts_ptr, facts_stride, row, AT_BEGIN) != 0
        suppress_blank = _fact(facts_ptr, facts_stride, row, SUPPRESS_BLANK) != 0
        stamps = _fact(facts_ptr, facts_stride, row, TIMESTAMPS) != 0
        last_is = _fact(facts_ptr, facts_stride, row, LAST_IS_TIMESTAMP) != 0
        penultimate = _fact(facts_ptr, facts_stride, row, PENULTIMATE_IS_TIMESTAMP) != 0
        last = _fact(facts_ptr, facts_stride, row, LAST_TIMESTAMP)
        max_initial = _fact(facts_ptr, facts_stride, row, MAX_INITIAL)
        end_allowed = _fact(facts_ptr, facts_stride, row, END_ALLOWED) != 0

        is_stamp = v >= timestamp_begin
        masked = _masked(
            v, is_stamp, v < eot, v == no_timestamps, v == eot, (flags & SUPPRESSED_BIT) != 0,
            (flags & BLANK_BIT) != 0, at_begin, suppress_blank, stamps, last_is, penultimate, last, max_initial,
            end_allowed,
        )
        x = tl.where(masked | (v >= vocab), float("-inf"), raw)
        tl.store(logits_ptr + row * logits_stride + v, x, mask=inside)

        below = tl.where(is_stamp, float("-inf"), x)
        stamp = tl.where(is_stamp, x, float("-inf"))
        below_max = tl.max(below, axis=0)
        stamp_max = tl.max(stamp, axis=0)
        raw_max = tl.max(raw, axis=0)
        out = stats_ptr + (row * chunks + chunk) * N_STATS
        tl.store(out + 0, below_max)
        tl.store(out + 1, _sum_exp(below, below_max))
        tl.store(out + 2, _first_max(below, v, below_max).to(tl.float32))
        tl.store(out + 3, stamp_max)
        tl.store(out + 4, _sum_exp(stamp, stamp_max))
        tl.store(out + 5, _first_max(stamp, v, stamp_max).to(tl.float32))
        tl.store(out + 6, raw_max)
        tl.store(out + 7, _sum_exp(raw, raw_max))

    @triton.jit
    def _merged(stats_ptr, c, inside, top_at: tl.constexpr, sum_at: tl.constexpr, N_STATS: tl.constexpr):
        """(max, sum of exp(x - max)) over a row's chunks, from each chunk's pair."""
        tops = tl.load(stats_ptr + c * N_STATS + top_at, mask=inside, other=float("-inf"))
        sums = tl.load(stats_ptr + c * N_STATS + sum_at, mask=inside, other=0.0)
        top = tl.max(tops, axis=0)
        return top, _sum_exp_weighted(tops, sums, top)

    @triton.jit
    def _merged_best(
        stats_ptr, c, inside, top_at: tl.constexpr, sum_at: tl.constexpr, arg_at: tl.constexpr, N_STATS: tl.constexpr
    ):
        """`_merged`, and the first token at the maximum: of the chunks that reach it, the
        first chunk's own first (chunks are in token order)."""
        tops = tl.load(stats_ptr + c * N_STATS + top_at, mask=inside, other=float("-inf"))
        sums = tl.load(stats_ptr + c * N_STATS + sum_at, mask=inside, other=0.0)
        args = tl.load(stats_ptr + c * N_STATS + arg_at, mask=inside, other=0.0)
        top = tl.max(tops, axis=0)
        first = tl.min(tl.where(inside & (tops == top), args, 2.0**30), axis=0)
        return top, _sum_exp_weighted(tops, sums, top), first

    @triton.jit
    def _sum_exp_weighted(tops, sums, top):
        safe = tl.where(top == float("-inf"), 0.0, top)
        return tl.sum(tl.where(tops == float("-inf"), 0.0, sums * tl.exp(tops - safe)), axis=0)

    @triton.jit(do_not_specialize=["facts_stride", "token_value_ptr", "logprob_ptr", "no_speech_ptr"])
    def _row_choice(
        stats_ptr, raw_ptr, raw_stride, facts_ptr, facts_stride, chunks, no_speech_token,
        picks_ptr, token_value_ptr, logprob_ptr, no_speech_ptr, forced_ptr,
        TIMESTAMPS: tl.constexpr, N_STATS: tl.constexpr, BLOCK_CHUNKS: tl.constexpr,
    ):
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK_CHUNKS)
        inside = c < chunks
        stats = stats_ptr + row * chunks * N_STATS
        below_max, below_sum, below_arg = _merged_best(stats, c, inside, 0, 1, 2, N_STATS)
        stamp_max, stamp_sum, stamp_arg = _merged_best(stats, c, inside, 3, 4, 5, N_STATS)
        raw_max, raw_sum = _merged(stats, c, inside, 6, 7, N_STATS)

        # log_softmax(x) = x - top - log(total), over the masked row.
        top = tl.maximum(below_max, stamp_max)
        safe = tl.where(top == float("-inf"), 0.0, top)
        below_part = tl.where(below_max == float("-inf"), 0.0, below_sum * tl.exp(below_max - safe))
        stamp_part = tl.where(stamp_max == float("-inf"), 0.0, stamp_sum * tl.exp(stamp_max - safe))
        log_total = tl.log(below_part + stamp_part)
        # In log space, as `rules.force_a_timestamp` computes them.
        timestamp_mass = (stamp_max - top) + tl.log(stamp_sum) - log_total
        best_below = (below_max - top) - log_total
        forced = _force_a_timestamp(timestamp_mass, best_below, _fact(facts_ptr, facts_stride, row, TIMESTAMPS) != 0)
        # Forced: the likeliest timestamp, its log-probability among the timestamps alone.
        take_stamp = forced | (stamp_max > below_max)
        token = tl.where(take_stamp, stamp_arg, below_arg)
        logprob = tl.where(
            forced,
            (stamp_max - stamp_max) - tl.log(stamp_sum),
            (tl.where(take_stamp, stamp_max, below_max) - top) - log_total,
        )
        raw_no_speech = tl.load(raw_ptr + row * raw_stride + no_speech_token).to(tl.float32)
        tl.store(picks_ptr + row, token.to(tl.int64))
        tl.store(token_value_ptr + row, token)
        tl.store(logprob_ptr + row, logprob)
        tl.store(no_speech_ptr + row, tl.exp(raw_no_speech - raw_max) / raw_sum)
        tl.store(forced_ptr + row, forced.to(tl.int32))

    @triton.jit
    def _forced_text_mask(logits_ptr, logits_stride, forced_ptr, timestamp_begin, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        if tl.load(forced_ptr + row) != 0:
            tl.store(logits_ptr + row * logits_stride + v, float("-inf"), mask=v < timestamp_begin)


class StepKernels:
    """The fused tail of a decode step for one checkpoint's vocabulary, on one device."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        if triton is None:
            raise RuntimeError("the fused step kernels need Triton (the triton package)")
        special = config.special
        self.vocab = config.dims.n_vocab
        self.eot = special.eot
        self.no_timestamps = special.no_timestamps
        self.no_speech = special.nospeech
        self.timestamp_begin = special.timestamp_begin
        self.chunks = triton.cdiv(self.vocab, CHUNK)
        flags = torch.zeros(self.vocab, dtype=torch.int8)
        flags[list(config.suppress_tokens)] |= SUPPRESSED
        flags[list(config.begin_suppress_tokens)] |= BLANK
        self.flags = flags.to(device)

    def feed(
        self, meta: torch.Tensor, picks: torch.Tensor, carried: torch.Tensor, *, last_page_len: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """On the device: a step's tokens [b] and rule facts [N_RULE_FACTS, b] from its
        metadata [N_META, b] and the step before's `picks` and `carried` facts, as
        `overlap.fed_inputs` computes them; and into `last_page_len` [b] int32, the keys
        in each row's last self-attention page (FlashInfer's buffer), from the row's position."""
        rows = meta.shape[1]
        tokens = torch.empty(rows, dtype=torch.long, device=meta.device)
        facts = torch.empty(N_RULE_FACTS, rows, dtype=torch.long, device=meta.device)
        block = max(16, triton.next_power_of_2(rows))
        _feed[(triton.cdiv(rows, block),)](
            meta, meta.stride(0), picks, carried, carried.stride(0), tokens, facts, facts.stride(0), last_page_len,
            rows, self.timestamp_begin, META_TOKEN=META_TOKEN, META_POSITION=META_POSITION,
            META_FOLLOWS=META_FOLLOWS, META_RULES=META_RULES, N_FACTS=N_RULE_FACTS, AT_BEGIN=_FACT["at_begin"],
            LAST_IS_TIMESTAMP=_FACT["last_is_timestamp"], PENULTIMATE_IS_TIMESTAMP=_FACT["penultimate_is_timestamp"],
            LAST_TIMESTAMP=_FACT["last_timestamp"], END_ALLOWED=_FACT["end_allowed"], PAGE_SIZE=PAGE_SIZE,
            BLOCK=block,
        )
        return tokens, facts

    def choose(
        self,
        raw: torch.Tensor,
        facts: torch.Tensor,
        *,
        logits: torch.Tensor,
        picks: torch.Tensor,
        token_values: torch.Tensor,
        logprobs: torch.Tensor,
        no_speech: torch.Tensor,
    ) -> None:
        """raw logits [b, vocab] (any float dtype), facts [N_RULE_FACTS, b] integers ->
        written in place: the filtered logits [b, vocab] float32, each row's greedy token
        (`picks` [b] long, and `token_values` [b] float32), its log-probability under the
        filtered logits, and the no-speech probability of its raw logits ([b] float32 each)."""
        rows = raw.shape[0]
        assert raw.shape[1] == self.vocab and logits.stride(1) == 1 and raw.stride(1) == 1
        stats = torch.empty(rows, self.chunks, N_STATS, dtype=torch.float32, device=raw.device)
        forced = torch.empty(rows, dtype=torch.int32, device=raw.device)
        _chunk_stats[(rows, self.chunks)](
            raw, raw.stride(0), facts, facts.stride(0), self.flags, logits, logits.stride(0), stats,
            self.vocab, self.eot, self.no_timestamps, self.timestamp_begin, self.chunks,
            **{name.upper(): index for name, index in _FACT.items()}, SUPPRESSED_BIT=SUPPRESSED, BLANK_BIT=BLANK,
            N_STATS=N_STATS, BLOCK=CHUNK, num_warps=4,
        )
        _row_choice[(rows,)](
            stats, raw, raw.stride(0), facts, facts.stride(0), self.chunks, self.no_speech,
            picks, token_values, logprobs, no_speech, forced,
            TIMESTAMPS=_FACT["timestamps"], N_STATS=N_STATS,
            BLOCK_CHUNKS=triton.next_power_of_2(self.chunks), num_warps=1,
        )
        _forced_text_mask[(rows, triton.cdiv(self.timestamp_begin, CHUNK))](
            logits, logits.stride(0), forced, self.timestamp_begin, BLOCK=CHUNK, num_warps=4,
        )
