"""One request's decoding state (`Row`), and a request ready to join a batch (`Admission`).

A row feeds its `pending` tokens (the prompt, then each chosen token) and keeps
what it generated; `rule_facts` tells Whisper's logit rules about it. Rows are
compared by identity: the batch, the graphs and the engine all hold the same objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

from python_backend_lib.audio.features import SILENCE_LOG_MEL
from python_backend_lib.core.geometry import N_FRAMES, SECONDS_PER_POSITION
from python_backend_lib.core.model_facts import ModelConfig
from python_backend_lib.core.options import DecodingOptions, DecodingResult
from python_backend_lib.devices.transfers import ToHost, to_device
from python_backend_lib.engine import draws
from python_backend_lib.engine.prompt import Prompt, generation_room
from python_backend_lib.engine.rules import RuleFacts

if TYPE_CHECKING:
    from python_backend_lib.engine.beams import RowGroup

# Called on the engine thread with a row's result so far (`Row.result(finished=False)`)
# each time it has ended a segment (a timestamp token right after text) and goes on past it.
# The streamed path shows the segment before the window ends (`transcription.longform`).
# It must not block.
SegmentListener = Callable[[DecodingResult], None]

# Rows of a [N_RULE_FACTS, rows] facts table (`RuleFacts` field order).
AT_BEGIN, LAST_IS_TIMESTAMP, PENULTIMATE_IS_TIMESTAMP, LAST_TIMESTAMP, END_ALLOWED = (
    RuleFacts._fields.index(name)
    for name in ("at_begin", "last_is_timestamp", "penultimate_is_timestamp", "last_timestamp", "end_allowed")
)


def silent_result(options: DecodingOptions, prompt: Prompt) -> DecodingResult:
    """The answer for a window of digital silence: certainly no speech, nothing decoded."""
    return DecodingResult(
        tokens=(),
        language=None,
        avg_logprob=float("-inf"),
        no_speech_prob=1.0,
        temperature=options.temperature,
        prompt_tokens=prompt.tokens,
    )


def silence_flags(content_frames: Sequence[int | None], features: torch.Tensor) -> ToHost:
    """Whether each window's audio frames (its first `content_frames`) hold digital
    silence (`audio.features.SILENCE_LOG_MEL`), on their way to the host; features:
    [k, n_mels, N_FRAMES]. Admitting does not wait for them (`SilenceCheck`)."""
    device = features.device
    frames = to_device(np.array([n or 0 for n in content_frames]), device)
    heard = torch.arange(N_FRAMES, device=device)[None, :] < frames[:, None]  # [k, frames]
    loudest = features.masked_fill(~heard[:, None, :], float("-inf")).amax(dim=(1, 2))
    return ToHost(loudest < SILENCE_LOG_MEL)


class SilenceCheck(NamedTuple):
    """One window's answer among an admission's `silence_flags`."""

    flags: ToHost
    index: int

    def ready(self) -> bool:
        return self.flags.ready()

    def quiet(self) -> bool:
        return bool(self.flags.get()[self.index])


@dataclass(frozen=True)
class Admission:
    """A request ready to join a batch.

    content_frames: when set, the window is answered as silent without decoding
        if its first `content_frames` frames hold digital silence (see
        `audio.features.SILENCE_LOG_MEL`); None decodes it whatever it holds.
    """

    tag: Any
    features: torch.Tensor  # [n_mels, 3000], on any device
    options: DecodingOptions
    prompt: Prompt
    content_frames: int | None = None
    keep_audio: bool = False  # its slot's encoder K/V outlive it until its callback returns
    live: bool = False  # admitted before every admission that is not, without waiting to batch
    on_segment: SegmentListener | None = None  # told of each segment it ends, as it ends it


class _TimestampScan(NamedTuple):
    """How far `Row.rule_facts` has read a row's tokens, so each step reads only the new ones."""

    tokens: list[int] | None
    scanned: int
    last_timestamp: int


