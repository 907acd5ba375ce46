"""The requests being decoded together (`DecodeBatch`), stepped one token at a time.

Rows join (`admit`; `joining` encodes them together) and leave (`step`'s finished
list, `drop`) between steps; each row's tokens depend only on its own audio and
options. Without CUDA graphs a step is one eager decoder pass over every row's
pending tokens. With them, rows that have at most `GRAPH_PROMPT_TOKENS` tokens to
feed go through a captured graph, one token per row per step (a short prompt
takes a step per token, which costs less than an eager pass), and rows with a
long prompt (previous text) run eagerly in the same step. Graph steps overlap
(`overlap`): `step` launches the next step and then handles the one before it,
so each call returns what finished one step earlier.

The engine drives a batch from its thread; `offline.decode` drives it to completion for offline use.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from python_backend_lib.core.model_facts import ModelConfig
from python_backend_lib.core.options import DecodingResult
from python_backend_lib.engine import beams
from python_backend_lib.engine.attention import AttentionBackend
from python_backend_lib.engine.draws import draw_tensors
from python_backend_lib.engine.eager import eager_pass
from python_backend_lib.engine.graph_io import GraphStep
from python_backend_lib.engine.joining import join
from python_backend_lib.engine.kv_cache import KVSlotPool
from python_backend_lib.engine.model import Whisper
from python_backend_lib.engine.overlap import Launched, Part, mark_launched, plan_step
from python_backend_lib.engine.prompt import start_of_transcript
from python_backend_lib.engine.rows import Admission, Row, RowState, silent_result
from python_backend_lib.engine.rules import LogitRules, RuleFacts, sample
from python_backend_lib.engine.side_encoding import SideEncoder

if TYPE_CHECKING:
    from python_backend_lib.engine.cuda_graphs import DecodeGraphs
    from python_backend_lib.engine.encoder_graphs import EncoderGraphs

# Rows with at most this many tokens still to feed step through the graphs, one
# token a step; a longer prompt (previous text, up to 224 tokens) runs eagerly.
GRAPH_PROMPT_TOKENS = 8
# Receives the rows that chose a token at a step and their filtered logits [rows, vocab].
LogitObserver = Callable[[Sequence[Row], torch.Tensor], None]
Finished = tuple[Any, DecodingResult]  # (the request's tag, its result)


@dataclass
class StepCounts:
    """What `DecodeBatch.step` did so far (monitoring; read from any thread).

    graph_replays: launches that replayed a captured CUDA graph (a step, or a run of several).
    graph_steps: the decode steps those launches took (a run's each counted: `overlap`).
    eager_passes: eager decoder passes (long prompts, no graphs, or a fallback).
    graph_fallbacks: steps run eagerly because more rows were ready than the largest graph holds.
    """

    graph_replays: int = 0
    graph_steps: int = 0
    eager_passes: int = 0
    graph_fallbacks: int = 0


class StepFailed(Exception):
    """A step raised after some of its rows had finished: their results stand."""

    def __init__(self, finished: list[Finished], cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.finished = finished
        self.cause = cause


def _failed(done: list[Finished], error: Exception) -> Exception:
    """What a step raises when `error` interrupts it after `done` finished."""
    if isinstance(error, StepFailed):
        return StepFailed(done + error.finished, error.cause)
    return StepFailed(done, error) if done else error


def _and_then(done: list[Finished], work: Callable[[], list[Finished]]) -> list[Finished]:
    """`done` and what `work` finishes. The requests in `done` have left the batch with
    their results: when `work` raises, they travel on its StepFailed to be answered."""
    try:
        return done + work()
    except Exception as error:
        raise _failed(done, error) from error


class DecodeBatch:
    def __init__(
        self,
        model: Whisper,
        config: ModelConfig,
        attention: AttentionBackend,
        graphs: DecodeGraphs | None = None,
        encoder_graphs: EncoderGraphs | None = None,
        *,
        overlap: bool = True,
        encode_aside: bool = True,
    ) -> None:
        """graphs: captured decode steps (GPU); rows feeding one token step through them.
        encoder_graphs: captured encoder passes (GPU) for admitting new requests.
        overlap: plan each graph step while the one before it runs (`engine.overlap`).
        encode_aside: with encoder graphs, admissions encode on a stream of their own
            while the batch decodes (`engine.side_encoding`)."""
        self.model = model
        self.config = config
        self.attention = attention
        self.graphs = graphs
        self.encoder_graphs = encoder_graphs
        self.overlap = overlap
        self.pool: KVSlotPool = attention.pool
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.rules = LogitRules(config, self.device)
        self.timestamp_begin = config.special.timestamp_begin
        self.eot = config.special.eot
        self.rows: list[Row] = []
        self.logit_observer: LogitObserver | None = None  # for tests and tracing
        self.counts = StepCounts()
        self._in_flight: Launched | None = None  # a graph step launched, its results not yet handled
        self._unheard: dict[Row, None] = {}  # rows whose silence check has not been read, oldest first
        self._beam_rows = 0  # rows of beam groups in the batch: while none, greedy steps never look for them
        self._kept: list[int] = []  # slots of finished rows kept for their callbacks (`release_kept`)
        aside = encode_aside and encoder_graphs is not None and self.device.type == "cuda"
        self.side: SideEncoder | None = SideEncoder(self.device) if aside else None

    @property
    def accepting(self) -> bool:
        """Whether an admission now would start encoding without queueing behind more
        than the side stream holds (`side_encoding.MAX_IN_FLIGHT`)."""
        return self.side is None or not self.side.full

    @property
    def free_slots(self) -> int:
        return self.pool.n_free

    # ------------------------------------------------------------ joining and leaving

    @torch.inference_mode()
    def admit(self, admissions: Sequence[Admission], stop: Callable[[], bool] | None = None) -> None:
        """Encode the new requests together and store their cross-attention K/V (`joining`).

        Windows that asked for the check (`content_frames`) and hold digital silence
        are answered as silent by a later `step`, undecoded: the check runs on the
        device and is read once done, so admitting waits for nothing. An eager encoder
        pass gives up between layers once `stop()` says so (`model.EncodingStopped`),
        admitting none of them.
        """
        if not admissions:
            return

        def encode() -> list[list[Row]]:
            return join(admissions, self.model, self.config, self.attention, self.encoder_graphs, stop)

        # The eager encoder (no graph holds this many) uses the batch's attention backend,
        # whose plans a decoder step shares: it stays on the decoding stream.
        aside = self.side is not None and self.encoder_graphs.fits(len(admissions))
        for rows in self.side.encode(admissions, encode) if aside else encode():
            self._beam_rows += sum(isinstance(row.group, beams.BeamGroup) for row in rows)
            self._unheard.update((row, None) for row in rows if row.silence is not None)
            self.rows += rows

    def _answer_silent(self, wait: bool, among: Sequence[Row] | None = None) -> list[Finished]:
        """Read the silence checks not read yet (those done, unless `wait`; of the rows
        `among`, if given) and retire the rows found silent: their answer is `silent_result`."""
        rows = list(self._unheard) if among is None else [r for r in among if r in self._unheard]
        silent = []
        for row in rows:
            if wait or row.silence.ready():
                if row.silence.quiet():
                    silent.append(row)
                row.silence = None
                del self._unheard[row]
        for row in silent:
            self.drop(row.tag)
        return [(row.tag, silent_result(row.options, row.prompt)) for row in silent]

    def drop(self, tag: Any) -> bool:
        """Remove a request (cancelled by its client) and free its slots (all its beams or samples)."""
        rows = [row for row in self.rows if row.tag is tag]
        for row in rows:
            self._retire(row)
        return bool(rows)

    def _retire(self, row: Row, *, keep: bool = False) -> None:
        """Remove a row and free its slot (a step in flight may still write there: one stream
        orders it first), or keep the slot, with its encoder K/V, until `release_kept`."""
        self.rows.remove(row)
        self._unheard.pop(row, None)
        if self.side is not None:
            self.side.forget(row)
        if keep:
            self._kept.append(row.slot)
        else:
            self.pool.release(row.slot)
        if isinstance(row.group, beams.BeamGroup):
            self._beam_rows -= 1

    def _answered(self, rows: Sequence[Row], result: DecodingResult) -> DecodingResult:
        """Retire a request's last rows; where it asked to keep its audio, one slot stays
        held for its callback, named in the result."""
        keeper = next((row for row in rows if row.keep_audio), None)
        for row in rows:
            self._retire(row, keep=row is keeper)
        return result if keeper is None else dataclasses.replace(result, audio_slot=keeper.slot)

    def release_kept(self) -> None:
        """Free the slots kept for the callbacks of the results just answered."""
        for slot in self._kept:
            self.pool.release(slot)
        self._kept.clear()

    def reset(self) -> None:
        """Forget every row and the step in flight; every slot is free."""
        self._in_flight = None
        self._kept.clear()
        self.rows.clear()
        self._unheard.clear()
        self._beam_rows = 0
        if self.side is not None:
            self.side.clear()
        self.pool.reset()

    def checkpoint(self) -> list[RowState]:
        """Every row's step-changed fields, for `rewind` after a step that raised:
        as before the step in flight, for the rows in it.

        A step is not atomic: it changes rows before its last device work (which
        is where a bad row or a CUDA error shows)."""
        before = self._in_flight.states_before() if self._in_flight else {}
        return [before.get(row) or RowState.of(row) for row in self.rows]

    def rewind(self, saved: Sequence[RowState]) -> list[Any]:
        """Put the rows still in the batch back as `checkpoint` saw them, the step in
        flight abandoned; the steps that raised may then run again (they rewrite the
        same KV positions). Rows that finished inside them have left with their results.
        Beam searches that moved K/V between their beams since cannot be put back:
        they leave the batch, and their tags are returned (to be answered with the error)."""
        if self._in_flight is not None:
            self._in_flight = None
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # nothing of it still writes
        present = set(self.rows)
        lost = [state.row.tag for state in saved if state.row in present and not state.restore()]
        for tag in dict.fromkeys(lost):
            self.drop(tag)
        return list(dict.fromkeys(lost))

    def drain(self) -> list[Finished]:
        """Handle the step in flight, if any; returns the requests that finished there."""
        launched, self._in_flight = self._in_flight, None
        return self._finish(launched, launched.results(), followed=set()) if launched else []

    # ------------------------------------------------------------------- one step

    @torch.inference_mode()
    def step(self, rows: Sequence[Row] | None = None) -> list[Finished]:
        """One decoder pass over `rows` (default: every row); returns the requests that
        finished. With graphs and `overlap`, and no `rows` named, that pass is launched
        and the one before it handled: its finished requests are returned.

        Raises StepFailed, carrying the requests that finished before the
        failure, when a later part of the step raises.
        """
        if rows is None and self.graphs is not None and self.overlap:
            return self._step_overlapped()
        if self.side is not None:
            self.side.wait_all()
        done = self.drain() + self._answer_silent(wait=True)
        present = set(self.rows)
        if rows is not None and self._beam_rows:
            rows = beams.with_beam_mates(rows)
        if not (rows := [r for r in (self.rows if rows is None else rows) if r in present]):
            return done
        try:
            return done + self._step_now(rows)
        except Exception as error:
            raise _failed(done, error) from error

    def _step_now(self, rows: list[Row]) -> list[Finished]:
        """One synchronous pass over `rows`."""
        if self.graphs is None:
            self.counts.eager_passes += 1
            return self._step_eager(rows)
        by_token = [r for r in rows if len(r.pending) <= GRAPH_PROMPT_TOKENS]
        eager = [r for r in rows if len(r.pending) > GRAPH_PROMPT_TOKENS]
        if not self.graphs.fits(len(by_token)):
            self.counts.graph_fallbacks += 1
            by_token, eager = [], rows
        done: list[Finished] = []
        if eager:
            self.counts.eager_passes += 1
            done = self._step_eager(eager)
        if by_token:
            try:
                plan = plan_step(by_token, None, GRAPH_PROMPT_TOKENS, self.timestamp_begin)
                launched = self._launch(plan.parts, self.graphs.prepare(plan.inputs))
                done += self._finish(launched, launched.results(), followed=set())
            except Exception as error:
                raise _failed(done, error) from error
        return done

    def _step_overlapped(self) -> list[Finished]:
        """Launch the next graph step (planned while the one in flight runs, fed its picks
        on the device), then handle the one in flight; long prompts pass eagerly first."""
        done = self._answer_silent(wait=False)
        previous = self._in_flight
        rows = self.rows if self.side is None else self.side.ready(self.rows)  # encoded already
        plan = plan_step(rows, previous, GRAPH_PROMPT_TOKENS, self.timestamp_begin, self._run_steps(rows))
        if plan.parts and not self.graphs.fits(len(plan.parts)):  # more rows than the largest graph
            self.counts.graph_fallbacks += 1
            self._in_flight = None
            done += self._finish(previous, previous.results(), followed=set()) if previous else []
            if self.side is not None:
                self.side.wait_all()
            return done + self._step_now([r for r in self.rows])
        try:
            if plan.eager:  # rows not in the step in flight; rare (a long prompt)
                self.counts.eager_passes += 1
                done += self._step_eager(plan.eager)
            launched = self._launch(plan.parts, self.graphs.prepare(plan.inputs)) if plan.parts else None
            self._in_flight = launched
            if previous is not None:
                picked = previous.results()
                if launched is not None:
                    launched.settle(picked[-1])
                done += self._finish(previous, picked, {p.row for p in plan.parts if p.follows is not None})
        except Exception as error:
            raise _failed(done, error) from error
        return done

    def _run_steps(self, rows: Sequence[Row]) -> int:
        """How many steps the next launch may take at once (`overlap`, runs): the graphs'
        runs, where every row of the batch can step (none encoding aside), their rows fit
        a run's graph, and no step needs its logits kept (beams, an observer)."""
        steps = self.graphs.run_steps
        if steps < 2 or len(rows) != len(self.rows) or not self.graphs.fits_run(len(rows)):
            return 1
        return 1 if self.logit_observer is not None or self._beam_rows else steps

    def _launch(self, parts: list[Part], prepared) -> Launched:
        pending = self.graphs.launch(prepared, keep_logits=self.logit_observer is not None or self._beam_rows > 0)
        steps = prepared.inputs.steps
        mark_launched(parts, steps)
        self.counts.graph_replays += 1
        self.counts.graph_steps += steps
        return Launched(parts, prepared.inputs.tokens.copy(), pending, steps)

    def _finish(self, launched: Launched, steps: list[GraphStep], followed: set[Row]) -> list[Finished]:
        """Apply the picks of a launch's steps, in order, to its rows still in the batch.

        followed: rows launched into the next step feeding what they chose at the last."""
        done: list[Finished] = []
        inside = {part.row for part in launched.parts} if len(steps) > 1 else followed
        for j, step in enumerate(steps):  # a run's rows that end at a step leave the batch there
            fed = followed if j == len(steps) - 1 else inside
            done = _and_then(done, functools.partial(self._finish_step, launched, step, fed))
        return done

    def _finish_step(self, launched: Launched, step: GraphStep, followed: set[Row]) -> list[Finished]:
        """Apply a graph step's picks to its rows that are still in the batch.

        followed: rows fed what they chose here in a step launched already."""
        # A row's silence is read before any of its results (its check ran before this step).
        done = self._answer_silent(wait=True, among=[p.row for p in launched.parts]) if self._unheard else []
        present = set(self.rows)
        live = [(i, p) for i, p in enumerate(launched.parts) if p.row in present]
        starting = [(i, p) for i, p in live if p.at_start]
        waiting = start_of_transcript(self.config,
            [p.row for _, p in starting],
            [step.no_speech[i] for i, _ in starting],
            [step.languages[i] for i, _ in starting] if step.languages is not None else None,
        )
        choosing = [(i, p) for i, p in live if p.chooses and p.row not in waiting]
        return _and_then(done, lambda: self._choose_picked(step, choosing, followed))

    def _choose_picked(self, step: GraphStep, choosing: list[tuple[int, Part]], followed: set[Row]) -> list[Finished]:
        """Take the picks of `choosing` ((index in the step, part) pairs) as their rows' tokens."""
        if not choosing:
            return []
        rows = [p.row for _, p in choosing]
        logits = None
        # Kept when the step was launched beside beam rows or for an observer; a search
        # admitted since (its rows are not in this step) needs none of them.
        if step.logits is not None:
            logits = step.logits[torch.tensor([i for i, _ in choosing], device=step.logits.device)]
        if self.logit_observer is not None:
            self.logit_observer(rows, logits)
        tokens = [step.tokens[i] for i, _ in choosing]
        return self._advance_all(rows, tokens, [step.logprobs[i] for i, _ in choosing], followed, logits)

    def _step_eager(self, rows: list[Row]) -> list[Finished]:
        """Every row's pending tokens at once, through the attention backend."""
        passed = eager_pass(self.model, self.config, self.attention, rows)
        waiting = start_of_transcript(self.config, [rows[i] for i in passed.fresh], passed.no_speech, passed.languages)
        choosing = [i for i, r in enumerate(rows) if r not in waiting]
        return self._choose([rows[i] for i in choosing], passed.logits[choosing])

    def _choose(self, rows: list[Row], logits: torch.Tensor) -> list[Finished]:
        """Apply the rules to eager logits and choose each row's token."""
        if not rows:
            return []
        facts = [row.rule_facts(self.timestamp_begin) for row in rows]
        table = torch.tensor(facts, dtype=torch.long).T.to(self.device, non_blocking=True)
        logits = self.rules.apply(logits, RuleFacts.from_table(table))
        if self.logit_observer is not None:
            self.logit_observer(rows, logits)
        chosen, logprobs = sample(logits, *draw_tensors(rows, self.device))
        return self._advance_all(rows, chosen.tolist(), logprobs.tolist(), set(), logits)

    def _advance_all(self, rows, tokens, logprobs, followed: set[Row], logits: torch.Tensor | None) -> list[Finished]:
        """`_advance` the rows but beams, which choose from their filtered `logits`
        ([rows, vocab]) together (`engine.beams`); the beam searches that ended leave."""
        if not self._beam_rows or not (searching := [k for k, r in enumerate(rows) if r.group and r.group.lockstep]):
            return self._advance(rows, tokens, logprobs, followed)
        ended = beams.advance_beams([rows[k] for k in searching], logits[searching], self.pool, self.eot)
        answered = [(group.tag, self._answered([r for r in self.rows if r.tag is group.tag], result))
                    for group, result in ended]
        alone = [k for k, r in enumerate(rows) if not (r.group and r.group.lockstep)]
        picks = [rows[k] for k in alone], [tokens[k] for k in alone], [logprobs[k] for k in alone]
        return _and_then(answered, lambda: self._advance(*picks, followed))

    def _ends_segment(self, generated: list[int]) -> bool:
        """The last token is a timestamp right after text: it ends a segment (Whisper's
        timestamp grammar; text tokens lie below <|endoftext|>)."""
        return len(generated) > 1 and generated[-1] >= self.timestamp_begin and generated[-2] < self.eot

    def _advance(self, rows: list[Row], tokens: list[int], logprobs: list[float], followed: set[Row]) -> list[Finished]:
        """Append each row's chosen token; retire the rows that finished. A row in
        `followed` feeds its token in the step launched already: nothing is pending."""
        eot = self.eot
        finished: list[Finished] = []
        done = []
        for row, token, logprob in zip(rows, tokens, logprobs):
            if token == eot:
                done.append((row, True))
                continue
            if row.on_segment is not None and row.group is None and self._ends_segment(row.generated):
                # The segment is told once the row goes on past it: one that ends the window
                # comes with the window's own answer, a step later, instead of twice.
                row.on_segment(row.result(finished=False))
            row.generated.append(token)
            row.sum_logprob += logprob
            if len(row.generated) >= row.max_new_tokens:
                done.append((row, False))
            elif row not in followed:
                row.pending = [token]
        try:
            for row, completed in done:
                result = row.result(completed) if row.group is None else row.group.end(row, completed)
                if result is None:  # a sample's group answers when its last sample ends
                    self._retire(row)
                else:
                    finished.append((row.tag, self._answered([row], result)))
        except Exception as error:  # those answered already have left the batch
            raise _failed(finished, error) from error
        return finished

