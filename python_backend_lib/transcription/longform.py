"""Audio of any length, decoded 30 s window by window through the engine.

Two modes:
- SEQUENTIAL is Whisper's own algorithm: decode the window at `seek`, move
  `seek` to the last complete timestamp (or past the window), and condition the
  next window on the text so far. Best accuracy; windows of one recording run
  one after another (other requests still share the batch).
- BATCHED cuts the audio into back-to-back 30 s windows that are decoded in
  parallel inside the continuous batch, then stitches their segments into
  absolute time. Faster for long audio; no conditioning across windows, and a
  word cut at a window edge may be garbled.

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
    tokens: tuple[int, ...], tokenizer: Tokenizer, seek: int, window_frames: int, result: DecodingResult, ratio: float
) -> WindowOutcome:
    """Segments of one decoded window in absolute time, and how far to seek.

    When the window ends inside a segment (its last two tokens are timestamps
    closing one segment and opening the next), the next window starts at that
    last timestamp, so the unfinished speech is decoded again whole.
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
    if boundaries:
        if single_ending:
            boundaries.append(len(tokens))
        segments, start = [], 0
        for end in boundaries:
            piece = tokens[start:end]
            segments.extend(tokenizer.segments(piece, duration=window_seconds, offset=offset))
            start = end
        if single_ending:
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

Submit = Callable[..., None]  # Engine.submit(features, options, on_done, is_cancelled, content_frames=...)
# Aligner.add_words(segments, features, content_frames, offset, language, task)
AddWords = Callable[..., tuple[Segment, ...]]


class LongFormJob:
    """Transcribe one recording through the engine; `on_done` receives the
    `Transcript` or the exception (on the engine thread)."""

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
        self.language = options.decoding.language  # None until detected
        self.language_probability: float | None = None
        self._lock = threading.Lock()
        self._accepted: dict[int, tuple[WindowOutcome, DecodingResult]] = {}
        self._previous: list[int] = self._initial_prompt()
        self._pending = 0
        self._failed = False
        self._finished = False

    def start(self) -> None:
        """Submit the first window; raises RequestError when the options do not
        fit the model (nothing is submitted then)."""
        if self.content == 0:
            self._finish()
            return
        self._decode(0, 0)

    # -- windows

    def _window(self, seek: int) -> tuple[torch.Tensor, int]:
        """The 3,000 frames decoded from `seek`, and how many of them hold audio.
        Past the end of short audio the window is padded with zeros, as
        openai-whisper and transformers pad it."""
        frames = min(geometry.N_FRAMES, self.content - seek)
        return pad_or_trim(self.mel[:, seek : seek + geometry.N_FRAMES], geometry.N_FRAMES), frames

    def _decoding_options(self, seek: int, attempt: int) -> DecodingOptions:
        """The first window (and every window in BATCHED mode) sees the caller's
        prompt; later SEQUENTIAL windows see the text decoded so far instead."""
        changes = dict(temperature=self.options.temperatures[attempt], language=self.language)
        if seek > 0 and self.options.mode is LongFormMode.SEQUENTIAL:
            changes.update(previous_tokens=tuple(self._previous), prompt=None)
        return dataclasses.replace(self.options.decoding, **changes)

    def _decode(self, seek: int, attempt: int, reserved: bool = False) -> None:
        """Submit one window; `reserved` when the caller already counted it."""
        features, frames = self._window(seek)
        if not reserved:
            with self._lock:
                self._pending += 1
        # A window of digital silence is answered as silent by the engine, undecoded.
        self.submit(
            features.contiguous(),
            self._decoding_options(seek, attempt),
            lambda outcome: self._on_window(seek, attempt, outcome),
            self.is_cancelled,
            content_frames=frames,
        )

    def _on_window(self, seek: int, attempt: int, outcome: DecodingResult | BaseException) -> None:
        try:
            self._handle(seek, attempt, outcome)
        except BaseException as error:  # never leave the caller waiting
            self._fail(error)

    def _handle(self, seek: int, attempt: int, outcome: DecodingResult | BaseException) -> None:
        with self._lock:
            self._pending -= 1
        if isinstance(outcome, BaseException):
            self._fail(outcome)
            return
        if self._failed:
            return
        result = outcome
        ratio = compression_ratio(self.tokenizer.decode(result.tokens))
        if needs_fallback(result, ratio, self.options) and attempt + 1 < len(self.options.temperatures):
            self._decode(seek, attempt + 1)
            return
        if self.language is None and result.language is not None:
            self.language, self.language_probability = result.language, result.language_probability
        features, frames = self._window(seek)
        if is_silent(result, self.options):
            outcome = WindowOutcome((), frames)
        else:
            outcome = split_window(result.tokens, self.tokenizer, seek, frames, result, ratio)
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
            self._after_sequential(seek, outcome, result)
        else:
            self._after_batched(seek)

    def _after_sequential(self, seek: int, outcome: WindowOutcome, result: DecodingResult) -> None:
        for segment in outcome.segments:
            self._previous.extend(segment.tokens)
        if not self.options.condition_on_previous_text or result.temperature > MAX_CONDITIONING_TEMPERATURE:
            self._previous = []
        next_seek = seek + outcome.advance
        if next_seek < self.content:
            self._decode(next_seek, 0)
        else:
            self._finish()

    def _after_batched(self, seek: int) -> None:
        if seek == 0 and self.content > geometry.N_FRAMES:
            # The first window fixed the language; the rest run in parallel.
            # Count them all before submitting any, so that none can see the
            # job as finished while others are still being submitted.
            later = range(geometry.N_FRAMES, self.content, geometry.N_FRAMES)
            with self._lock:
                self._pending += len(later)
            for window_seek in later:
                self._decode(window_seek, 0, reserved=True)
            return
        with self._lock:
            done = self._pending == 0
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
