"""Beam search and best-of sampling: one request decoded as several rows of the batch.

A request whose options ask for beams (`beam_size` at temperature 0) or samples
(`best_of` above it) joins the batch as a `RowGroup` of that many rows, each
with its own KV slot; the batch, the CUDA graphs and FlashInfer see only rows.
The audio is encoded once and its cross-attention K/V copied into every slot.

Samples are independent rows that draw their own tokens; the group answers
once the last has ended, with the best by `rank`.

Beams step together. After each step `BeamGroup.advance` takes the
`beam_size + 1` likeliest tokens of every beam, scores each continuation by
its summed log-probability, and keeps the `beam_size` best that do not end;
those that end are candidates. A beam that continues another's text takes
its tokens and its self-attention K/V (the batch copies the slot). The search
ends once round(beam_size * patience) candidates have ended, or the tokens run
out; the best candidate by `rank` is the answer. This is openai-whisper's
BeamSearchDecoder rule (sums in float32 as there, ties broken in the same
order), so the tokens match it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import numpy as np
import torch

from python_backend_lib.core.options import DecodingOptions, DecodingResult
from python_backend_lib.devices.transfers import to_device

if TYPE_CHECKING:
    from python_backend_lib.engine.kv_cache import KVSlotPool
    from python_backend_lib.engine.rows import Row


def beam_count(options: DecodingOptions) -> int:
    """Beams a window decodes with: beam_size at temperature 0, else 1 (no search)."""
    return options.beam_size or 1 if options.temperature == 0 else 1


def sample_count(options: DecodingOptions) -> int:
    """Samples a window draws: best_of above temperature 0, else 1."""
    return options.best_of or 1 if options.temperature > 0 else 1


def rows_needed(options: DecodingOptions) -> int:
    """Rows (KV slots) one window takes in the batch."""
    return max(beam_count(options), sample_count(options))


def length_penalized(sum_logprob: float, length: int, length_penalty: float | None) -> float:
    """A candidate's ranking score: None divides by the length, alpha by ((5 + length) / 6) ** alpha."""
    penalty = length if length_penalty is None else ((5 + length) / 6) ** length_penalty
    return sum_logprob / penalty if penalty else sum_logprob


class Candidate(NamedTuple):
    tokens: tuple[int, ...]  # without <|endoftext|>
    sum_logprob: float
    finished: bool


def rank(candidates: Sequence[Candidate], length_penalty: float | None) -> Candidate:
    """The best candidate by `length_penalized` score; the first of equals."""
    scores = [length_penalized(c.sum_logprob, len(c.tokens), length_penalty) for c in candidates]
    return candidates[int(np.argmax(scores))]


@dataclass(eq=False)
class RowGroup:
    """The rows decoding one request together; `rows[0]` holds its no-speech
    probability and language, which every row shares."""

    tag: Any
    rows: list[Row]
    length_penalty: float | None
    lockstep = False  # its rows step only together (beams); samples step alone

    def result(self, best: Candidate) -> DecodingResult:
        head = self.rows[0]
        return DecodingResult(
            tokens=best.tokens,
            language=head.language,
            avg_logprob=best.sum_logprob / (len(best.tokens) + 1),
            no_speech_prob=head.no_speech_prob,
            temperature=head.options.temperature,
            finished=best.finished,
            prompt_tokens=head.prompt.tokens,
            language_probability=head.language_probability,
        )


@dataclass(eq=False)
class SampleGroup(RowGroup):
    """best_of rows drawing independently; each leaves the batch when it ends."""

    ended: dict[int, Candidate] = field(default_factory=dict)  # by row index

    def end(self, row: Row, finished: bool) -> DecodingResult | None:
        """Record one sample's end; the group's answer once every sample has ended."""
        self.ended[self.rows.index(row)] = Candidate(tuple(row.generated), row.sum_logprob, finished)
        if len(self.ended) < len(self.rows):
            return None
        return self.result(rank([self.ended[i] for i in range(len(self.rows))], self.length_penalty))


class Continuation(NamedTuple):
    """Beam j's next state: it continues beam `source`'s tokens with `token`."""

    source: int
    token: int
    sum_logprob: float