@dataclass(eq=False)
class Row:
    """The decoding state of one request."""

    tag: Any
    options: DecodingOptions
    prompt: Prompt
    slot: int
    max_new_tokens: int
    pending: list[int]  # tokens to feed at the next steps
    cached: int = 0  # tokens already in the KV cache
    generated: list[int] = field(default_factory=list)
    sum_logprob: float = 0.0
    no_speech_prob: float = float("nan")
    language: str | None = None
    language_probability: float | None = None
    prefilled: bool = False  # the logits at <|startoftranscript|> have been read
    silence: SilenceCheck | None = None  # whether its window holds digital silence, until read
    group: RowGroup | None = None  # the beams or samples it decodes with (`engine.beams`); None: alone
    stream: int = 0  # its place among its request's rows: best_of samples draw apart (`engine.draws`)
    keep_audio: bool = False  # as its admission's
    on_segment: SegmentListener | None = None  # as its admission's; only a row decoding alone calls it
    _scan: _TimestampScan = field(default=_TimestampScan(None, 0, -1), repr=False)

    def draw_key(self, ahead: int = 0) -> int:
        """The key of its next draw at a temperature (`ahead` tokens not appended yet)."""
        return draws.draw_key(self.options.seed, self.stream, len(self.generated) + ahead)

    def rule_facts(self, timestamp_begin: int) -> RuleFacts:
        tokens = self.generated
        scan = self._scan
        scanned, last_ts = scan.scanned, scan.last_timestamp
        if scan.tokens is not tokens or scanned > len(tokens):
            scanned, last_ts = 0, -1
        for t in tokens[scanned:]:
            if t >= timestamp_begin:
                last_ts = t
        self._scan = _TimestampScan(tokens, len(tokens), last_ts)
        max_initial = timestamp_begin + round(self.options.max_initial_timestamp / SECONDS_PER_POSITION)
        return RuleFacts(
            at_begin=not tokens,
            suppress_blank=self.options.suppress_blank,
            timestamps=self.options.timestamps,
            last_is_timestamp=bool(tokens) and tokens[-1] >= timestamp_begin,
            penultimate_is_timestamp=len(tokens) < 2 or tokens[-2] >= timestamp_begin,
            last_timestamp=last_ts,
            max_initial=max_initial,
            end_allowed=len(tokens) >= self.options.min_new_tokens,
        )

    def result(self, finished: bool) -> DecodingResult:
        return DecodingResult(
            tokens=tuple(self.generated),
            language=self.language,
            avg_logprob=self.sum_logprob / (len(self.generated) + 1),
            no_speech_prob=self.no_speech_prob,
            temperature=self.options.temperature,
            finished=finished,
            prompt_tokens=self.prompt.tokens,
            language_probability=self.language_probability,
        )


def new_row(admission: Admission, slot: int, config: ModelConfig, stream: int = 0) -> Row:
    """A row decoding `admission` in `slot`, its prompt pending; it may generate
    what the text context leaves after the prompt (`generation_room`; less once a
    detected language lengthens it), or max_new_tokens if fewer. `stream`: its place
    among the admission's rows (beams, samples), which its draws follow."""
    room = generation_room(config, len(admission.prompt.tokens))
    limit = min(admission.options.max_new_tokens or room, room)
    prompt = admission.prompt
    return Row(admission.tag, admission.options, prompt, slot, limit, list(prompt.tokens), language=prompt.language,
               stream=stream, keep_audio=admission.keep_audio, on_segment=admission.on_segment)



def follow_facts(facts: np.ndarray, tokens: np.ndarray, timestamp_begin: int) -> np.ndarray:
    """The rule facts of rows at their next step, from their facts at this one
    ([N_RULE_FACTS, k]) and the tokens they chose here ([k]): what `Row.rule_facts`
    gives once each token is appended, but `end_allowed` (copied: it counts
    tokens, which the caller knows)."""
    chosen_timestamp = tokens >= timestamp_begin
    after = facts.copy()
    after[AT_BEGIN] = 0
    after[LAST_IS_TIMESTAMP] = chosen_timestamp
    # Fewer than two tokens (this one the first), or the one before it a timestamp.
    after[PENULTIMATE_IS_TIMESTAMP] = facts[AT_BEGIN] | facts[LAST_IS_TIMESTAMP]
    after[LAST_TIMESTAMP] = np.where(chosen_timestamp, tokens, facts[LAST_TIMESTAMP])
    return after


class RowState(NamedTuple):
    """A row's fields that a step changes, as `DecodeBatch.checkpoint` saves them."""

    row: Row
    pending: list[int]  # kept by reference: a step replaces a row's pending list, never edits it
    cached: int
    generated: list[int]  # by reference: a beam that takes another's tokens gets a new list
    n_generated: int
    sum_logprob: float
    prefilled: bool
    no_speech_prob: float
    language: str | None
    language_probability: float | None

    @classmethod
    def of(cls, row: Row, pending: list[int] | None = None, cached: int | None = None) -> RowState:
        """The row as it stands, or with `pending` and `cached` as given (a step in flight
        undone: `overlap.Launched.states_before`)."""
        # Positional, and no `_replace`: this runs for every row at every step.
        return cls(
            row,
            row.pending if pending is None else pending,
            row.cached if cached is None else cached,
            row.generated,
            len(row.generated),
            row.sum_logprob,
            row.prefilled,
            row.no_speech_prob,
            row.language,
            row.language_probability,
        )

    def restore(self) -> bool:
        """Put the row back as it was; the step may then run again (it rewrites the same
        KV positions). False, and the row unchanged, when it cannot be: a beam that took
        another beam's tokens since has its K/V too."""
        row = self.row
        if row.generated is not self.generated:
            return False
        row.pending, row.cached, row.prefilled = self.pending, self.cached, self.prefilled
        row.sum_logprob, row.no_speech_prob = self.sum_logprob, self.no_speech_prob
        row.language, row.language_probability = self.language, self.language_probability
        del row.generated[self.n_generated :]
        return True
