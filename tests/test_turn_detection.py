"""server_vad turn detection (apps.turn_detection) over a detector whose probabilities the test sets."""

from __future__ import annotations

import numpy as np
import pytest

from python_backend_lib.apps.turn_detection import ServerVad, SpeechStarted, SpeechStopped, TurnDetector

FRAME = 512


class Scripted:
    """A detector that reads each frame's probability from its first sample."""

    frame_samples = FRAME

    def __call__(self, frame: np.ndarray) -> float:
        return float(frame[0])


def frames(*probabilities: float) -> np.ndarray:
    return np.repeat(np.array(probabilities, dtype=np.float32), FRAME)


def ms(samples: int) -> float:
    return samples * 1000 / 16000


def test_a_turn_starts_with_its_prefix_padding_and_stops_after_the_silence():
    vad = ServerVad(threshold=0.5, prefix_padding_ms=64, silence_duration_ms=96)  # 2 and 3 frames
    detector = TurnDetector(vad, Scripted())
    events = detector.feed(frames(0.1, 0.1, 0.1, 0.9, 0.8, 0.2, 0.2))
    assert events == [SpeechStarted(start=1 * FRAME)]
    # 0.4 is under the threshold but above the lower one (0.35): still speech.
    assert detector.feed(frames(0.4, 0.1, 0.1)) == []
    assert detector.feed(frames(0.1)) == [SpeechStopped(end=11 * FRAME)]
    assert detector.feed(frames(0.1, 0.1)) == []


def test_audio_in_any_chunk_sizes_gives_the_same_turns():
    vad = ServerVad(threshold=0.5, prefix_padding_ms=0, silence_duration_ms=64)
    audio = frames(0.0, 0.7, 0.7, 0.0, 0.0, 0.0, 0.9, 0.0, 0.0)
    whole = TurnDetector(vad, Scripted()).feed(audio)
    pieces, detector = [], TurnDetector(vad, Scripted())
    for start in range(0, len(audio), 300):
        pieces += detector.feed(audio[start:start + 300])
    assert whole == pieces == [SpeechStarted(FRAME), SpeechStopped(5 * FRAME), SpeechStarted(6 * FRAME),
                               SpeechStopped(9 * FRAME)]


def test_no_turn_reaches_back_past_the_last_commit():
    detector = TurnDetector(ServerVad(prefix_padding_ms=1000), Scripted(), position=10 * FRAME, floor=10 * FRAME)
    assert detector.feed(frames(0.0, 0.9)) == [SpeechStarted(start=10 * FRAME)]
    detector.reset_floor(12 * FRAME)  # a commit: the turn ended there, without a stop
    assert detector.feed(frames(0.0, 0.9)) == [SpeechStarted(start=12 * FRAME)]


@pytest.mark.parametrize("options", [{"threshold": 1.5}, {"prefix_padding_ms": -1}, {"silence_duration_ms": 0.5},
                                     {"silence_duration_ms": True}])
def test_bad_settings_are_refused(options):
    with pytest.raises(ValueError):
        ServerVad(**options)
