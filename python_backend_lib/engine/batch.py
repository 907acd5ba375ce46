"""The requests being decoded together (`DecodeBatch`), stepped one token at a time.

Rows join (`admit`, which encodes them together) and leave (`step`'s finished
list, `drop`) between steps; each row's tokens depend only on its own audio and
options. Without CUDA graphs a step is one eager decoder pass over every row's
pending tokens. With them, rows that have at most `GRAPH_PROMPT_TOKENS` tokens to
feed go through a captured graph, one token per row per step (a short prompt
takes a step per token, which costs less than an eager pass), and rows with a
long prompt (previous text) run eagerly in the same step.

The engine drives a batch from its thread; `decode` drives it to completion for offline use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from python_backend_lib.audio.features import SILENCE_LOG_MEL
from python_backend_lib.core.geometry import N_FRAMES
from python_backend_lib.core.model_facts import ModelConfig
from python_backend_lib.core.options import DecodingOptions, DecodingResult
from python_backend_lib.engine.attention import AttentionBackend, StepLayout
from python_backend_lib.engine.kv_cache import KVSlotPool
from python_backend_lib.engine.model import Whisper
from python_backend_lib.engine.prompt import Prompt, task_tokens
from python_backend_lib.engine.rows import Admission, Row, RowState
from python_backend_lib.engine.rules import LogitRules, RuleFacts, sample

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

    graph_replays: steps that replayed a captured CUDA graph.
    eager_passes: eager decoder passes (long prompts, no graphs, or a fallback).
    graph_fallbacks: steps whose one-token rows ran eagerly because more rows were
        ready than the largest captured graph holds.
    """

    graph_replays: int = 0
    eager_passes: int = 0
    graph_fallbacks: int = 0


