"""A transcript of speech cut out of a recording (`vad_filter`), its times put back on the recording.

Decoding saw only the speech, joined end to end (`audio.vad.collect_speech`), so
every time it gives is on that joined audio. Each time moves by the silence left
out before the span of speech it falls in (`audio.vad.SpeechMap`); a word moves
with the span that holds its middle, so its two ends never straddle a silence
that was left out. A segment moves with the spans of its first and last words;
without words, with the spans it lies in, less an edge that holds only a
stray's worth of it, since Whisper's segment times stray a second or two into
the silence around speech, which on the joined audio is the neighbouring span.
Every time is kept inside the span it moved with, so none lands in a silence
that was left out. Without a filter the only span is the whole recording, and
nothing moves. No torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from python_backend_lib.audio.vad import SpeechMap, SpeechSpan
from python_backend_lib.core.geometry import SAMPLE_RATE
from python_backend_lib.core.segments import Segment, Word
from python_backend_lib.text.transcript import Transcript

# How far Whisper's segment times (timestamp tokens) stray from the speech they
# hold: tiny.en's start up to about 2 s early (tests/served/test_long_audio.py).
MAX_STRAY_S = 2.0


def on_recording_timeline(transcript: Transcript, spans: Sequence[SpeechSpan], recording_samples: int) -> Transcript:
    """`transcript` of the joined `spans` with its segments' and words' times on the recording,
    and the recording's duration."""
    if list(spans) == [SpeechSpan(0, recording_samples)]:
        return transcript  # nothing was left out
    if not spans:  # no speech: whisper was given one sample of digital silence, which it does not decode
        return dataclasses.replace(transcript, duration=recording_samples / SAMPLE_RATE)
    mapping = SpeechMap.of(list(spans))
    return dataclasses.replace(
        transcript,
        segments=tuple(_segment(segment, mapping) for segment in transcript.segments),
        duration=recording_samples / SAMPLE_RATE,
    )


def _segment(segment: Segment, mapping: SpeechMap) -> Segment:
    words = tuple(_word(word, mapping) for word in segment.words)
    if segment.words:  # the words say which spans the segment's speech is in
        first = mapping.span_index(_middle(segment.words[0]))
        last = mapping.span_index(_middle(segment.words[-1]))
    else:
        first, last = _spans_of_most(segment, mapping)
    return dataclasses.replace(
        segment,
        start=_rounded(mapping.within(segment.start, first)),
        end=_rounded(mapping.within(segment.end, last)),
        words=words,
    )


def _spans_of_most(segment: Segment, mapping: SpeechMap) -> tuple[int, int]:
    """The spans of a segment without words, less an edge span that holds a stray's
    worth of it (at most MAX_STRAY_S) and less of it than the others do.

    Whisper's segment times stray a second or two into the silence around speech,
    which on the joined audio is the neighbouring span's padding or speech."""
    first = mapping.span_index(segment.start)
    last = mapping.span_index(segment.end, is_end=True)
    if last > first:
        boundary = mapping.joined_start(first + 1)
        if boundary - segment.start < min(MAX_STRAY_S, segment.end - boundary):
            first += 1
    if last > first:
        boundary = mapping.joined_start(last)
        if segment.end - boundary < min(MAX_STRAY_S, boundary - segment.start):
            last -= 1
    return first, last


def _middle(word: Word) -> float:
    return (word.start + word.end) / 2


def _word(word: Word, mapping: SpeechMap) -> Word:
    span = mapping.span_index(_middle(word))
    return dataclasses.replace(
        word, start=_rounded(mapping.within(word.start, span)), end=_rounded(mapping.within(word.end, span))
    )


def _rounded(seconds: float) -> float:
    """Sample-exact shifts add float noise to times that were whole milliseconds."""
    return round(seconds, 3)
