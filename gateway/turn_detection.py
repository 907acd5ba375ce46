"""Where a live speaker's turns begin and end: OpenAI's `server_vad` turn detection.

A speech detector gives each 16 kHz frame a probability of speech. A turn starts
at the first frame at or above `threshold`, its audio reaching `prefix_padding_ms`
back; it ends once frames below the lower threshold (Silero's hysteresis: 0.15
under `threshold`) have lasted `silence_duration_ms`, that silence included.
Pure apart from the detector: samples in, events out, positions counted in
samples since the detector's start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from python_backend_lib.core.geometry import SAMPLE_RATE

# OpenAI's defaults for server_vad.
DEFAULT_THRESHOLD = 0.5
DEFAULT_PREFIX_PADDING_MS = 300
DEFAULT_SILENCE_DURATION_MS = 500
HYSTERESIS = 0.15  # how far under the threshold speech must fall to count as silence
MIN_NEGATIVE_THRESHOLD = 0.01


class SpeechProbability(Protocol):
    """A streaming speech detector: frames of `frame_samples` 16 kHz samples, in order,
    several at a time ([n, frame_samples]: one call for all the frames an append
    completes, as one run of Silero's network costs little more for three frames than one);
    a probability for each."""

    frame_samples: int

    def __call__(self, frames: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class ServerVad:
    """OpenAI's `turn_detection` of type server_vad."""

    threshold: float = DEFAULT_THRESHOLD
    prefix_padding_ms: int = DEFAULT_PREFIX_PADDING_MS
    silence_duration_ms: int = DEFAULT_SILENCE_DURATION_MS

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be from 0 to 1, got {self.threshold!r}")
        for name in ("prefix_padding_ms", "silence_duration_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a whole number of milliseconds, 0 or more, got {value!r}")

    @property
    def negative_threshold(self) -> float:
        return max(self.threshold - HYSTERESIS, MIN_NEGATIVE_THRESHOLD)


@dataclass(frozen=True)
class SpeechStarted:
    start: int  # the turn's first sample, prefix padding included


@dataclass(frozen=True)
class SpeechStopped:
    end: int  # one past the turn's last sample, the closing silence included


TurnEvent = SpeechStarted | SpeechStopped


@dataclass
class TurnDetector:
    """Feeds audio to `detector` in whole frames and says where turns start and stop.
    `floor`: no turn reaches back before this sample (the last commit)."""

    settings: ServerVad
    detector: SpeechProbability
    position: int = 0  # samples framed so far
    floor: int = 0
    speaking: bool = False
    silent_samples: int = 0
    _rest: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))

    def feed(self, samples: np.ndarray) -> list[TurnEvent]:
        audio = np.concatenate([self._rest, samples.astype(np.float32, copy=False)])
        size = self.detector.frame_samples
        whole = len(audio) - len(audio) % size
        self._rest = audio[whole:]
        if whole == 0:
            return []
        events: list[TurnEvent] = []
        for probability in self.detector(audio[:whole].reshape(-1, size)):
            event = self._frame(float(probability), size)
            if event is not None:
                events.append(event)
        return events

    def reset_floor(self, sample: int) -> None:
        """A commit or clear at `sample`: an ongoing turn ends there without a stop event."""
        self.floor = max(self.floor, sample)
        self.speaking = False
        self.silent_samples = 0

    def _frame(self, probability: float, size: int) -> TurnEvent | None:
        start = self.position
        self.position += size
        if not self.speaking:
            if probability < self.settings.threshold:
                return None
            self.speaking, self.silent_samples = True, 0
            padding = self.settings.prefix_padding_ms * SAMPLE_RATE // 1000
            return SpeechStarted(max(self.floor, start - padding))
        if probability >= self.settings.negative_threshold:
            self.silent_samples = 0
            return None
        self.silent_samples += size
        if self.silent_samples * 1000 < self.settings.silence_duration_ms * SAMPLE_RATE:
            return None
        self.speaking, self.silent_samples = False, 0
        self.floor = self.position
        return SpeechStopped(self.position)
