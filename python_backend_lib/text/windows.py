"""One decoded window's segments in the recording's time, and how far its seek moves.

Long-form decoding needs the seek to pick the next window and the segments to
condition it on; the transcript needs the same segments. Both come from this one
pure function of the window's tokens, so the `whisper` model, which decides the
windows, and the `postprocessing` model, which writes the text, split every window
alike. No torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from python_backend_lib.core import geometry
from python_backend_lib.core.decoded import DecodedWindow
from python_backend_lib.core.segments import Segment
from python_backend_lib.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class WindowSegments:
    segments: tuple[Segment, ...]
    advance: int  # frames to move the seek by


def window_segments(window: DecodedWindow, tokenizer: Tokenizer) -> WindowSegments:
    """The window's segments in absolute time, each with the window's statistics, and
    how far to seek.

    When the window ends inside a segment (text after the last timestamp, with no
    timestamp closing it), the next window starts at that last timestamp, so the
    unfinished speech is decoded again whole: the window's end may have cut it.
    Unless the window `closes_chunk`: it holds the rest of a chunk that ends in a
    pause, so nothing was cut, and the open segment ends with the chunk. A silent
    window has no segments and moves the seek past itself.
    """
    if window.silent:
        return WindowSegments((), window.frames)
    tokens = window.tokens
    begin = tokenizer.special.timestamp_begin
    offset = window.seek / geometry.FRAMES_PER_SECOND
    window_seconds = window.frames / geometry.FRAMES_PER_SECOND
    is_ts = [t >= begin for t in tokens]
    single_ending = is_ts[-2:] == [False, True]
    boundaries = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]
    # Text after the last pair of timestamps: a segment the model left open.
    left_open = bool(boundaries) and any(t < tokenizer.special.eot for t in tokens[boundaries[-1] :])
    ends_here = single_ending or (window.closes_chunk and left_open)
    if boundaries:
        if ends_here:
            boundaries.append(len(tokens))
        segments, start = [], 0
        for end in boundaries:
            segments.extend(tokenizer.segments(tokens[start:end], duration=window_seconds, offset=offset))
            start = end
        advance = window.frames if ends_here else (tokens[start - 1] - begin) * geometry.ENCODER_STRIDE
    else:
        stamps = [t for t in tokens if t >= begin]
        duration = window_seconds
        if stamps and stamps[-1] != begin:
            duration = tokenizer.timestamp_seconds(stamps[-1])
        text = tokenizer.decode(tokens).strip()
        segments = [Segment(offset, round(offset + duration, 3), text, tuple(tokens))] if text else []
        advance = window.frames
    # A sampled or looping decode may write a timestamp past the audio the window
    # holds (5.04 s on a 2.16 s clip): no time in the transcript passes its end.
    audio_end = round(offset + window_seconds, 3)
    statistics = dict(
        seek=window.seek,
        temperature=window.temperature,
        avg_logprob=window.avg_logprob,
        compression_ratio=window.compression_ratio,
        no_speech_prob=window.no_speech_prob,
    )
    return WindowSegments(
        tuple(
            dataclasses.replace(s, start=min(s.start, audio_end), end=min(s.end, audio_end), **statistics)
            for s in segments
        ),
        max(advance, 1),
    )


def text_tokens(segments: tuple[Segment, ...], eot: int) -> list[list[int]]:
    """Each segment's text tokens (its timestamps dropped): what word timestamps align."""
    return [[t for t in s.tokens if t < eot] for s in segments]
