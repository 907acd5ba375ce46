"""Audio of any length, decoded 30 s window by window through the engine.

Two modes:
- SEQUENTIAL is Whisper's own algorithm: decode the window at `seek`, move
  `seek` to the last complete timestamp (or past the window), and condition the
  next window on the text so far. Best accuracy; windows of one recording run
  one after another (other requests still share the batch).
- BATCHED cuts the audio into chunks of at most 30 s that end in pauses
  (`chunking`), and runs the sequential seek inside each chunk, all chunks in
  parallel inside the continuous batch; their segments are stitched into
  absolute time. Faster for long audio; no conditioning on earlier text.

Both apply openai-whisper's quality controls: temperature fallback when the
text is too repetitive (gzip compression ratio) or too unlikely (average
log-probability), and skipping windows that are silent (no-speech probability
high and log-probability low).

A `LongFormJob` is a small state machine whose transitions run in engine
callbacks, so it never blocks the engine thread.
"""

from __future__ import annotations

import dataclasses
import threading
import zlib
from dataclasses import dataclass
from typing import Callable

import torch

from python_backend_lib.audio.features import content_frames, pad_or_trim
from python_backend_lib.core import geometry
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.model_facts import ModelConfig
from python_backend_lib.core.options import DecodingOptions, DecodingResult, LongFormMode, TranscribeOptions
from python_backend_lib.core.segments import Segment
from python_backend_lib.text.tokenizer import Tokenizer
from python_backend_lib.transcription.chunking import Chunk, frame_loudness, plan_chunks

# Conditioning on text decoded at a high temperature tends to propagate errors.
MAX_CONDITIONING_TEMPERATURE = 0.5


@dataclass(frozen=True)
class Transcript:
    text: str
    segments: tuple[Segment, ...]
    language: str | None
    language_probability: float | None
    duration: float  # seconds of audio
    windows: tuple[DecodingResult, ...]  # every accepted window, in order


# --------------------------------------------------------------- pure pieces


def compression_ratio(text: str) -> float:
    """Bytes over gzip'ed bytes: high for text that repeats itself."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def needs_fallback(result: DecodingResult, ratio: float, options: TranscribeOptions) -> bool:
    too_repetitive = options.compression_ratio_threshold is not None and ratio > options.compression_ratio_threshold
    too_unlikely = options.logprob_threshold is not None and result.avg_logprob < options.logprob_threshold
    return (too_repetitive or too_unlikely) and not is_silent(result, options)


def is_silent(result: DecodingResult, options: TranscribeOptions) -> bool:
    """openai-whisper's skip rule: likely no speech, and the text is not confident."""
    if options.no_speech_threshold is None or result.no_speech_prob <= options.no_speech_threshold:
        return False
    return options.logprob_threshold is None or result.avg_logprob < options.logprob_threshold


@dataclass(frozen=True)
class WindowOutcome:
    segments: tuple[Segment, ...]
    advance: int  # frames to move seek by


def split_window(
    tokens: tuple[int, ...],
    tokenizer: Tokenizer,
    seek: int,
    window_frames: int,
    result: DecodingResult,
    ratio: float,
    closes_chunk: bool = False,
) -> WindowOutcome:
    """Segments of one decoded window in absolute time, and how far to seek.

    When the window ends inside a segment (text after the last timestamp, with
    no timestamp closing it), the next window starts at that last timestamp, so
    the unfinished speech is decoded again whole: the window's end may have cut
    it. Unless `closes_chunk`: the window holds the rest of a chunk that ends in
    a pause, so nothing was cut, and the open segment ends with the chunk.
    """
    begin = tokenizer.special.timestamp_begin
    offset = seek / geometry.FRAMES_PER_SECOND
    window_seconds = window_frames / geometry.FRAMES_PER_SECOND
    is_ts = [t >= begin for t in tokens]
    single_ending = is_ts[-2:] == [False, True]
    boundaries = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]
    stats = dict(
        seek=seek,
        temperature=result.temperature,
        avg_logprob=result.avg_logprob,
        compression_ratio=ratio,
        no_speech_prob=result.no_speech_prob,
    )
    # Text after the last pair of timestamps: a segment the model left open.
    left_open = bool(boundaries) and any(t < tokenizer.special.eot for t in tokens[boundaries[-1] :])
    ends_here = single_ending or (closes_chunk and left_open)
    if boundaries:
        if ends_here:
            boundaries.append(len(tokens))
        segments, start = [], 0
        for end in boundaries:
            piece = tokens[start:end]
            segments.extend(tokenizer.segments(piece, duration=window_seconds, offset=offset))
            start = end
        if ends_here:
            advance = window_frames
        else:
            last_timestamp = tokens[start - 1] - begin
            advance = last_timestamp * geometry.ENCODER_STRIDE
    else:
        stamps = [t for t in tokens if t >= begin]
        duration = window_seconds
        if stamps and stamps[-1] != begin:
            duration = tokenizer.timestamp_seconds(stamps[-1])
        text_tokens = tuple(t for t in tokens if t < tokenizer.special.eot)
        text = tokenizer.decode(text_tokens).strip()
        segments = [Segment(offset, round(offset + duration, 3), text, tuple(tokens))] if text else []
        advance = window_frames
    return WindowOutcome(tuple(dataclasses.replace(s, **stats) for s in segments), max(advance, 1))


