"""Graph steps planned while the step before them runs on the GPU.

A graph step is host work (which rows, their tokens and rule facts, FlashInfer's
page tables) followed by GPU work. Done one after the other, the GPU waits for
the host at every step: about a third of a step of 256 rows of tiny. Here
`DecodeBatch` plans step t+1 while step t runs and launches it at once, before
t's picks are known: the device feeds each row the token it chose at t
(`fed_inputs`). Then the host waits for t's picks and handles them (new tokens,
finished rows, callbacks) while t+1 runs, so the GPU goes from one step to the
next without waiting for the host.

What that asks of each row, relative to the step t in flight:
- A row that chooses a token at t feeds it at t+1: it *follows*. Its position,
  cache slot and page tables are known in advance; its token, and the two rule
  facts that depend on it (whether it is a timestamp, and which), are read on
  the device from t's picks. The host learns them with t's picks (`Launched.settle`).
- A row that reaches its token limit at t is done then, and skips t+1. A row
  that ends with <|endoftext|> at t has already been launched into t+1: that
  step's work for it is discarded (its slot may be given to a new request at
  once; both run on one stream, so the new request's writes come after).
- A row that detects its language at t does not know its next tokens (its
  language and task) before t's results are read: it skips t+1.
- A row feeding its prompt feeds the next prompt token.
- A beam (`engine.beams`) skips t+1: its next token is known once every beam's
  picks at t are ranked on the host.
So a row's tokens come from the same kernels on the same inputs as in a step
planned after the one before it: the results are those of the synchronous path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from python_backend_lib.engine.graph_io import META_FOLLOWS, META_RULES, META_TOKEN, GraphStep, PendingStep, StepInputs
from python_backend_lib.engine.rows import END_ALLOWED, LAST_IS_TIMESTAMP, LAST_TIMESTAMP, Row, RowState, follow_facts
from python_backend_lib.engine.rules import N_RULE_FACTS, RuleFacts


@dataclass(eq=False)
class Part:
    """One row's part in a graph step.

    follows: the index in the step before of the row whose pick it feeds (itself
        there); None when it feeds a token the host knows (`Row.pending[0]`).
    chooses: this step's pick is the row's next token (else it feeds its prompt).
    at_start: it feeds <|startoftranscript|>: the no-speech probability and the
        language are read from this step.
    """

    row: Row
    follows: int | None
    chooses: bool
    at_start: bool


@dataclass
class Launched:
    """A launched graph step: its rows' parts, the tokens and facts it ran with
    (those of following rows once `settle`d), and its picks to come."""

    parts: list[Part]
    tokens: np.ndarray  # [n]
    facts: np.ndarray  # [N_RULE_FACTS, n]
    pending: PendingStep

    def result(self) -> GraphStep:
        return self.pending.result()

    def settle(self, previous: Launched, picked: GraphStep, timestamp_begin: int) -> None:
        """Write in the tokens the following rows were fed on the device, `previous`'s
        picks, with the facts those tokens changed: what the step ran with."""
        columns = [j for j, part in enumerate(self.parts) if part.follows is not None]
        if not columns:
            return
        sources = [self.parts[j].follows for j in columns]
        chosen = np.array([picked.tokens[i] for i in sources], dtype=np.int64)
        after = follow_facts(previous.facts[:, sources], chosen, timestamp_begin)
        after[END_ALLOWED] = self.facts[END_ALLOWED, columns]  # counted when planned
        self.tokens[columns] = chosen
        self.facts[:, columns] = after

    def states_before(self) -> dict[Row, RowState]:
        """Each of its rows as if this step had not been launched (`mark_launched` undone):
        what a rewind restores. Read once the step before it was handled and settled, and
        before its own picks are (the engine's checkpoint before its next step): in between
        nothing changes a row, so the state is made only when asked for, not every step."""
        states = {}
        for part, token in zip(self.parts, self.tokens.tolist()):
            row = part.row
            pending = row.pending if part.follows is None else []
            states[row] = RowState.of(row, [token, *pending], row.cached - 1)
        return states


@dataclass
class Plan:
    """The next graph step's rows, and the rows that need an eager pass first
    (a prompt longer than the graphs feed one token a step)."""

    parts: list[Part]
    inputs: StepInputs
    eager: list[Row]


def detects_language(row: Row) -> bool:
    return row.prompt.detect_language and row.language is None


def plan_step(rows: Sequence[Row], previous: Launched | None, graph_prompt_tokens: int, timestamp_begin: int) -> Plan:
    """The parts of the step after `previous` (None: nothing in flight), for the rows in
    `rows` that can take part in it, in their order."""
    in_flight = {part.row: (i, part) for i, part in enumerate(previous.parts)} if previous else {}
    parts: list[Part] = []
    eager: list[Row] = []
    tokens, positions, slots, temperatures, follows_at, keys = [], [], [], [], [], []
    host_facts: list[RuleFacts] = []  # of the rows fed a token the host knows, in order
    end_allowed: list[bool] = []  # of the rows that follow, in order
    for row in rows:
        index, part = in_flight.get(row, (None, None))
        if part is not None and part.chooses:
            if row.group is not None and row.group.lockstep:
                continue  # a beam's next token depends on every beam's picks there (`engine.beams`)
            if len(row.generated) + 1 >= row.max_new_tokens:
                continue  # done at the step in flight
            follows, token = index, -1  # the token comes at launch
            end_allowed.append(len(row.generated) + 1 >= row.options.min_new_tokens)
        elif part is not None and part.at_start and detects_language(row):
            continue  # its next tokens depend on the language it detects there
        elif not row.pending:
            continue
        elif part is None and len(row.pending) > graph_prompt_tokens:
            eager.append(row)
            continue
        else:
            follows, token = None, row.pending[0]
            host_facts.append(row.rule_facts(timestamp_begin))
        at_start = row.cached == row.prompt.sot_index
        chooses = follows is not None or (len(row.pending) == 1 and not (at_start and detects_language(row)))
        parts.append(Part(row, follows, chooses, at_start))
        tokens.append(token)
        positions.append(row.cached)
        slots.append(row.slot)
        temperature = row.options.temperature if chooses else 0.0
        temperatures.append(temperature)
        # Only a draw at a temperature reads its key; a follower's pick is not appended yet.
        keys.append(row.draw_key(ahead=1 if follows is not None else 0) if temperature > 0 else 0)
        follows_at.append(-1 if follows is None else follows)
    follows_at = np.array(follows_at, dtype=np.int64)
    table = np.empty((N_RULE_FACTS, len(parts)), dtype=np.int64)
    following = np.flatnonzero(follows_at >= 0)
    if len(following):  # as if each pick were no timestamp; the device corrects it (`fed_inputs`)
        before = previous.facts[:, follows_at[following]]
        table[:, following] = follow_facts(before, np.full(len(following), -1), timestamp_begin)
        table[END_ALLOWED, following] = end_allowed
    if host_facts:
        table[:, follows_at < 0] = np.array(host_facts, dtype=np.int64).T
    inputs = StepInputs(
        slots=np.array(slots, dtype=np.int64),
        tokens=np.array(tokens, dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        facts=table,
        temperatures=np.array(temperatures, dtype=np.float64),
        follows=follows_at,
        draw_keys=np.array(keys, dtype=np.int64),
    )
    return Plan(parts, inputs, eager)


def fed_inputs(meta: torch.Tensor, picks: torch.Tensor, timestamp_begin: int) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device: a step's tokens [b] and rule facts [N_RULE_FACTS, b] (`RuleFacts`
    field order) from its metadata [N_META, b], where each row that follows
    (META_FOLLOWS) feeds the token its row picked at the step before (`picks`, by that
    step's row order) and, if that token is a timestamp, has it as its last (the host
    wrote the other facts: `plan_step`). `step_kernels.StepKernels.feed` is the same
    in one kernel."""
    follows = meta[META_FOLLOWS]
    fed = follows >= 0
    chosen = picks.index_select(0, follows.clamp(min=0))
    tokens = torch.where(fed, chosen, meta[META_TOKEN])
    stamp = fed & (chosen >= timestamp_begin)
    facts = meta[META_RULES:].clone()
    facts[LAST_IS_TIMESTAMP] |= stamp
    facts[LAST_TIMESTAMP] = torch.where(stamp, chosen, facts[LAST_TIMESTAMP])
    return tokens, facts


def mark_launched(parts: Sequence[Part]) -> None:
    """Each row of a launched step has one more token in its cache; a row that fed a
    host token has it no longer pending."""
    for part in parts:
        row = part.row
        row.cached += 1
        if part.follows is None:
            row.pending = row.pending[1:]
