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
callbacks, so it never blocks the engine thread. Given `on_progress`, it also
reports the recording decoded so far whenever its settled beginning grows (the
windows from the start with no gap left before them): the streamed path's
partial transcripts, made by the same rules as the whole one. Where it can, it
reports each segment as the decoder ends it, too (`_on_segment`): the window in
progress after the settled ones, up to its last complete segment. That window is
provisional: a temperature fallback may decode it again, to other text.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import zlib
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from python_backend_lib.core import geometry
from python_backend_lib.core.decoded import DecodedRecording, DecodedWindow
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.model_facts import ModelConfig
from python_backend_lib.core.options import (
    DecodingOptions,
    DecodingResult,
    LongFormMode,
    TranscribeOptions,
    WindowPadding,
)
from python_backend_lib.core.segments import Segment
from python_backend_lib.engine.draws import window_seed
from python_backend_lib.text.tokenizer import Tokenizer
from python_backend_lib.text.windows import WindowSegments, window_segments
from python_backend_lib.text.words import with_words
from python_backend_lib.transcription.alignment import Aligned, AlignmentRequest
from python_backend_lib.transcription.chunking import Chunk, frame_loudness, plan_chunks
from python_backend_lib.transcription.hallucination import cut_window, first_segments

log = logging.getLogger(__name__)

# Conditioning on text decoded at a high temperature tends to propagate errors.
MAX_CONDITIONING_TEMPERATURE = 0.5


# --------------------------------------------------------------- pure pieces


def compression_ratio(text: str) -> float:
    """Bytes over gzip'ed bytes (`zlib.compress`, as openai-whisper measures them): high for
    text that repeats itself."""
    data = text.encode("utf-8")
    return len(data) / compressed_size(data) if data else 0.0


# The window of `zlib.compress`, and the smallest zlib takes.
ZLIB_WINDOW_BITS, ZLIB_MIN_WINDOW_BITS = 15, 9
ZLIB_MIN_LOOKAHEAD = 262  # deflate keeps this much of its window for lookahead
# zlib.compress takes a window size from Python 3.11; before, a compressor object does.
ONE_CALL = sys.version_info >= (3, 11)


def compressed_size(data: bytes) -> int:
    """len(zlib.compress(data)), with a window just large enough for `data`.

    This runs on the engine thread for every window decoded. `zlib.compress` sets up
    a 32 KiB window (and its match chains) for a sentence of text; a window that holds
    the whole input, lookahead included, never slides, so deflate finds the same
    matches and writes the same number of bytes, at a fraction of the set-up. One call,
    as before: zlib lets go of the interpreter lock around each deflate, and the engine
    thread may wait to get it back.
    """
    window_bits = max(ZLIB_MIN_WINDOW_BITS, (len(data) + ZLIB_MIN_LOOKAHEAD - 1).bit_length())
    if window_bits >= ZLIB_WINDOW_BITS:
        return len(zlib.compress(data))
    if ONE_CALL:
        return len(zlib.compress(data, zlib.Z_DEFAULT_COMPRESSION, window_bits))
    compressor = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, window_bits)
    return len(compressor.compress(data)) + len(compressor.flush())


def needs_fallback(result: DecodingResult, ratio: float, options: TranscribeOptions) -> bool:
    too_repetitive = options.compression_ratio_threshold is not None and ratio > options.compression_ratio_threshold
    too_unlikely = options.logprob_threshold is not None and result.avg_logprob < options.logprob_threshold
    return (too_repetitive or too_unlikely) and not is_silent(result, options)


def is_silent(result: DecodingResult, options: TranscribeOptions) -> bool:
    """openai-whisper's skip rule: likely no speech, and the text is not confident."""
    if options.no_speech_threshold is None or result.no_speech_prob <= options.no_speech_threshold:
        return False
    return options.logprob_threshold is None or result.avg_logprob < options.logprob_threshold


def _frames(chunk: Chunk, seek: int) -> int:
    """Frames of the window at `seek` that hold its chunk's audio."""
    return min(geometry.N_FRAMES, chunk.end - seek)


# ------------------------------------------------------------ the state machine