class StepFailed(Exception):
    """A step raised after some of its rows had finished: their results stand."""

    def __init__(self, finished: list[Finished], cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.finished = finished
        self.cause = cause


def silent_result(admission: Admission) -> DecodingResult:
    """The answer for a window of digital silence: certainly no speech, nothing decoded."""
    return DecodingResult(
        tokens=(),
        language=None,
        avg_logprob=float("-inf"),
        no_speech_prob=1.0,
        temperature=admission.options.temperature,
        prompt_tokens=admission.prompt.tokens,
    )


class DecodeBatch:
    def __init__(
        self,
        model: Whisper,
        config: ModelConfig,
        attention: AttentionBackend,
        graphs: DecodeGraphs | None = None,
        encoder_graphs: EncoderGraphs | None = None,
    ) -> None:
        """graphs: captured decode steps (GPU); rows feeding one token step through them.
        encoder_graphs: captured encoder passes (GPU) for admitting new requests."""
        self.model = model
        self.config = config
        self.attention = attention
        self.graphs = graphs
        self.encoder_graphs = encoder_graphs
        self.pool: KVSlotPool = attention.pool
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.rules = LogitRules(config, self.device)
        self.rows: list[Row] = []
        self.logit_observer: LogitObserver | None = None  # for tests and tracing
        self.counts = StepCounts()

    @property
    def free_slots(self) -> int:
        return self.pool.n_free

    # ------------------------------------------------------------ joining and leaving

    @torch.inference_mode()
    def admit(self, admissions: Sequence[Admission]) -> list[Finished]:
        """Encode the new requests together and store their cross-attention K/V.

        Returns the windows answered at once, without a slot: those that asked
        for the check (`content_frames`) and hold digital silence.
        """
        if not admissions:
            return []
        # Each clip to the device first (pinned or device features copy asynchronously), then stacked there.
        features = torch.stack([a.features.to(self.device, non_blocking=True) for a in admissions])
        silent = self._digital_silence(admissions, features)
        keep = [i for i in range(len(admissions)) if i not in silent]
        finished = [(admissions[i].tag, silent_result(admissions[i])) for i in sorted(silent)]
        if not keep:
            return finished
        admitted = [admissions[i] for i in keep]
        mel = (features[keep] if silent else features).to(self.dtype)
        slots = [self.pool.allocate() for _ in admitted]
        try:
            if self.encoder_graphs is not None and self.encoder_graphs.fits(len(slots)):
                self.encoder_graphs.run(mel, slots)
            else:
                audio = self.model.encode(mel, self.attention)
                self.pool.write_cross(torch.tensor(slots, device=self.device), self.model.cross_kv(audio))
        except BaseException:  # e.g. out of memory: the slots hold nothing yet
            for slot in slots:
                self.pool.release(slot)
            raise
        text_ctx = self.config.dims.n_text_ctx
        for admission, slot in zip(admitted, slots):
            room = text_ctx - len(admission.prompt.tokens)
            limit = admission.options.max_new_tokens or room
            self.rows.append(
                Row(
                    tag=admission.tag,
                    options=admission.options,
                    prompt=admission.prompt,
                    slot=slot,
                    max_new_tokens=min(limit, room),
                    pending=list(admission.prompt.tokens),
                    language=admission.prompt.language,
                )
            )
        return finished

    def _digital_silence(self, admissions: Sequence[Admission], features: torch.Tensor) -> set[int]:
        """Indexes of the admissions that asked for the check and whose audio frames are digital silence."""
        checked = [i for i, a in enumerate(admissions) if a.content_frames is not None]
        if not checked:
            return set()
        frames = torch.tensor([admissions[i].content_frames for i in checked], device=self.device)
        heard = torch.arange(N_FRAMES, device=self.device)[None, :] < frames[:, None]  # [k, frames]
        loudest = features[checked].masked_fill(~heard[:, None, :], float("-inf")).amax(dim=(1, 2))
        return {i for i, quiet in zip(checked, (loudest < SILENCE_LOG_MEL).tolist()) if quiet}

    def drop(self, tag: Any) -> bool:
        """Remove a request (cancelled by its client) and free its slot."""
        for row in self.rows:
            if row.tag is tag:
                self._retire(row)
                return True
        return False

    def _retire(self, row: Row) -> None:
        self.rows.remove(row)
        self.pool.release(row.slot)

    def checkpoint(self) -> list[RowState]:
        """Every row's step-changed fields, for `rewind` after a step that raised.

        A step is not atomic: it changes rows before its last device work (which
        is where a bad row or a CUDA error shows)."""
        return [RowState.of(row) for row in self.rows]

    def rewind(self, saved: Sequence[RowState]) -> None:
        """Put the rows still in the batch back as `checkpoint` saw them; the step
        that raised may then run again (it rewrites the same KV positions). Rows
        that finished inside that step have left with their results."""
        present = set(self.rows)
        for state in saved:
            if state.row in present:
                state.restore()

    # ------------------------------------------------------------------- one step

    @torch.inference_mode()
    def step(self, rows: Sequence[Row] | None = None) -> list[Finished]:
        """One decoder pass over `rows` (default: every row); returns the requests that finished.

        Raises StepFailed, carrying the requests that finished before the
        failure, when a later part of the step raises.
        """
        rows = list(self.rows if rows is None else rows)
        if not rows:
            return []
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
                done += self._step_graph(by_token)
            except Exception as error:
                if done:
                    raise StepFailed(done, error) from error
                raise
            self.counts.graph_replays += 1
        return done

    def _step_eager(self, rows: list[Row]) -> list[Finished]:
        """Every row's pending tokens at once, through the attention backend."""
        device = self.device
        layout = StepLayout(
            slots=torch.tensor([r.slot for r in rows], device=device),
            query_lens=tuple(len(r.pending) for r in rows),
            cached_lens=tuple(r.cached for r in rows),
            slot_ids=tuple(r.slot for r in rows),
        )
        tokens = torch.tensor([t for r in rows for t in r.pending], device=device)
        last = layout.last_token_index(device)
        # Rows that feed <|startoftranscript|> now also need the logits there
        # (no-speech probability, language detection).
        fresh = [i for i, r in enumerate(rows) if not r.prefilled]
        starts = [sum(layout.query_lens[:i]) + rows[i].prompt.sot_index - rows[i].cached for i in fresh]
        index = torch.cat([last, torch.tensor(starts, device=device, dtype=last.dtype)])
        logits = self.model.decode_step(tokens, layout, self.attention, index)
        logits, sot_logits = logits[: len(rows)], logits[len(rows) :]
        for row in rows:
            row.cached += len(row.pending)
            row.pending = []
        special = self.config.special
        no_speech = sot_logits.float().softmax(dim=-1)[:, special.nospeech].tolist() if fresh else []
        waiting = self._start_of_transcript(
            [rows[i] for i in fresh], no_speech, sot_logits[:, list(special.language_tokens)]
        )
        choosing = [i for i, r in enumerate(rows) if r not in waiting]
        return self._choose([rows[i] for i in choosing], logits[choosing])

    def _step_graph(self, rows: list[Row]) -> list[Finished]:
        """One pending token per row, through the captured graph of the smallest bucket that holds them."""
        step = self.graphs.run(rows)
        at_start = [i for i, r in enumerate(rows) if r.cached == r.prompt.sot_index]
        for row in rows:
            row.cached += 1
        waiting = self._start_of_transcript(
            [rows[i] for i in at_start],
            [step.no_speech[i] for i in at_start],
            step.language_logits[at_start] if step.language_logits is not None and at_start else None,
        )
        choosing = []
        for i, row in enumerate(rows):
            if row in waiting:  # detected its language: feeds language and task next
                continue
            if len(row.pending) > 1:  # still feeding its prompt: this step's choice is not used
                row.pending = row.pending[1:]
                continue
            row.pending = []
            choosing.append(i)
        if not choosing:
            return []
        tokens = [step.tokens[i] for i in choosing]
        logprobs = [step.logprobs[i] for i in choosing]
        hot = [k for k, i in enumerate(choosing) if rows[i].options.temperature > 0]
        if hot:  # sampled rows draw from the graph's filtered logits
            index = torch.tensor([choosing[k] for k in hot], device=self.device)
            temperatures = torch.tensor([rows[choosing[k]].options.temperature for k in hot], device=self.device)
            drawn, drawn_logprobs = sample(step.logits[index], temperatures)
            for k, token, logprob in zip(hot, drawn.tolist(), drawn_logprobs.tolist()):
                tokens[k], logprobs[k] = token, logprob
        chosen_rows = [rows[i] for i in choosing]
        if self.logit_observer is not None:
            self.logit_observer(chosen_rows, step.logits[torch.tensor(choosing, device=self.device)])
        return self._advance(chosen_rows, tokens, logprobs)

    def _start_of_transcript(
        self, rows: list[Row], no_speech: list[float], language_logits: torch.Tensor | None
    ) -> set[Row]:
        """Record the no-speech probability of rows whose <|startoftranscript|> was
        just fed, and detect the language of those that asked; return the rows
        that choose no token now (they feed their language and task tokens next).

        language_logits: [len(rows), languages] raw logits at <|startoftranscript|>.
        """
        waiting: set[Row] = set()
        detecting = [k for k, r in enumerate(rows) if r.prompt.detect_language and r.language is None]
        if detecting:
            probabilities = language_logits[detecting].float().softmax(dim=-1)
            best = probabilities.max(dim=-1)
            codes = self.config.special.language_codes
            for k, index, confidence in zip(detecting, best.indices.tolist(), best.values.tolist()):
                row = rows[k]
                row.language, row.language_probability = codes[index], confidence
                row.pending = task_tokens(self.config, row.language, row.options.task, row.options.timestamps)
                waiting.add(row)
        for row, probability in zip(rows, no_speech):
            row.prefilled = True
            row.no_speech_prob = probability
        return waiting

    def _choose(self, rows: list[Row], logits: torch.Tensor) -> list[Finished]:
        """Apply the rules to eager logits and choose each row's token."""
        if not rows:
            return []
        timestamp_begin = self.config.special.timestamp_begin
        facts = [row.rule_facts(timestamp_begin) for row in rows]
        table = torch.tensor(facts, dtype=torch.long).T.to(self.device, non_blocking=True)
        logits = self.rules.apply(logits, RuleFacts.from_table(table))
        if self.logit_observer is not None:
            self.logit_observer(rows, logits)
        temperatures = [r.options.temperature for r in rows]
        hot = torch.tensor(temperatures, device=self.device) if any(t > 0 for t in temperatures) else None
        chosen, logprobs = sample(logits, hot)
        return self._advance(rows, chosen.tolist(), logprobs.tolist())

    def _advance(self, rows: list[Row], tokens: list[int], logprobs: list[float]) -> list[Finished]:
        """Append each row's chosen token; retire the rows that finished."""
        eot = self.config.special.eot
        done = []
        for row, token, logprob in zip(rows, tokens, logprobs):
            if token == eot:
                done.append((row, True))
                continue
            row.generated.append(token)
            row.sum_logprob += logprob
            if len(row.generated) >= row.max_new_tokens:
                done.append((row, False))
            else:
                row.pending = [token]
        for row, completed in done:
            self._retire(row)
        return [(row.tag, row.result(completed)) for row, completed in done]


def decode(batch: DecodeBatch, requests: Sequence[tuple[torch.Tensor, DecodingOptions, Prompt]]) -> list[DecodingResult]:
    """Decode (features, options, prompt) requests to completion, admitting as
    many at a time as the batch has free slots."""
    queue = [Admission(i, *request) for i, request in enumerate(requests)]
    results: dict[int, DecodingResult] = {}
    while queue or batch.rows:
        n = min(len(queue), batch.free_slots)
        results.update(batch.admit(queue[:n]))
        queue = queue[n:]
        results.update(batch.step())
    return [results[i] for i in range(len(requests))]
