"""Whisper's logit rules over a whole batch at once, and the choice of the next token.

`DECODING_RULES` is the one list of the rules: each names its PyTorch function here
and its twin in the fused step kernels (`engine.step_kernels`). Each rule is a mask
over [rows, vocab] driven by per-row facts (`RuleFacts`), so rows with different
options need one pass and no host round trip per rule; a CUDA graph reads the same
facts from a fixed [N_RULE_FACTS, rows] buffer. `sample` picks each row's token,
greedy or at its temperature, for the eager and the graph paths alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from python_backend_lib.core.model_facts import ModelConfig
from python_backend_lib.engine import draws

NEG_INF = float("-inf")
TINY = torch.finfo(torch.float32).tiny  # the smallest exponential noise (`sample`)


class RuleFacts(NamedTuple):
    """What the rules need to know about a row before its next token.

    One value per row: plain ints and bools for one row on the host
    (`rows.Row.rule_facts`), or [rows] device tensors (`from_table`).
    """

    at_begin: bool  # no token generated yet
    suppress_blank: bool
    timestamps: bool
    last_is_timestamp: bool
    penultimate_is_timestamp: bool  # also true when fewer than two tokens exist
    last_timestamp: int  # id of the last timestamp token, or -1
    max_initial: int  # last allowed first-timestamp id
    end_allowed: bool  # min_new_tokens reached

    @classmethod
    def from_table(cls, table: torch.Tensor) -> RuleFacts:
        """table: [N_RULE_FACTS, rows] long, one row per field in field order."""
        return cls(*(column if name in _INTEGER_FACTS else column.bool() for name, column in zip(cls._fields, table)))


N_RULE_FACTS = len(RuleFacts._fields)
_INTEGER_FACTS = ("last_timestamp", "max_initial")


class TokenClasses(NamedTuple):
    """[vocab] tensors: each token's id, and the classes of token the rules test."""

    ids: torch.Tensor  # long
    is_timestamp: torch.Tensor
    is_text: torch.Tensor  # below <|endoftext|>
    is_no_timestamps: torch.Tensor
    is_end: torch.Tensor
    suppressed: torch.Tensor  # the checkpoint's suppressed tokens
    blank: torch.Tensor  # suppressed at the first step (`suppress_blank`)

    @classmethod
    def of(cls, config: ModelConfig, device: torch.device) -> TokenClasses:
        special = config.special
        ids = torch.arange(config.dims.n_vocab, device=device)
        suppressed = torch.zeros_like(ids, dtype=torch.bool)
        suppressed[list(config.suppress_tokens)] = True
        blank = torch.zeros_like(ids, dtype=torch.bool)
        blank[list(config.begin_suppress_tokens)] = True
        return cls(ids, ids >= special.timestamp_begin, ids < special.eot, ids == special.no_timestamps,
                   ids == special.eot, suppressed, blank)


# The masking rules, each [B] row facts -> [B, vocab] (or broadcastable) tokens barred.
# Each has its twin in `engine.step_kernels` (`DECODING_RULES` pairs them).


def _col(flags: torch.Tensor) -> torch.Tensor:  # [B] -> [B, 1], to broadcast over the vocabulary
    return flags[:, None]


def blank_at_begin(tokens: TokenClasses, rows: RuleFacts) -> torch.Tensor:
    return _col(rows.at_begin & rows.suppress_blank) & tokens.blank


def suppressed_tokens(tokens: TokenClasses, rows: RuleFacts) -> torch.Tensor:
    return tokens.suppressed[None, :]


def end_before_min_new_tokens(tokens: TokenClasses, rows: RuleFacts) -> torch.Tensor:
    return _col(~rows.end_allowed) & tokens.is_end


def no_timestamps_token(tokens: TokenClasses, rows: RuleFacts) -> torch.Tensor:
    """<|notimestamps|> is for the prompt only."""
    return _col(rows.timestamps) & tokens.is_no_timestamps


def text_after_a_timestamp_pair(tokens: TokenClasses, rows: RuleFacts) -> torch.Tensor:
    """Timestamps come in pairs: after a pair, text must follow."""
    after_pair = rows.timestamps & rows.last_is_timestamp & rows.penultimate_is_timestamp
    return _col(after_pair) & tokens.is_timestamp


def timestamp_or_end_after_a_lone_one(tokens: TokenClasses, rows: RuleFacts) -> torch.Tensor:
    """After a lone timestamp, another timestamp or the end."""
    after_single = rows.timestamps & rows.last_is_timestamp & ~rows.penultimate_is_timestamp
    return _col(after_single) & tokens.is_text


def timestamps_never_go_back(tokens: TokenClasses, rows: RuleFacts) -> torch.Tensor:
    """A new segment may not start where the last one started either, or decoding
    could loop on zero-length segments."""
    after_single = rows.timestamps & rows.last_is_timestamp & ~rows.penultimate_is_timestamp
    floor = torch.where(after_single, rows.last_timestamp, rows.last_timestamp + 1)
    has_timestamp = rows.timestamps & (rows.last_timestamp >= 0)
    return _col(has_timestamp) & tokens.is_timestamp & (tokens.ids[None, :] < _col(floor))


