"""server_vad turn detection (gateway.turn_detection) over a detector whose probabilities the test sets."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.turn_detection import ServerVad, SpeechStarted, SpeechStopped, TurnDetector

FRAME = 512


class Scripted:
    """A detector that reads each frame's probability from its first sample, and counts its calls."""

    frame_samples = FRAME

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, frames: np.ndarray) -> np.ndarray:
        self.calls += 1
        return frames[:, 0].astype(np.float64)


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


def test_the_frames_an_append_completes_are_judged_in_one_call():
    """Silero runs once for all of them (its network's cost is mostly per run); a part frame waits."""
    detector = TurnDetector(ServerVad(prefix_padding_ms=0), scripted := Scripted())
    assert detector.feed(frames(0.0, 0.0, 0.9)[: 3 * FRAME - 10]) == []
    assert scripted.calls == 1 and detector.position == 2 * FRAME
    assert detector.feed(frames(0.9)[:10]) == [SpeechStarted(2 * FRAME)]
    assert scripted.calls == 2


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


@pytest.mark.parametrize("make", ["silero", "loudness"])
def test_each_detector_judges_frames_together_as_it_judges_them_one_by_one(make):
    import soundfile
    from conftest import AUDIO_DIR

    from gateway.speech_detector import LoudnessDetector, SileroDetector

    audio, _ = soundfile.read(AUDIO_DIR / "jfk.wav", dtype="float32")
    detector_type = SileroDetector if make == "silero" else LoudnessDetector
    together, alone = detector_type(), detector_type()
    framed = audio[: 40 * FRAME].reshape(-1, FRAME)
    at_once = np.concatenate([together(framed[i:i + 3]) for i in range(0, len(framed), 3)])
    one_by_one = np.concatenate([alone(framed[i:i + 1]) for i in range(len(framed))])
    assert at_once.shape == (40,)
    np.testing.assert_allclose(at_once, one_by_one, atol=1e-6)
    assert at_once.max() > 0.5 > at_once.min()  # jfk's first 1.3 s hold both speech and silence