# ------------------------------------------------------------ the state machine

@dataclass(frozen=True)
class WindowAt:
    """One window to decode: where it starts, in which chunk, at which attempt
    (the index of its temperature)."""

    chunk: Chunk
    seek: int  # mel frame
    attempt: int = 0


Submit = Callable[..., None]  # Engine.submit(features, options, on_done, is_cancelled, content_frames=...)
# Aligner.add_words(segments, features, content_frames, offset, language, task)
AddWords = Callable[..., tuple[Segment, ...]]


class LongFormJob:
    """Transcribe one recording through the engine; `on_done` receives the
    `Transcript` or the exception (on the engine thread).

    The recording is one chunk in SEQUENTIAL mode and several in BATCHED mode.
    Inside a chunk, windows follow one another by Whisper's seek; the chunks of
    a BATCHED job advance side by side, from the start when the language is
    known (given, or an English-only checkpoint), else once the first window
    has detected it.
    """

    def __init__(
        self,
        submit: Submit,
        config: ModelConfig,
        tokenizer: Tokenizer,
        mel: torch.Tensor,
        duration: float,
        options: TranscribeOptions,
        on_done: Callable[[Transcript | BaseException], None],
        is_cancelled: Callable[[], bool] | None = None,
        add_words: AddWords | None = None,
    ) -> None:
        if options.word_timestamps and add_words is None:
            raise RequestError("word timestamps need a checkpoint with alignment heads")
        self.submit = submit
        self.add_words = add_words
        self.config = config
        self.tokenizer = tokenizer
        self.mel = mel
        self.duration = duration
        self.options = options
        self.on_done = on_done
        self.is_cancelled = is_cancelled
        self.content = content_frames(mel.shape[-1], duration)
        if options.mode is LongFormMode.BATCHED:
            self.chunks = plan_chunks(frame_loudness(mel), self.content)
        else:
            self.chunks = (Chunk(0, self.content),)
        self.language = options.decoding.language  # None until detected
        self.language_probability: float | None = None
        language_known = self.language is not None or not config.multilingual
        # The chunks that start once the first window has detected the language.
        self._after_first_window = () if language_known else self.chunks[1:]
        self._lock = threading.Lock()
        self._accepted: dict[int, tuple[WindowOutcome, DecodingResult]] = {}
        self._previous: list[int] = self._initial_prompt()
        self._pending = 0  # windows submitted or about to be, not yet handled
        self._failed = False
        self._finished = False

    def start(self) -> None:
        """Submit the first window; raises RequestError when the options do not
        fit the model (nothing is submitted then)."""
        if self.content == 0:
            self._finish()
            return
        first = [c for c in self.chunks if c not in self._after_first_window]
        with self._lock:
            self._pending = len(first)
        for chunk in first:
            self._decode(WindowAt(chunk, chunk.start))

    # -- windows

    def _window(self, chunk: Chunk, seek: int) -> tuple[torch.Tensor, int]:
        """The 3,000 frames decoded from `seek`, and how many of them hold the
        chunk's audio. Past the end of the audio the window holds its padding
        (silence), as openai-whisper and transformers pad it; past a chunk's
        cut inside the audio it holds silence too, so the model does not see,
        and half-transcribe, the next chunk's first words."""
        frames = min(geometry.N_FRAMES, chunk.end - seek)
        window = pad_or_trim(self.mel[:, seek : seek + geometry.N_FRAMES], geometry.N_FRAMES)
        if chunk.end < self.content:
            window = window.clone()
            window[:, frames:] = self.mel[:, self.content : self.content + 1]  # a padding frame: silence
        return window, frames

    def _decoding_options(self, seek: int, attempt: int) -> DecodingOptions:
        """The first window (and every window in BATCHED mode) sees the caller's
        prompt; later SEQUENTIAL windows see the text decoded so far instead."""
        changes = dict(temperature=self.options.temperatures[attempt], language=self.language)
        if seek > 0 and self.options.mode is LongFormMode.SEQUENTIAL:
            changes.update(previous_tokens=tuple(self._previous), prompt=None)
        return dataclasses.replace(self.options.decoding, **changes)

    def _decode(self, window: WindowAt) -> None:
        """Submit one window, already counted in `_pending`."""
        features, frames = self._window(window.chunk, window.seek)
        # A window of digital silence is answered as silent by the engine, undecoded.
        self.submit(
            features.contiguous(),
            self._decoding_options(window.seek, window.attempt),
            lambda outcome: self._on_window(window, outcome),
            self.is_cancelled,
            content_frames=frames,
        )

    def _on_window(self, window: WindowAt, outcome: DecodingResult | BaseException) -> None:
        try:
            self._handle(window, outcome)
        except BaseException as error:  # never leave the caller waiting
            self._fail(error)

    def _handle(self, window: WindowAt, outcome: DecodingResult | BaseException) -> None:
        chunk, seek, attempt = window.chunk, window.seek, window.attempt
        if isinstance(outcome, BaseException):
            self._fail(outcome)
            return
        if self._failed:
            return
        result = outcome
        ratio = compression_ratio(self.tokenizer.decode(result.tokens))
        if needs_fallback(result, ratio, self.options) and attempt + 1 < len(self.options.temperatures):
            self._next([dataclasses.replace(window, attempt=attempt + 1)])
            return
        if self.language is None and result.language is not None:
            self.language, self.language_probability = result.language, result.language_probability
        features, frames = self._window(chunk, seek)
        if is_silent(result, self.options):
            outcome = WindowOutcome((), frames)
        else:
            # A BATCHED window that reaches its chunk's end saw everything up to a pause.
            closes_chunk = self.options.mode is LongFormMode.BATCHED and seek + frames == chunk.end
            outcome = split_window(result.tokens, self.tokenizer, seek, frames, result, ratio, closes_chunk)
            if self.options.word_timestamps:
                # Runs on the engine thread, between decoder steps.
                segments = self.add_words(
                    outcome.segments, features, frames, seek / geometry.FRAMES_PER_SECOND,
                    self.language, self.options.decoding.task,
                )
                outcome = WindowOutcome(segments, outcome.advance)
        with self._lock:
            self._accepted[seek] = (outcome, result)
        if self.options.mode is LongFormMode.SEQUENTIAL:
            self._condition_on(outcome, result)
        later = [WindowAt(chunk, seek + outcome.advance)] if seek + outcome.advance < chunk.end else []
        if seek == 0:  # the language is known now
            later += [WindowAt(other, other.start) for other in self._after_first_window]
        self._next(later)

    def _condition_on(self, outcome: WindowOutcome, result: DecodingResult) -> None:
        """SEQUENTIAL: the next window sees the text so far, unless it was decoded
        too hot to trust."""
        for segment in outcome.segments:
            self._previous.extend(segment.tokens)
        if not self.options.condition_on_previous_text or result.temperature > MAX_CONDITIONING_TEMPERATURE:
            self._previous = []

    def _next(self, windows: list[WindowAt]) -> None:
        """One window is handled; submit the `windows` that follow it, or
        finish when none is left anywhere.

        They are counted before this one is uncounted, so that no other chunk
        can find the job finished while they are still being submitted.
        """
        with self._lock:
            self._pending += len(windows) - 1
            done = self._pending == 0
        for window in windows:
            self._decode(window)
        if done:
            self._finish()

    def _initial_prompt(self) -> list[int]:
        """openai-whisper conditions later windows on the initial prompt too, until
        the first reset."""
        prompt = self.options.decoding.prompt
        return self.tokenizer.encode(" " + prompt.strip()) if prompt and prompt.strip() else []

    # -- the end

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._failed or self._finished:
                return
            self._failed = True
        self.on_done(error)

    def _finish(self) -> None:
        with self._lock:
            if self._failed or self._finished:
                return
            self._finished = True
        ordered = [self._accepted[seek] for seek in sorted(self._accepted)]
        segments = [s for outcome, _ in ordered for s in outcome.segments]
        segments = [dataclasses.replace(s, id=i) for i, s in enumerate(segments)]
        text_tokens = [t for s in segments for t in s.tokens]
        self.on_done(
            Transcript(
                text=self.tokenizer.decode(text_tokens).strip(),
                segments=tuple(segments),
                # English-only checkpoints know their language even when no window was decoded.
                language=self.language if self.config.multilingual else "en",
                language_probability=self.language_probability,
                duration=self.duration,
                windows=tuple(result for _, result in ordered),
            )
        )
