"""The Silero VAD module against faster-whisper's own VAD on the same audio (no server)."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import soundfile
from faster_whisper.vad import SpeechTimestampsMap, get_speech_timestamps
from faster_whisper.vad import VadOptions as FasterVadOptions
from reference import clips

from python_backend_lib.audio import vad

SAMPLE_RATE = 16_000


def _clip(name: str) -> np.ndarray:
    by_name = {c.file: c for c in clips()}
    waveform, rate = soundfile.read(by_name[name].path, dtype="float32")
    assert rate == SAMPLE_RATE
    return waveform


def _recording(pieces: list[str | float], noise: float = 0.002, seed: int = 0) -> np.ndarray:
    """Clips (by name) and silences (seconds, with faint noise so they are not digital zero), in order."""
    rng = np.random.default_rng(seed)
    parts = []
    for piece in pieces:
        if isinstance(piece, str):
            parts.append(_clip(piece))
        else:
            parts.append((rng.standard_normal(round(piece * SAMPLE_RATE)) * noise).astype(np.float32))
    return np.concatenate(parts)


RECORDINGS = {
    "clips-and-long-silences": [4.0, "jfk.wav", 20.0, "goforward.wav", 1.0, "cards_005.wav", 15.5],
    "back-to-back": ["sense_and_sensibility_01_austen_64kb-0870.wav", 0.3, "sense_and_sensibility_01_austen_64kb-0880.wav"],
    "sonnet": ["sonnet1_longform.wav"],
    "silence-only": [7.0],
    "odd-length": [0.7, "dhd.2934z.wav", 0.0123],
}
OPTIONS = {
    "defaults": {},
    "short-silences": {"min_silence_duration_ms": 160, "speech_pad_ms": 30},
    "split-long-speech": {"max_speech_duration_s": 6.0, "min_silence_duration_ms": 500, "speech_pad_ms": 100},
    "thresholds": {"threshold": 0.7, "neg_threshold": 0.2, "min_speech_duration_ms": 250},
    "no-padding": {"speech_pad_ms": 0, "min_silence_duration_ms": 300},
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("pieces", RECORDINGS.values(), ids=RECORDINGS.keys())
def test_speech_timestamps_agree_with_faster_whisper_within_a_frame(pieces, options):
    audio = _recording(pieces)
    ours = vad.speech_timestamps(audio, vad.VadOptions(**options))
    theirs = get_speech_timestamps(audio.copy(), FasterVadOptions(**options))
    assert len(ours) == len(theirs), (ours, theirs)
    for span, reference in zip(ours, theirs):
        assert abs(span.start - reference["start"]) <= vad.FRAME_SAMPLES, (span, reference)
        assert abs(span.end - reference["end"]) <= vad.FRAME_SAMPLES, (span, reference)
    has_speech = any(isinstance(piece, str) for piece in pieces)
    assert bool(ours) == has_speech, ours


def test_long_silences_between_clips_are_left_out():
    audio = _recording(RECORDINGS["clips-and-long-silences"])
    spans = vad.speech_timestamps(audio)
    kept = sum(span.end - span.start for span in spans) / SAMPLE_RATE
    speech = sum(len(_clip(p)) for p in RECORDINGS["clips-and-long-silences"] if isinstance(p, str)) / SAMPLE_RATE
    assert speech <= kept < speech + 6, (kept, speech)  # the clips, their pads and the 1 s pause between two
    assert spans[0].start >= 3 * SAMPLE_RATE  # the 4 s of noise before jfk is left out


def test_streaming_probabilities_equal_the_whole_recordings():
    audio = _recording(RECORDINGS["clips-and-long-silences"])
    whole = vad.speech_probabilities(audio)
    stream = vad.VadStream()
    pieces, position, rng = [], 0, np.random.default_rng(1)
    while position < len(audio):
        size = int(rng.integers(1, 3000))  # arbitrary arrival sizes, most not whole frames
        pieces.append(stream.push(audio[position : position + size]))
        position += size
    streamed = np.concatenate(pieces)
    complete = len(audio) // vad.FRAME_SAMPLES
    assert stream.pending_samples == len(audio) - complete * vad.FRAME_SAMPLES
    np.testing.assert_allclose(streamed, whole[:complete], atol=1e-5)
    assert whole.max() > 0.9 and whole.min() < 0.1

    stream.reset()
    again = stream.push(audio[: 40 * vad.FRAME_SAMPLES])
    np.testing.assert_allclose(again, whole[:40], atol=1e-5)


def test_speech_map_puts_times_back_where_faster_whisper_does():
    audio = _recording(RECORDINGS["clips-and-long-silences"])
    spans = vad.speech_timestamps(audio, vad.VadOptions(min_silence_duration_ms=500, speech_pad_ms=200))
    assert len(spans) >= 3
    ours = vad.SpeechMap.of(spans)
    theirs = SpeechTimestampsMap([{"start": s.start, "end": s.end} for s in spans], SAMPLE_RATE)
    joined = sum(s.end - s.start for s in spans) / SAMPLE_RATE
    for seconds in np.arange(0, joined + 0.5, 0.01):
        for is_end in (False, True):
            assert ours.original(float(seconds), is_end) == pytest.approx(
                theirs.get_original_time(float(seconds), is_end=is_end), abs=0.006
            )


def test_speech_map_sends_each_joined_sample_back_to_its_own():
    # A ramp's values name their own positions, so a mapped time can be checked by value.
    audio = np.arange(30 * SAMPLE_RATE, dtype=np.float32)
    spans = [vad.SpeechSpan(16_000, 48_000), vad.SpeechSpan(200_000, 201_600), vad.SpeechSpan(400_000, 480_000)]
    joined = vad.collect_speech(audio, spans)
    mapping = vad.SpeechMap.of(spans)
    for index in range(0, len(joined), 997):
        original = mapping.original(index / SAMPLE_RATE)
        assert round(original * SAMPLE_RATE) == joined[index]
    # A segment ending exactly where the first span ends ends there, not after the next silence.
    assert mapping.original(2.0, is_end=True) == pytest.approx(3.0)
    assert mapping.original(2.0) == pytest.approx(200_000 / SAMPLE_RATE)


@pytest.mark.parametrize(
    "options, named",
    [
        ({"threshold": 1.5}, "threshold"),
        ({"neg_threshold": -0.1}, "neg_threshold"),
        ({"min_speech_duration_ms": -1}, "min_speech_duration_ms"),
        ({"min_silence_duration_ms": math.nan}, "min_silence_duration_ms"),
        ({"speech_pad_ms": -5}, "speech_pad_ms"),
        ({"max_speech_duration_s": 0}, "max_speech_duration_s"),
    ],
)
def test_bad_options_are_named(options, named):
    with pytest.raises(vad.VadOptionError, match=named):
        vad.VadOptions(**options)


def test_without_the_extra_the_message_names_it(tmp_path):
    # A faster_whisper without the VAD file, found first on the path: as a server without the extra.
    (tmp_path / "faster_whisper").mkdir()
    (tmp_path / "faster_whisper" / "__init__.py").write_text("")
    script = textwrap.dedent(
        """
        from python_backend_lib.audio import vad
        assert not vad.available()
        try:
            vad.VadStream()
        except vad.VadUnavailable as error:
            print(error)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={"PYTHONPATH": str(tmp_path)}, check=True
    )
    assert "pip install 'whisper-triton[vad]'" in done.stdout


