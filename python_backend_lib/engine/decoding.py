"""Whisper's decoding rules, and a batch of requests decoded one step at a time.

`initial_tokens` builds each request's start-of-transcript sequence. `LogitRules`
applies Whisper's logit filters to a whole batch at once, each rule a masked
fill over [rows, vocab] with per-row inputs, so a batch of requests with
different options needs one pass and no host round trip per rule.
`DecodeBatch` owns the rows being decoded: it admits new requests (encoding
them together), runs one decoder step over every row, and hands back the
requests that finished. The engine drives it from a thread; `decode` drives it
to completion for offline use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from python_backend_lib.checkpoints.weights import TIME_PRECISION_S, ModelConfig
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.options import MAX_PROMPT_TOKENS, DecodingOptions, DecodingResult, Task
from python_backend_lib.engine.attention import AttentionBackend, StepLayout
from python_backend_lib.engine.kv_cache import KVSlotPool
from python_backend_lib.engine.model import Whisper
from python_backend_lib.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from python_backend_lib.engine.cuda_graphs import DecodeGraphs

NEG_INF = float("-inf")
N_RULE_FACTS = 8  # values per row in `Row.rule_facts`, rows of `RuleInputs.from_table`
# Receives the rows sampled at a step and their filtered logits [rows, vocab].
LogitObserver = Callable[[Sequence["Row"], torch.Tensor], None]


# ------------------------------------------------------------------ initial tokens


@dataclass(frozen=True)
class Prompt:
    """The tokens fed before the first generated one.

    tokens: [<|startofprev|> prompt...] <|startoftranscript|> [language task] [<|notimestamps|>]
    sot_index: where <|startoftranscript|> sits (the no-speech probability is read there).
    detect_language: the tokens stop at <|startoftranscript|>; language and task
        follow once the language has been detected from the logits there.
    """

    tokens: tuple[int, ...]
    sot_index: int
    detect_language: bool
    language: str | None


def initial_tokens(config: ModelConfig, options: DecodingOptions, tokenizer: Tokenizer | None) -> Prompt:
    """Raises ValueError when the options do not fit the checkpoint."""
    special = config.special
    language = options.language
    if not config.multilingual:
        if options.task is Task.TRANSLATE:
            raise RequestError("task 'translate' needs a multilingual checkpoint; this one is English-only")
        if language not in (None, "en"):
            raise RequestError(f"this checkpoint is English-only; language {language!r} is not supported")
        language = "en"
    elif language is not None:
        language = language.lower()
        if language not in special.language_codes:
            raise RequestError(f"unknown language code {options.language!r}")
    tokens: list[int] = []
    if options.previous_tokens:
        tokens = [special.startofprev, *options.previous_tokens[-MAX_PROMPT_TOKENS:]]
    elif options.prompt is not None and options.prompt.strip():
        if tokenizer is None:
            raise ValueError("a prompt needs a checkpoint with a tokenizer")
        prompt_tokens = tokenizer.encode(" " + options.prompt.strip())
        if len(prompt_tokens) > MAX_PROMPT_TOKENS:
            raise RequestError(
                f"prompt is {len(prompt_tokens)} tokens long; the model allows at most {MAX_PROMPT_TOKENS}"
            )
        tokens = [special.startofprev, *prompt_tokens]
    sot_index = len(tokens)
    tokens.append(special.sot)
    detect = config.multilingual and language is None
    if not detect:
        tokens.extend(task_tokens(config, language, options))
    return Prompt(tuple(tokens), sot_index, detect, language)


def task_tokens(config: ModelConfig, language: str, options: DecodingOptions) -> list[int]:
    """What follows <|startoftranscript|>: language and task (multilingual only),
    then <|notimestamps|> unless timestamps were asked for."""
    special = config.special
    tokens = []
    if config.multilingual:
        task = special.translate if options.task is Task.TRANSLATE else special.transcribe
        tokens += [special.language_token(language), task]
    if not options.timestamps:
        tokens.append(special.no_timestamps)
    return tokens


# --------------------------------------------------------------------- logit rules


@dataclass(frozen=True)
class RuleInputs:
    """Per-row facts the rules need, as [B] device tensors."""

    at_begin: torch.Tensor  # no token generated yet
    suppress_blank: torch.Tensor
    timestamps: torch.Tensor
    last_is_timestamp: torch.Tensor
    penultimate_is_timestamp: torch.Tensor  # also true when fewer than two tokens exist
    last_timestamp: torch.Tensor  # id of the last timestamp token, or -1
    max_initial: torch.Tensor  # last allowed first-timestamp id
    end_allowed: torch.Tensor  # min_new_tokens reached

    @classmethod
    def from_rows(cls, rows: Sequence["Row"], timestamp_begin: int, device: torch.device) -> "RuleInputs":
        facts = [row.rule_facts(timestamp_begin) for row in rows]
        return cls.from_table(torch.tensor(facts, dtype=torch.long).T.to(device, non_blocking=True))

    @classmethod
    def from_table(cls, table: torch.Tensor) -> "RuleInputs":
        """table: [N_RULE_FACTS, B] long, rows in `Row.rule_facts` order (a CUDA
        graph reads it from a fixed buffer)."""
        at_begin, blank, stamps, last, penult, last_ts, max_init, end = table
        return cls(
            at_begin.bool(), blank.bool(), stamps.bool(), last.bool(), penult.bool(), last_ts, max_init, end.bool()
        )


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

    def apply(self, logits: torch.Tensor, rows: RuleInputs) -> torch.Tensor:
        """logits [B, vocab] -> filtered logits [B, vocab] (a new tensor)."""
        col = lambda flags: flags[:, None]  # noqa: E731  [B] -> [B, 1]
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


# ------------------------------------------------------------------------ rows


@dataclass(eq=False)  # rows are compared by identity
class Row:
    """The decoding state of one request."""

    tag: Any
    options: DecodingOptions
    prompt: Prompt
    slot: int
    max_new_tokens: int
    pending: list[int]  # tokens to feed at the next step
    cached: int = 0  # tokens already in the KV cache
    generated: list[int] = field(default_factory=list)
    sum_logprob: float = 0.0
    no_speech_prob: float = float("nan")
    language: str | None = None
    language_probability: float | None = None
    prefilled: bool = False
    # (generated list, tokens scanned, last timestamp among them): rule_facts scans only new tokens
    _timestamp_scan: tuple = field(default=(None, 0, -1), repr=False)

    def rule_facts(self, timestamp_begin: int) -> tuple[int, ...]:
        tokens = self.generated
        scanned_list, scanned, last_ts = self._timestamp_scan
        if scanned_list is not tokens or scanned > len(tokens):
            scanned, last_ts = 0, -1
        for t in tokens[scanned:]:
            if t >= timestamp_begin:
                last_ts = t
        self._timestamp_scan = (tokens, len(tokens), last_ts)
        max_initial = timestamp_begin + round(self.options.max_initial_timestamp / TIME_PRECISION_S)
        return (
            not tokens,
            self.options.suppress_blank,
            self.options.timestamps,
            bool(tokens) and tokens[-1] >= timestamp_begin,
            len(tokens) < 2 or tokens[-2] >= timestamp_begin,
            last_ts,
            max_initial,
            len(tokens) >= self.options.min_new_tokens,
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


@dataclass
class StepCounts:
    """What `DecodeBatch.step` did so far (monitoring; read from any thread).

    graph_replays: steps whose one-token rows replayed a captured CUDA graph.
    eager_passes: eager decoder passes (prompt rows, no graphs, or too many rows).
    graph_fallbacks: steps that had graphs but ran eagerly because no bucket held the rows.
    """

    graph_replays: int = 0
    eager_passes: int = 0
    graph_fallbacks: int = 0


# A row's fields that a step changes, as `DecodeBatch.checkpoint` saves them.
_RowState = tuple[Row, list[int], int, int, float, bool, float, "str | None", "float | None"]


@dataclass(frozen=True)
class Admission:
    """A request ready to join a batch."""

    tag: Any
    features: torch.Tensor  # [n_mels, 3000]
    options: DecodingOptions
    prompt: Prompt


class DecodeBatch:
    """The requests being decoded together, stepped one token at a time.

    Rows join (`admit`) and leave (`step`'s finished list, `drop`) between steps;
    each row's tokens depend only on its own audio and options.
    """

    def __init__(
        self,
        model: Whisper,
        config: ModelConfig,
        attention: AttentionBackend,
        graphs: "DecodeGraphs | None" = None,
    ) -> None:
        """graphs: captured decode steps (GPU); rows with one pending token then
        step through them, and prompt rows step eagerly beside them."""
        self.model = model
        self.config = config
        self.attention = attention
        self.graphs = graphs
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

    @torch.inference_mode()
    def admit(self, admissions: Sequence[Admission]) -> None:
        """Encode the new requests together and store their cross-attention K/V."""
        if not admissions:
            return
        # Each clip to the device first (pinned features copy asynchronously), then stacked there.
        mel = torch.stack([a.features.to(self.device, non_blocking=True) for a in admissions]).to(self.dtype)
        audio = self.model.encode(mel, self.attention)
        slots = [self.pool.allocate() for _ in admissions]
        try:
            self.pool.write_cross(torch.tensor(slots, device=self.device), self.model.cross_kv(audio))
        except BaseException:  # e.g. out of memory: the slots hold nothing yet
            for slot in slots:
                self.pool.release(slot)
            raise
        text_ctx = self.config.dims.n_text_ctx
        for admission, slot in zip(admissions, slots):
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

    def drop(self, tag: Any) -> bool:
        """Remove a request (cancelled by its client) and free its slot."""
        for row in self.rows:
            if row.tag is tag:
                self.rows.remove(row)
                self.pool.release(row.slot)
                return True
        return False

    def checkpoint(self) -> list[_RowState]:
        """Every row's step-changed fields, for `rewind` after a step that raised.

        A step is not atomic: it changes rows before its last device work (which
        is where a bad row or a CUDA error shows). One tuple per row; `pending` is
        kept by reference, since a step replaces a row's pending list, never edits it.
        """
        return [
            (r, r.pending, r.cached, len(r.generated), r.sum_logprob, r.prefilled,
             r.no_speech_prob, r.language, r.language_probability)
            for r in self.rows
        ]  # fmt: skip

    def rewind(self, saved: Sequence[_RowState]) -> list[Row]:
        """Put the rows back as `checkpoint` saw them; the step that raised may then be
        run again (it rewrites the same KV positions). Returns the rows that left
        the batch inside that step: their results are lost and their slots freed."""
        present = set(self.rows)
        left = []
        for row, pending, cached, n_generated, sum_logprob, prefilled, no_speech, language, probability in saved:
            if row not in present:
                left.append(row)
                continue
            row.pending, row.cached, row.sum_logprob, row.prefilled = pending, cached, sum_logprob, prefilled
            row.no_speech_prob, row.language, row.language_probability = no_speech, language, probability
            del row.generated[n_generated:]
        return left

    @torch.inference_mode()
    def step(self, rows: Sequence[Row] | None = None) -> list[tuple[Any, DecodingResult]]:
        """One decoder pass over `rows` (default: every row); returns the rows that finished."""
        rows = list(self.rows if rows is None else rows)
        if not rows:
            return []
        if self.graphs is None:
            self.counts.eager_passes += 1
            return self._step_eager(rows)
        # Rows past their prompt feed one token each: a captured graph runs them
        # when one is large enough. Prompt rows run eagerly in the same step.
        decoding = [r for r in rows if r.prefilled and len(r.pending) == 1]
        if not self.graphs.fits(len(decoding)):
            self.counts.graph_fallbacks += 1
            self.counts.eager_passes += 1
            return self._step_eager(rows)
        prompting = [r for r in rows if not (r.prefilled and len(r.pending) == 1)]
        done = []
        if prompting:
            self.counts.eager_passes += 1
            done = self._step_eager(prompting)
        self.counts.graph_replays += 1
        return done + self._step_graph(decoding)

    def _step_graph(self, rows: list[Row]) -> list[tuple[Any, DecodingResult]]:
        step = self.graphs.run(rows)
        tokens, logprobs = step.tokens, step.logprobs
        hot = [i for i, r in enumerate(rows) if r.options.temperature > 0]
        if hot:  # sampled rows draw from the graph's filtered logits
            logits = step.logits[torch.tensor(hot, device=self.device)].float()
            temperatures = torch.tensor([rows[i].options.temperature for i in hot], device=self.device)
            scaled = logits / temperatures.clamp(min=1e-6)[:, None]
            sampled = torch.multinomial(scaled.softmax(dim=-1), 1)
            chosen_logprobs = torch.log_softmax(logits, dim=-1).gather(1, sampled).squeeze(1).tolist()
            for k, token in enumerate(sampled.squeeze(1).tolist()):
                tokens[hot[k]], logprobs[hot[k]] = token, chosen_logprobs[k]
        if self.logit_observer is not None:
            self.logit_observer(rows, step.logits)
        for row in rows:
            row.cached += 1
            row.pending = []
        return self._advance(rows, tokens, logprobs)

    def _step_eager(self, rows: list[Row]) -> list[tuple[Any, DecodingResult]]:
        device = self.device
        layout = StepLayout(
            slots=torch.tensor([r.slot for r in rows], device=device),
            query_lens=tuple(len(r.pending) for r in rows),
            cached_lens=tuple(r.cached for r in rows),
            slot_ids=tuple(r.slot for r in rows),
        )
        tokens = torch.tensor([t for r in rows for t in r.pending], device=device)
        last = layout.last_token_index(device)
        # Rows seeing their prompt for the first time also need the logits at
        # <|startoftranscript|> (no-speech probability, language detection).
        fresh = [i for i, r in enumerate(rows) if not r.prefilled]
        starts = [sum(layout.query_lens[:i]) + rows[i].prompt.sot_index for i in fresh]
        index = torch.cat([last, torch.tensor(starts, device=device, dtype=last.dtype)])
        logits = self.model.decode_step(tokens, layout, self.attention, index)
        logits, sot_logits = logits[: len(rows)], logits[len(rows) :]
        for row in rows:
            row.cached += len(row.pending)
            row.pending = []
        waiting = self._read_start_of_transcript(rows, fresh, sot_logits)
        sampling = [i for i, r in enumerate(rows) if r not in waiting]
        return self._sample([rows[i] for i in sampling], logits[sampling])

    def _read_start_of_transcript(self, rows: list[Row], fresh: list[int], sot_logits: torch.Tensor) -> list[Row]:
        """Record no-speech probabilities and detect languages; return the rows
        that sample no token at this step (they feed their task tokens next)."""
        special = self.config.special
        if fresh:
            no_speech = sot_logits.float().softmax(dim=-1)[:, special.nospeech].tolist()
            language_probs = sot_logits[:, list(special.language_tokens)].float().softmax(dim=-1)
            best = language_probs.max(dim=-1)
            detected, confidence = best.indices.tolist(), best.values.tolist()
        waiting = []
        for k, i in enumerate(fresh):
            row = rows[i]
            row.prefilled = True
            row.no_speech_prob = no_speech[k]
            if row.prompt.detect_language and row.language is None:
                row.language = special.language_codes[detected[k]]
                row.language_probability = confidence[k]
                row.pending = task_tokens(self.config, row.language, row.options)
                waiting.append(row)
        return waiting

    def _sample(self, rows: list[Row], logits: torch.Tensor) -> list[tuple[Any, DecodingResult]]:
        if not rows:
            return []
        special = self.config.special
        logits = self.rules.apply(logits, RuleInputs.from_rows(rows, special.timestamp_begin, self.device))
        if self.logit_observer is not None:
            self.logit_observer(rows, logits)
        temperatures = torch.tensor([r.options.temperature for r in rows], device=self.device)
        greedy = logits.argmax(dim=-1)
        if bool((temperatures > 0).any()):
            scaled = logits.float() / temperatures.clamp(min=1e-6)[:, None]
            sampled = torch.multinomial(scaled.softmax(dim=-1), 1).squeeze(1)
            chosen = torch.where(temperatures > 0, sampled, greedy)
        else:
            chosen = greedy
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, chosen[:, None]).squeeze(1)
        return self._advance(rows, chosen.tolist(), logprobs.tolist())

    def _advance(
        self, rows: list[Row], tokens: list[int], logprobs: list[float]
    ) -> list[tuple[Any, DecodingResult]]:
        """Append each row's chosen token; retire the rows that finished."""
        special = self.config.special
        finished = []
        for row, token, logprob in zip(rows, tokens, logprobs):
            if token == special.eot:
                finished.append((row, True))
                continue
            row.generated.append(token)
            row.sum_logprob += logprob
            if len(row.generated) >= row.max_new_tokens:
                finished.append((row, False))
            else:
                row.pending = [token]
        done = []
        for row, completed in finished:
            self.rows.remove(row)
            self.pool.release(row.slot)
            done.append((row.tag, row.result(completed)))
        return done


def decode(
    batch: DecodeBatch, requests: Sequence[tuple[torch.Tensor, DecodingOptions, Prompt]]
) -> list[DecodingResult]:
    """Decode (features, options, prompt) requests to completion, admitting as
    many at a time as the batch has free slots."""
    queue = [Admission(i, *request) for i, request in enumerate(requests)]
    results: dict[int, DecodingResult] = {}
    while queue or batch.rows:
        n = min(len(queue), batch.free_slots)
        batch.admit(queue[:n])
        queue = queue[n:]
        results.update(batch.step())
    return [results[i] for i in range(len(requests))]
