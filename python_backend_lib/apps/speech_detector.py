"""The speech detector of live sessions' turn detection (`turn_detection`).

INTERIM: a frame's loudness against a fixed floor, until the Silero VAD module lands.
"""

from __future__ import annotations

import numpy as np

FRAME_SAMPLES = 512  # 32 ms at 16 kHz, Silero's frame
SPEECH_DBFS = -40.0  # RMS level from which a frame counts as speech
RANGE_DB = 10.0  # the probability rises from 0 to 1 over this many dB around that level


class LoudnessDetector:
    frame_samples = FRAME_SAMPLES

    def __call__(self, frame: np.ndarray) -> float:
        level = 10 * np.log10(float(np.mean(np.square(frame, dtype=np.float64))) + 1e-12)
        return float(np.clip((level - SPEECH_DBFS) / RANGE_DB + 0.5, 0.0, 1.0))


def speech_detector() -> LoudnessDetector:
    return LoudnessDetector()
