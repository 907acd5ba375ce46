"""The speech detector behind live sessions' `server_vad` turn detection (`turn_detection`).

Silero VAD (`audio.vad`, the network faster-whisper filters with) where the
[vad] extra is installed. Without it, a frame's loudness against a fixed level
stands in, which tells speech from silence but not from noise: the gateway
says so when it starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from gateway.turn_detection import SpeechProbability
from python_backend_lib.audio import vad

SPEECH_DBFS = -40.0  # the loudness detector: RMS level at which a frame is even odds speech
RANGE_DB = 10.0  # its probability rises from 0 to 1 over this many dB around that level

log = logging.getLogger(__name__)


class SileroDetector:
    """Silero VAD's probability for each frame, its state carried from frame to frame."""

    frame_samples = vad.FRAME_SAMPLES

    def __init__(self) -> None:
        self.stream = vad.VadStream()

    def __call__(self, frames: np.ndarray) -> np.ndarray:
        return self.stream.push(frames.reshape(-1))


class LoudnessDetector:
    """A frame's RMS level, mapped to 0..1 around SPEECH_DBFS."""

    frame_samples = vad.FRAME_SAMPLES

    def __call__(self, frames: np.ndarray) -> np.ndarray:
        level = 10 * np.log10(np.mean(np.square(frames, dtype=np.float64), axis=1) + 1e-12)
        return np.clip((level - SPEECH_DBFS) / RANGE_DB + 0.5, 0.0, 1.0)


def speech_detectors() -> Callable[[], SpeechProbability]:
    """What makes each session's detector: Silero's where it is installed."""
    if vad.available():
        return SileroDetector
    log.warning("server_vad finds speech by loudness alone: %s", vad.MISSING_MESSAGE.replace("the VAD filter",
                                                                                          "Silero VAD"))
    return LoudnessDetector