@dataclass(frozen=True)
class WindowAt:
    """One window to decode: where it starts, in which chunk, at which attempt
    (the index of its temperature)."""

    chunk: Chunk
    seek: int  # mel frame
    attempt: int = 0


# Engine.submit(features, options, on_done, is_cancelled, content_frames=..., keep_audio=..., live=...)
Submit = Callable[..., None]
# AlignmentRounds.align(request, then): `then` later gets (token times, probabilities) or the error
Align = Callable[[AlignmentRequest, Callable[[Aligned | BaseException], None]], None]


class LongFormJob:
    """Decode one recording through the engine; `on_done` receives its
    `DecodedRecording` or the exception (on the engine thread).

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
        samples: int,
        options: TranscribeOptions,
        on_done: Callable[[DecodedRecording | BaseException], None],
        is_cancelled: Callable[[], bool] | None = None,
        align: Align | None = None,
        on_progress: Callable[[DecodedRecording], None] | None = None,
    ) -> None:
        """mel: the recording's log-mel (`audio.features.features_for`), whole or without
        its padding (`without_padding`; `_window` says how windows are padded);
        samples: the recording's length. on_progress: called (on the engine thread) with
        the settled windows so far each time there are more of them, before `on_done`."""
        if options.word_timestamps and align is None:
            raise RequestError("word timestamps need a checkpoint with alignment heads")
        self.submit = submit
        self.align = align
        self.config = config
        self.tokenizer = tokenizer
        self.mel = mel
        self.samples = samples
        self.options = options
        self.on_done = on_done
        self.on_progress = on_progress
        self.is_cancelled = is_cancelled
        self.content = geometry.content_frames(samples)
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
        self._accepted: dict[int, DecodedWindow] = {}  # by seek
        self._follows: dict[int, int] = {}  # accepted seek -> where the next window of the recording starts
        self._settled = 0  # windows from the start with no gap before them, last reported
        self._previous: list[int] = self._initial_prompt()
        self._last_speech = 0.0  # end of the last word kept (hallucination_silence_threshold)
        self._pending = 0  # windows submitted or about to be, not yet handled
        self._failed = False
        self._finished = False
        # Segments reported as the decoder ends them: in SEQUENTIAL mode, where the window in
        # progress is the one after the settled ones, and with nothing decided at the window's
        # end but the fallback (word timestamps align, and the hallucination check reads
        # words, once the window is decoded); segments need timestamps.
        self._streams_segments = (
            on_progress is not None
            and options.mode is LongFormMode.SEQUENTIAL
            and options.decoding.timestamps
            and not options.word_timestamps
            and options.hallucination_silence_threshold is None
        )

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
        chunk's audio. Past the end of the audio, the window is padded as
        `options.window_padding` says: by default with zeros of the normalised
        log-mel, as openai-whisper and faster-whisper pad every window; as
        transformers pads it, a recording of up to 30 s is one window padded
        with silence (short-form `generate`: the features' own padding, or,
        where they travelled without it, their last frame repeated, the same
        values), and a longer recording's last window with those zeros
        (long-form `generate`). Past a chunk's cut inside the audio the window holds
        silence, so the model does not see, and half-transcribe, the next
        chunk's first words."""
        frames = _frames(chunk, seek)
        audio_frames = self.content - seek
        zeros = self.samples > geometry.N_SAMPLES or self.options.window_padding is WindowPadding.OPENAI_WHISPER
        if zeros and audio_frames < geometry.N_FRAMES:
            # The audio's frames, then zeros: two launches from execute's thread, which
            # shares the interpreter lock with the engine's. (A window starts inside the
            # audio, and the mel holds at least one frame past it: `geometry.reached_frames`.)
            window = self.mel.new_zeros((self.mel.shape[0], geometry.N_FRAMES))
            window[:, :audio_frames] = self.mel[:, seek : self.content]
        else:
            window = self.mel[:, seek : seek + geometry.N_FRAMES]
            if window.shape[-1] < geometry.N_FRAMES:
                padding = self.mel[:, -1:].expand(-1, geometry.N_FRAMES - window.shape[-1])
                window = torch.cat([window, padding], dim=1)
        if chunk.end < self.content:
            window = window.clone()
            window[:, frames:] = self.mel[:, self.content : self.content + 1]  # a padding frame: silence
        return window, frames

    def _decoding_options(self, seek: int, attempt: int) -> DecodingOptions:
        """The first window (and every window in BATCHED mode) sees the caller's
        prompt; later SEQUENTIAL windows see the text decoded so far instead."""
        changes = dict(temperature=self.options.temperatures[attempt], language=self.language,
                       seed=window_seed(self.options.decoding.seed, seek, attempt))
        if seek > 0 and self.options.mode is LongFormMode.SEQUENTIAL:
            changes.update(previous_tokens=tuple(self._previous), prompt=None)
        return dataclasses.replace(self.options.decoding, **changes)

    def _decode(self, window: WindowAt) -> None:
        """Submit one window, already counted in `_pending`."""
        features, frames = self._window(window.chunk, window.seek)
        streamed = {"on_segment": partial(self._on_segment, window)} if self._streams_segments else {}
        # A window of digital silence is answered as silent by the engine, undecoded.
        self.submit(
            features.contiguous(),
            self._decoding_options(window.seek, window.attempt),
            lambda outcome: self._on_window(window, outcome),
            self.is_cancelled,
            content_frames=frames,
            keep_audio=self.options.word_timestamps,  # aligned on the K/V the decoding used
            live=self.options.live,
            **streamed,
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
        frames = _frames(chunk, seek)
        decoded = DecodedWindow(
            tokens=result.tokens,
            seek=seek,
            frames=frames,
            temperature=result.temperature,
            avg_logprob=result.avg_logprob,
            compression_ratio=ratio,
            no_speech_prob=result.no_speech_prob,
            silent=is_silent(result, self.options),
            # A BATCHED window that reaches its chunk's end saw everything up to a pause.
            closes_chunk=self.options.mode is LongFormMode.BATCHED and seek + frames == chunk.end,
        )
        split = window_segments(decoded, self.tokenizer)
        if self.options.word_timestamps and split.segments:
            # Aligned on the engine thread, with the other windows its step delivered, on
            # the window's encoder K/V still in its slot (else, encoded again from its features).
            features = None if result.audio_slot is not None else self._window(chunk, seek)[0]
            request = AlignmentRequest(split.segments, features, frames, self.language, self.options.decoding.task,
                                       result.audio_slot)
            self.align(request, partial(self._aligned, window, result, decoded, split))
            return
        self._settle(window, result, decoded, split)

    def _aligned(self, window: WindowAt, result: DecodingResult, decoded: DecodedWindow, split: WindowSegments,
                 outcome: Aligned | BaseException) -> None:
        """The window's word alignment (`alignment_rounds`): settle the window with it."""
        try:
            if isinstance(outcome, BaseException):
                raise outcome
            if self._failed:
                return
            times, probabilities = outcome
            self._settle(window, result, dataclasses.replace(decoded, token_times=times,
                                                             token_probabilities=probabilities), split)
        except BaseException as error:  # never leave the caller waiting
            self._fail(error)

    def _settle(self, window: WindowAt, result: DecodingResult, decoded: DecodedWindow, split: WindowSegments) -> None:
        """Keep the decoded window (its hallucinations cut) and go on past it."""
        chunk, seek = window.chunk, window.seek
        segments, next_seek = split.segments, seek + split.advance
        if self.options.hallucination_silence_threshold is not None and segments:
            decoded, segments, next_seek = self._without_hallucinations(decoded, segments, next_seek)
            if decoded is None:  # decode again from past the silence
                self._next([WindowAt(chunk, next_seek)] if next_seek < chunk.end else [])
                return
        with self._lock:
            self._accepted[seek] = decoded
            # Past its chunk's end the recording goes on at the next chunk's start, which is that end.
            self._follows[seek] = min(seek + split.advance, chunk.end)
        if self.options.mode is LongFormMode.SEQUENTIAL:
            self._condition_on(segments, result)
        later = [WindowAt(chunk, next_seek)] if next_seek < chunk.end else []
        if seek == 0:  # the language is known now
            later += [WindowAt(other, other.start) for other in self._after_first_window]
        self._next(later)

    def _without_hallucinations(
        self, window: DecodedWindow, segments: tuple[Segment, ...], next_seek: int
    ) -> tuple[DecodedWindow | None, tuple[Segment, ...], int]:
        """openai-whisper's hallucination_silence_threshold (`transcription.hallucination`):
        the window with only the segments it keeps (None: decode again from the seek
        returned), those segments, and the next window's seek."""
        begin = self.tokenizer.special.timestamp_begin
        timed = with_words(segments, window, self.tokenizer)
        cut = cut_window(
            timed,
            seek=window.seek,
            frames=window.frames,
            next_seek=next_seek,
            single_ending=[t >= begin for t in window.tokens[-2:]] == [False, True],
            content_frames=self.content,
            last_speech=self._last_speech,
            threshold=self.options.hallucination_silence_threshold,
        )
        next_seek = max(cut.seek, window.seek + 1)
        if cut.redo:
            return None, (), next_seek
        kept = timed[: cut.keep]
        ends = [w.end for s in kept for w in s.words]
        if ends:
            self._last_speech = ends[-1]
        if cut.keep < len(segments):
            window = first_segments(window, cut.keep, self.tokenizer)
        return window, segments[: cut.keep], next_seek

    def _condition_on(self, segments: tuple[Segment, ...], result: DecodingResult) -> None:
        """SEQUENTIAL: the next window sees the text so far, unless it was decoded
        too hot to trust."""
        for segment in segments:
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
        else:  # the last window's report is `on_done`'s
            self._report_progress()

    def _initial_prompt(self) -> list[int]:
        """openai-whisper conditions later windows on the initial prompt too, until
        the first reset."""
        prompt = self.options.decoding.prompt
        return self.tokenizer.encode(" " + prompt.strip()) if prompt and prompt.strip() else []

    # -- progress

    def _settled_windows(self) -> tuple[list[DecodedWindow], int]:
        """The accepted windows from the start with no gap before them, and the seek after
        them (the caller holds the lock)."""
        settled, at = [], 0
        while at in self._accepted:
            settled.append(self._accepted[at])
            at = self._follows[at]
        return settled, at

    def _report_progress(self) -> None:
        """Hand `on_progress` the settled windows when there are more of them than last
        time: in BATCHED mode a later chunk's windows wait until every one before them is in.
        Never the whole recording: `on_done` reports that."""
        if self.on_progress is None:
            return
        with self._lock:
            settled, _ = self._settled_windows()
            if len(settled) <= self._settled or self._failed or self._finished:
                return
            self._settled = len(settled)
        self.on_progress(self._record(settled))

    def _on_segment(self, window: WindowAt, so_far: DecodingResult) -> None:
        """The engine's word that `window` has ended one more segment (on its thread):
        hand `on_progress` the settled windows and this one's tokens so far, unless the
        window may yet be skipped as silent (its no-speech probability over the
        threshold: whether it is depends on the whole window's log-probability). A
        report that fails is logged and the decoding goes on: the window's own report,
        or the final answer, still comes."""
        no_speech = self.options.no_speech_threshold
        if no_speech is not None and so_far.no_speech_prob > no_speech:
            return
        try:
            with self._lock:
                settled, at = self._settled_windows()
                if at != window.seek or self._failed or self._finished:
                    return
            provisional = DecodedWindow(
                tokens=so_far.tokens,
                seek=window.seek,
                frames=_frames(window.chunk, window.seek),
                temperature=so_far.temperature,
                avg_logprob=so_far.avg_logprob,
                compression_ratio=compression_ratio(self.tokenizer.decode(so_far.tokens)),
                no_speech_prob=so_far.no_speech_prob,
            )
            self.on_progress(self._record([*settled, provisional]))
        except Exception:
            log.warning("could not report a segment in progress", exc_info=True)

    def _record(self, windows: list[DecodedWindow]) -> DecodedRecording:
        return DecodedRecording(
            windows=tuple(windows),
            samples=self.samples,
            # English-only checkpoints know their language even when no window was decoded.
            language=self.language if self.config.multilingual else "en",
            language_probability=self.language_probability,
        )

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
        self.on_done(self._record([self._accepted[seek] for seek in sorted(self._accepted)]))