@dataclass(eq=False)
class BeamGroup(RowGroup):
    """beam_size rows stepping together (they are all in every step)."""

    lockstep = True

    max_candidates: int = 1
    finished: dict[tuple[int, ...], float] = field(default_factory=dict)  # candidates that ended, in order

    @property
    def beam_size(self) -> int:
        return len(self.rows)

    def advance(
        self, top_logprobs: Sequence[Sequence[float]], top_tokens: Sequence[Sequence[int]], eot: int
    ) -> list[Continuation]:
        """Rank the continuations of every beam (its `beam_size + 1` likeliest tokens and
        their log-probabilities, likeliest first, in row order); record the ones that
        end as candidates and return the `beam_size` best that go on, best first."""
        scores: dict[tuple[int, ...], float] = {}
        sources: dict[tuple[int, ...], int] = {}
        for j, row in enumerate(self.rows):
            total = np.float32(row.sum_logprob)
            prefix = tuple(row.generated)
            for logprob, token in zip(top_logprobs[j], top_tokens[j]):
                sequence = (*prefix, token)
                scores[sequence] = float(total + np.float32(logprob))
                sources[sequence] = j
        kept: list[Continuation] = []
        ended: dict[tuple[int, ...], float] = {}
        for sequence in sorted(scores, key=scores.__getitem__, reverse=True):
            if sequence[-1] == eot:
                ended[sequence[:-1]] = scores[sequence]
                continue
            kept.append(Continuation(sources[sequence], sequence[-1], scores[sequence]))
            if len(kept) == self.beam_size:
                break
        for sequence in sorted(ended, key=ended.__getitem__, reverse=True):
            if len(self.finished) >= self.max_candidates:
                break
            self.finished[sequence] = ended[sequence]
        return kept

    @property
    def complete(self) -> bool:
        return len(self.finished) >= self.max_candidates

    def best(self) -> DecodingResult:
        """The answer: the best candidate that ended, the likeliest beams still
        going making up the numbers when fewer than beam_size ended."""
        candidates = [Candidate(tokens, total, True) for tokens, total in self.finished.items()]
        if len(candidates) < self.beam_size:
            sums = np.array([row.sum_logprob for row in self.rows], dtype=np.float32)
            seen = set(self.finished)
            for j in list(np.argsort(sums))[::-1]:
                tokens = tuple(self.rows[j].generated)
                if tokens not in seen:
                    seen.add(tokens)
                    candidates.append(Candidate(tokens, float(sums[j]), False))
                if len(candidates) >= self.beam_size:
                    break
        return self.result(rank(candidates, self.length_penalty))


def admissible(options: Sequence[DecodingOptions], free_slots: int) -> int:
    """How many of the first requests (in order) fit in `free_slots` together."""
    n = 0
    for option in options:
        free_slots -= rows_needed(option)
        if free_slots < 0:
            break
        n += 1
    return n


def owned_slots(slots: Sequence[int], options: Sequence[DecodingOptions]) -> list[list[int]]:
    """`slots` (allocated in request order, `rows_needed` each) split by request."""
    owned, start = [], 0
    for option in options:
        owned.append(list(slots[start : start + rows_needed(option)]))
        start += len(owned[-1])
    return owned


def share_audio(pool: KVSlotPool, owned: Sequence[Sequence[int]]) -> None:
    """Copy each request's cross-attention K/V, written in its first slot, into its other slots."""
    pairs = [(own[0], slot) for own in owned for slot in own[1:]]
    if pairs:
        device = pool.self_k[0].device
        pool.copy_cross(*(to_device(np.array(column), device) for column in zip(*pairs)))


def form_group(tag: Any, rows: list[Row], options: DecodingOptions) -> RowGroup | None:
    """Make `rows` (all decoding one request) a group, when there are several."""
    if len(rows) == 1:
        return None
    if beam_count(options) > 1:
        candidates = round(len(rows) * (options.patience or 1.0))
        group: RowGroup = BeamGroup(tag, rows, options.length_penalty, max_candidates=candidates)
    else:
        group = SampleGroup(tag, rows, options.length_penalty)
    for row in rows:
        row.group = group
    return group


def with_beam_mates(rows: Sequence[Row]) -> list[Row]:
    """`rows` with every beam of their beam groups (beams step only together), in order."""
    out: dict[Row, None] = {}
    for row in rows:
        mates = row.group.rows if isinstance(row.group, BeamGroup) else (row,)
        out.update(dict.fromkeys(mates))
    return list(out)


def advance_beams(
    rows: Sequence[Row], logits: torch.Tensor, pool: KVSlotPool, eot: int
) -> list[tuple[BeamGroup, DecodingResult]]:
    """Advance the beam groups whose rows are `rows` (every beam of each, all of
    them having just fed a token) by one token, from their filtered logits
    [rows, vocab]. Each beam takes its continuation's tokens, log-probability
    and (copied on the device) self-attention K/V, and has its token pending;
    returns the groups that ended, with their answers (their rows still in the batch)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    tops: dict[Row, tuple[list[float], list[int]]] = {}
    for width in {len(row.group.rows) + 1 for row in rows}:
        index = [k for k, row in enumerate(rows) if len(row.group.rows) + 1 == width]
        values, tokens = logprobs[to_device(np.array(index), logprobs.device)].topk(width, dim=-1)
        for k, v, t in zip(index, values.tolist(), tokens.tolist()):
            tops[rows[k]] = (v, t)
    ended: list[tuple[BeamGroup, DecodingResult]] = []
    sources: list[int] = []
    targets: list[int] = []
    for group in dict.fromkeys(row.group for row in rows):
        beams = group.rows
        kept = group.advance([tops[r][0] for r in beams], [tops[r][1] for r in beams], eot)
        texts = [[*beams[c.source].generated, c.token] for c in kept]
        moved = [(beams[c.source].slot, row.slot) for j, (row, c) in enumerate(zip(beams, kept)) if c.source != j]
        for row, continuation, text in zip(beams, kept, texts):
            row.generated, row.sum_logprob, row.pending = text, continuation.sum_logprob, [continuation.token]
        if group.complete or len(beams[0].generated) >= beams[0].max_new_tokens:
            ended.append((group, group.best()))
        elif moved:
            sources += [source for source, _ in moved]
            targets += [target for _, target in moved]
    if sources:  # the K/V of every position before the pending tokens (stale ones past a beam's are harmless)
        positions = max(row.cached for row in rows)
        device = pool.self_k[0].device
        pool.copy_self(to_device(np.array(sources), device), to_device(np.array(targets), device), positions)
    return ended
