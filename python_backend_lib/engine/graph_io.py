"""What a captured decode step reads and gives back, as the host sees it.

The host describes a step's rows (`StepInputs`), writes them into pinned
staging memory (`Prepared`), and after the launch reads the step's picks from
pinned memory once its event has passed (`PendingStep`, `GraphStep`). The
device buffers these fill, and the graphs that read them, are `cuda_graphs`'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from python_backend_lib.devices.transfers import Lease, ToHost
from python_backend_lib.engine.rows import Row
from python_backend_lib.engine.rules import N_RULE_FACTS

if TYPE_CHECKING:
    from python_backend_lib.engine.cuda_graphs import _Entry

# Rows of the `meta` buffer. META_FOLLOWS: the row's index in the step before, whose
# pick it feeds (read on the device, `overlap.fed_inputs`); -1 where the host knows the token.
META_TOKEN, META_POSITION, META_CACHE_INDEX, META_FOLLOWS = 0, 1, 2, 3
META_RULES = 4  # N_RULE_FACTS rows from here, in RuleFacts field order
N_META = META_RULES + N_RULE_FACTS

# Rows of the `picked` output, read back after every step.
PICKED_TOKEN, PICKED_LOGPROB, PICKED_NO_SPEECH, PICKED_LANGUAGE, PICKED_LANGUAGE_PROBABILITY = range(5)
N_PICKED = 5


@dataclass(frozen=True)
class StepInputs:
    """One step's rows as the host describes them (n rows, in order).

    tokens: what each row feeds (-1 for a row that follows).
    positions: tokens each row has in its cache before this step.
    facts: [N_RULE_FACTS, n] the logit rules' facts (`RuleFacts` field order); for a
        row that follows, only `end_allowed` is read (the device has the rest:
        `overlap.fed_inputs`).
    temperatures: rows above 0 draw their token at that temperature, on the device.
    draw_keys: each row's key for that draw (`Row.draw_key`); any value where it draws none.
    follows: each row's index in the step before, whose pick it feeds on the device
        (the step is launched before that pick is known); -1: it feeds `tokens`.
    steps: decode steps in the launch: above 1, a run (`overlap`), every row following.
    """

    slots: np.ndarray
    tokens: np.ndarray
    positions: np.ndarray
    facts: np.ndarray
    temperatures: np.ndarray
    follows: np.ndarray
    draw_keys: np.ndarray
    steps: int = 1

    @classmethod
    def of_rows(cls, rows: Sequence[Row], timestamp_begin: int) -> StepInputs:
        """Each row feeding its first pending token, choosing at its own temperature."""
        n = len(rows)
        facts = np.array([r.rule_facts(timestamp_begin) for r in rows], dtype=np.int64).reshape(n, N_RULE_FACTS)
        return cls(
            slots=np.fromiter((r.slot for r in rows), dtype=np.int64, count=n),
            tokens=np.fromiter((r.pending[0] for r in rows), dtype=np.int64, count=n),
            positions=np.fromiter((r.cached for r in rows), dtype=np.int64, count=n),
            facts=facts.T,
            temperatures=np.fromiter((r.options.temperature for r in rows), dtype=np.float64, count=n),
            follows=np.full(n, -1, dtype=np.int64),
            draw_keys=np.fromiter((r.draw_key() for r in rows), dtype=np.int64, count=n),
        )


@dataclass(frozen=True)
class GraphStep:
    """What one step hands back, for the n real rows."""

    tokens: list[int]  # the chosen tokens: greedy, or drawn where the row has a temperature
    logprobs: list[float]  # their log-probabilities under the filtered logits
    no_speech: list[float]  # the no-speech probability, meaningful where <|startoftranscript|> was fed
    languages: list[tuple[int, float]] | None  # (index into the language tokens, probability); None on English-only
    logits: torch.Tensor | None  # [n, vocab] float32 filtered logits, when kept (`launch`'s keep_logits)


@dataclass
class Prepared:
    """A step whose buffers and plans are written, waiting for `DecodeGraphs.launch`.
    `staging` [N_META, batch] (pinned) is what the device reads at launch."""

    entry: _Entry  # the bucket it was planned in
    inputs: StepInputs
    pinned: torch.Tensor
    lease: Lease | None = None  # `pinned`'s turn in its bucket's staging ring

    @property
    def staging(self) -> np.ndarray:
        return self.pinned.numpy()


class PendingStep:
    """A launched step or run; `results` waits for it alone (not for steps launched after it).

    picked: [N_PICKED, batch], or [steps, N_PICKED, batch] for a run, on the device,
    copied now (the n real rows are read)."""

    def __init__(
        self,
        n: int,
        picked: torch.Tensor,
        logits: torch.Tensor | None,
        multilingual: bool,
        landing: Lease | None = None,
    ) -> None:
        """landing: where the picks land on the host (a turn of a ring of pinned buffers)."""
        self.n = n
        self._picked = ToHost(picked, into=landing)
        self._logits = logits
        self._multilingual = multilingual

    def result(self) -> GraphStep:
        """The picks of a single step."""
        (step,) = self.results()
        return step

    def results(self) -> list[GraphStep]:
        """Each step's picks, in order."""
        picked = self._picked.get().numpy()
        if picked.ndim == 2:
            picked = picked[None]
        return [self._step(rows[:, : self.n].tolist()) for rows in picked]  # a numpy slice costs less than torch's

    def _step(self, rows: list[list[float]]) -> GraphStep:
        languages = None
        if self._multilingual:
            languages = [(int(i), p) for i, p in zip(rows[PICKED_LANGUAGE], rows[PICKED_LANGUAGE_PROBABILITY])]
        return GraphStep(
            tokens=[int(t) for t in rows[PICKED_TOKEN]],
            logprobs=rows[PICKED_LOGPROB],
            no_speech=rows[PICKED_NO_SPEECH],
            languages=languages,
            logits=self._logits,
        )
