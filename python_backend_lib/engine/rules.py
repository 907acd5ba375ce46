"""Whisper's logit rules over a whole batch at once, and the choice of the next token.

Each rule is a masked fill over [rows, vocab] driven by per-row facts
(`RuleFacts`), so rows with different options need one pass and no host round
trip per rule; a CUDA graph reads the same facts from a fixed [N_RULE_FACTS, rows]
buffer. `sample` picks each row's token, greedy or at its temperature, for the
eager and the graph paths alike.
"""

from __future__ import annotations

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


class LogitRules:
    """Whisper's logit filters, in openai-whisper's order: blank suppression at
    the first step, the checkpoint's suppressed tokens, then the timestamp rules."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        special = config.special
        vocab = torch.arange(config.dims.n_vocab, device=device)
        self.timestamp_begin = special.timestamp_begin
        self._vocab = vocab
        self._is_timestamp = vocab >= special.timestamp_begin
        self._is_text = vocab < special.eot
        self._is_no_timestamps = vocab == special.no_timestamps
        self._is_end = vocab == special.eot
        self._suppress = torch.zeros_like(vocab, dtype=torch.bool)
        self._suppress[list(config.suppress_tokens)] = True
        self._blank = torch.zeros_like(vocab, dtype=torch.bool)
        self._blank[list(config.begin_suppress_tokens)] = True

    def apply(self, logits: torch.Tensor, rows: RuleFacts) -> torch.Tensor:
        """logits [B, vocab] -> filtered logits [B, vocab] (a new tensor); `rows` holds [B] tensors."""

        def col(flags: torch.Tensor) -> torch.Tensor:  # [B] -> [B, 1], to broadcast over the vocabulary
            return flags[:, None]

        mask = col(rows.at_begin & rows.suppress_blank) & self._blank
        mask = mask | self._suppress
        mask |= col(~rows.end_allowed) & self._is_end

        stamps = rows.timestamps
        # <|notimestamps|> is for the prompt only.
        mask |= col(stamps) & self._is_no_timestamps
        # Timestamps come in pairs: after a pair, text must follow ...
        after_pair = stamps & rows.last_is_timestamp & rows.penultimate_is_timestamp
        mask |= col(after_pair) & self._is_timestamp
        # ... and after a lone timestamp, another timestamp or the end.
        after_single = stamps & rows.last_is_timestamp & ~rows.penultimate_is_timestamp
        mask |= col(after_single) & self._is_text
        # Timestamps never go back; a new segment may not start where the last
        # one started, or decoding could loop on zero-length segments.
        floor = torch.where(after_single, rows.last_timestamp, rows.last_timestamp + 1)
        has_timestamp = stamps & (rows.last_timestamp >= 0)
        mask |= col(has_timestamp) & self._is_timestamp & (self._vocab[None, :] < col(floor))
        # The first token is a timestamp, and not too late in the window.
        first = stamps & rows.at_begin
        mask |= col(first) & (~self._is_timestamp | (self._vocab[None, :] > col(rows.max_initial)))
        logits = logits.masked_fill(mask, NEG_INF)

        # When timestamps together are likelier than any single text token, emit one.
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        begin = self.timestamp_begin
        timestamp_mass = logprobs[:, begin:].logsumexp(dim=-1)
        best_text = logprobs[:, :begin].max(dim=-1).values
        force = stamps & (timestamp_mass > best_text)
        return logits.masked_fill(col(force) & ~self._is_timestamp, NEG_INF)


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