def _transcript(segments):
    from python_backend_lib.text.transcript import Transcript

    return Transcript(text="", segments=tuple(segments), language="en", language_probability=None, duration=0.0,
                      windows=())


def test_transcript_times_go_back_to_the_recording():
    from python_backend_lib.core.segments import Segment, Word
    from python_backend_lib.text.speech_timeline import on_recording_timeline

    # Speech at 10-14 s and 40-43 s of a 60 s recording: joined, 0-4 s and 4-7 s.
    spans = [vad.SpeechSpan(10 * SAMPLE_RATE, 14 * SAMPLE_RATE), vad.SpeechSpan(40 * SAMPLE_RATE, 43 * SAMPLE_RATE)]
    words = (Word(" go", 4.6, 5.0, 0.9), Word(" on", 5.0, 5.4, 0.9))
    segments = [
        Segment(0.5, 3.9, "first", ()),  # inside the first span
        Segment(3.2, 6.0, "second", ()),  # starts 0.8 s early, in the first span's end: belongs to the second
        Segment(3.9, 5.6, "worded", (), words=words),  # its words are all in the second span
        Segment(6.5, 7.9, "past the end", ()),  # ends after the joined audio: kept inside the last span
    ]
    moved = on_recording_timeline(_transcript(segments), spans, 60 * SAMPLE_RATE)
    assert moved.duration == 60.0
    assert [(s.start, s.end) for s in moved.segments] == [(10.5, 13.9), (40.0, 42.0), (40.0, 41.6), (42.5, 43.0)]
    assert [(w.start, w.end) for w in moved.segments[2].words] == [(40.6, 41.0), (41.0, 41.4)]

    # Without a filter the one span is the whole recording: nothing moves.
    assert on_recording_timeline(_transcript(segments), [vad.SpeechSpan(0, 60 * SAMPLE_RATE)], 60 * SAMPLE_RATE) \
        == _transcript(segments)
