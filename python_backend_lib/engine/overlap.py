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
  cache slot and page tables are known in advance; its token, and the rule facts
  that depend on it, are made on the device from t's picks and the facts t ran
  with, which every step leaves on the device (`fed_inputs`); the host writes only
  whether it may end (`end_allowed`, a count of its tokens). The host learns the
  token with t's picks (`Launched.settle`).
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

Runs. For a few rows the host's work for a step takes longer than the GPU's, so
even overlapped the GPU waits for the host at every token. When every row of the
next step follows and may go on for `steps` tokens without the host (no prompt
token, no draw at a temperature, no beam or sample group, no ending forbidden yet,
its token limit not reached, no new self-attention page), the step is a *run*:
`steps` decode steps captured in one graph (`cuda_graphs`), each fed the picks and
facts of the one before on the device, as a following row is. The host plans,
launches and handles the run once and then takes each row's tokens in order, as if
they came from `steps` steps; a row that ends inside the run leaves there, and what
the run computed for it after that is discarded, as for a row launched into the
step after its last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from python_backend_lib.engine.graph_io import META_FOLLOWS, META_RULES, META_TOKEN, GraphStep, PendingStep, StepInputs
from python_backend_lib.engine.kv_cache import PAGE_SIZE
from python_backend_lib.engine.rows import (
    AT_BEGIN,
    END_ALLOWED,
    LAST_IS_TIMESTAMP,
    LAST_TIMESTAMP,
    PENULTIMATE_IS_TIMESTAMP,
    Row,
    RowState,
)
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
    """A launched graph step (or run of `steps`): its rows' parts, the tokens its
    first step fed (those of following rows once `settle`d), and its picks to come."""

    parts: list[Part]
    tokens: np.ndarray  # [n]
    pending: PendingStep
    steps: int = 1

    def results(self) -> list[GraphStep]:
        """Each of its steps' picks, in order (waits for the launch)."""
        return self.pending.results()

    def settle(self, picked: GraphStep) -> None:
        """Write in the tokens the following rows were fed on the device: the picks of
        the last step of the launch before (`picked`)."""
        for j, part in enumerate(self.parts):
            if part.follows is not None:
                self.tokens[j] = picked.tokens[part.follows]

    def states_before(self) -> dict[Row, RowState]:
        """Each of its rows as if this launch had not happened (`mark_launched` undone):
        what a rewind restores. Read once the launch before it was handled and settled, and
        before its own picks are (the engine's checkpoint before its next step): in between
        nothing changes a row, so the state is made only when asked for, not every step."""
        states = {}
        for part, token in zip(self.parts, self.tokens.tolist()):
            row = part.row
            pending = row.pending if part.follows is None else []
            states[row] = RowState.of(row, [token, *pending], row.cached - self.steps)
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


def plan_step(
    rows: Sequence[Row],
    previous: Launched | None,
    graph_prompt_tokens: int,
    timestamp_begin: int,
    run_steps: int = 1,
) -> Plan:
    """The parts of the step after `previous` (None: nothing in flight), for the rows in
    `rows` that can take part in it, in their order. run_steps: above 1, the step is a
    run of that many steps where every row may take part in one (see the module's doc)."""
    in_flight = {part.row: (i, part) for i, part in enumerate(previous.parts)} if previous else {}
    ahead = previous.steps if previous else 0  # tokens each row chooses in the launch in flight
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
            if len(row.generated) + ahead >= row.max_new_tokens:
                continue  # done in the launch in flight
            follows, token = index, -1  # the token comes at launch
            end_allowed.append(len(row.generated) + ahead >= row.options.min_new_tokens)
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
        # Only a draw at a temperature reads its key; a follower's picks are not appended yet.
        keys.append(row.draw_key(ahead=ahead if follows is not None else 0) if temperature > 0 else 0)
        follows_at.append(-1 if follows is None else follows)
    follows_at = np.array(follows_at, dtype=np.int64)
    # A following row's facts come from the device (`fed_inputs`) but whether it may end.
    table = np.zeros((N_RULE_FACTS, len(parts)), dtype=np.int64)
    table[END_ALLOWED, follows_at >= 0] = end_allowed
    if host_facts:
        table[:, follows_at < 0] = np.array(host_facts, dtype=np.int64).T
    steps = run_steps if run_steps > 1 and not eager and _may_run(parts, end_allowed, ahead, run_steps) else 1
    inputs = StepInputs(
        slots=np.array(slots, dtype=np.int64),
        tokens=np.array(tokens, dtype=np.int64),
        positions=np.array(positions, dtype=np.int64),
        facts=table,
        temperatures=np.array(temperatures, dtype=np.float64),
        follows=follows_at,
        draw_keys=np.array(keys, dtype=np.int64),
        steps=steps,
    )
    return Plan(parts, inputs, eager)


def _may_run(parts: Sequence[Part], end_allowed: Sequence[bool], ahead: int, steps: int) -> bool:
    """Whether every row can take its next `steps` tokens without the host: each follows
    (so it chooses, and feeds no prompt), may end already, draws nothing, belongs to no
    group, has room for them all (`ahead`: tokens it chooses in the launch in flight),
    and writes them within one self-attention page, so that FlashInfer's tables planned
    for the run's first step serve every step of it (`cuda_graphs`)."""
    if not parts or len(end_allowed) < len(parts) or not all(end_allowed):
        return False
    for part in parts:
        row = part.row
        if part.follows is None or row.group is not None or row.options.temperature > 0:
            return False
        if len(row.generated) + ahead + steps > row.max_new_tokens:
            return False
        if row.cached // PAGE_SIZE != (row.cached + steps - 1) // PAGE_SIZE:
            return False
    return True


def fed_inputs(
    meta: torch.Tensor, picks: torch.Tensor, carried: torch.Tensor, timestamp_begin: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """On the device: a step's tokens [b] and rule facts [N_RULE_FACTS, b] (`RuleFacts`
    field order) from its metadata [N_META, b]. Each row that follows (META_FOLLOWS)
    feeds the token its row picked at the step before (`picks`, by that step's row
    order), with the facts that row ran with there (`carried` [N_RULE_FACTS, rows],
    which each step leaves) moved on past that token, as `rows.follow_facts` does on
    the host, but whether it may end, which the host counts; the other rows keep the
    token and facts the host wrote. `step_kernels.StepKernels.feed` is the same in one
    kernel."""
    follows = meta[META_FOLLOWS]
    fed = follows >= 0
    at = follows.clamp(min=0)
    chosen = picks.index_select(0, at)
    tokens = torch.where(fed, chosen, meta[META_TOKEN])
    stamp = (chosen >= timestamp_begin).long()
    before = carried.index_select(1, at)
    after = before.clone()
    after[AT_BEGIN] = 0
    after[LAST_IS_TIMESTAMP] = stamp
    after[PENULTIMATE_IS_TIMESTAMP] = before[AT_BEGIN] | before[LAST_IS_TIMESTAMP]
    after[LAST_TIMESTAMP] = torch.where(stamp.bool(), chosen, before[LAST_TIMESTAMP])
    after[END_ALLOWED] = meta[META_RULES + END_ALLOWED]
    facts = torch.where(fed, after, meta[META_RULES:])
    return tokens, facts


def mark_launched(parts: Sequence[Part], steps: int = 1) -> None:
    """Each row of a launch has `steps` more tokens in its cache; a row that fed a
    host token has it no longer pending."""
    for part in parts:
        row = part.row
        row.cached += steps
        if part.follows is None:
            row.pending = row.pending[1:]