def first_a_timestamp_not_too_late(tokens: TokenClasses, rows: RuleFacts) -> torch.Tensor:
    first = rows.timestamps & rows.at_begin
    return _col(first) & (~tokens.is_timestamp | (tokens.ids[None, :] > _col(rows.max_initial)))


def force_a_timestamp(filtered: torch.Tensor, rows: RuleFacts, timestamp_begin: int) -> torch.Tensor:
    """[B] rows that must take a timestamp: those whose timestamps together are likelier
    than any single token below them, under the masked logits."""
    logprobs = torch.log_softmax(filtered.float(), dim=-1)
    timestamp_mass = logprobs[:, timestamp_begin:].logsumexp(dim=-1)
    best_below = logprobs[:, :timestamp_begin].max(dim=-1).values
    return rows.timestamps & (timestamp_mass > best_below)


class DecodingRule(NamedTuple):
    """One of Whisper's logit rules: its PyTorch function here and its kernel's function
    in `engine.step_kernels`, which must agree (tests/unit/test_rule_table.py, per rule)."""

    name: str
    torch: Callable
    kernel: str  # the Triton function's name in engine.step_kernels
    masks: bool  # a token mask over the raw logits; False: a choice over the masked ones


# Whisper's logit rules, in openai-whisper's order: blank suppression at the first
# step, the checkpoint's suppressed tokens, then the timestamp rules. The masks are
# applied together; the forced timestamp reads the masked logits.
DECODING_RULES = (
    DecodingRule("blank at the first step", blank_at_begin, "_blank_at_begin", True),
    DecodingRule("the checkpoint's suppressed tokens", suppressed_tokens, "_suppressed_tokens", True),
    DecodingRule("no end before min_new_tokens", end_before_min_new_tokens, "_end_before_min_new_tokens", True),
    DecodingRule("no <|notimestamps|> with timestamps", no_timestamps_token, "_no_timestamps_token", True),
    DecodingRule("text after a timestamp pair", text_after_a_timestamp_pair, "_text_after_a_timestamp_pair", True),
    DecodingRule("a timestamp or the end after a lone one", timestamp_or_end_after_a_lone_one,
                 "_timestamp_or_end_after_a_lone_one", True),
    DecodingRule("timestamps never go back", timestamps_never_go_back, "_timestamps_never_go_back", True),
    DecodingRule("first a timestamp, not too late", first_a_timestamp_not_too_late,
                 "_first_a_timestamp_not_too_late", True),
    DecodingRule("a timestamp when they outweigh every token", force_a_timestamp, "_force_a_timestamp", False),
)
MASKING_RULES = tuple(rule for rule in DECODING_RULES if rule.masks)
CHOOSING_RULES = tuple(rule for rule in DECODING_RULES if not rule.masks)


class LogitRules:
    """Whisper's logit filters (`DECODING_RULES`) over a batch of rows."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.timestamp_begin = config.special.timestamp_begin
        self.tokens = TokenClasses.of(config, device)

    def apply(self, logits: torch.Tensor, rows: RuleFacts) -> torch.Tensor:
        """logits [B, vocab] -> filtered logits [B, vocab] (a new tensor); `rows` holds [B] tensors."""
        mask = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        for rule in MASKING_RULES:
            mask |= rule.torch(self.tokens, rows)
        logits = logits.masked_fill(mask, NEG_INF)
        for rule in CHOOSING_RULES:
            force = rule.torch(logits, rows, self.timestamp_begin)
            logits = logits.masked_fill(_col(force) & ~self.tokens.is_timestamp, NEG_INF)
        return logits


def sample(logits: torch.Tensor, temperatures: torch.Tensor | None = None,
           keys: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Filtered logits [B, vocab] -> each row's token [B] and its log-probability [B].

    temperatures: [B]; a row at 0 (or all rows, when None) takes the likeliest
    token, a row above 0 draws from softmax(logits / t), from the noise of its
    key (keys: [B] int64, `draws.draw_key`): the same key draws the same token from
    the same logits. The log-probability is under the filtered logits at
    temperature 1, as openai-whisper reports it.
    """
    chosen = logits.argmax(dim=-1)
    if temperatures is not None:
        if keys is None:
            raise ValueError("a draw at a temperature needs each row's key")
        probabilities = (logits.float() / temperatures.clamp(min=1e-6)[:, None]).softmax(dim=-1)
        # An exponential race draws as torch.multinomial does (token i wins with its probability),
        # from noise the key fixes, and a row with no finite distribution (every token masked, or
        # an overflow) cannot trip multinomial's device-side assert, which ends the process's
        # CUDA context: such a row takes its likeliest token.
        exponential = (-draws.uniform(keys, logits.shape[-1]).log()).float().clamp_(min=TINY)
        race = probabilities / exponential
        sound = probabilities.isfinite().all(dim=-1)
        drawn = torch.where(sound, race.argmax(dim=-1), chosen)
        chosen = torch.where(temperatures > 0, drawn, chosen)
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, chosen[:, None]).squeeze(1)
    return chosen, logprobs
