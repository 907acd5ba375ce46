"""A recording's transcript, assembled from what decoding decided (`DecodedRecording`).

The library assembles it in its own process (`Pipeline.transcribe`); the served
path sends the decoded record from `whisper` to `postprocessing` as numeric tensors
and assembles it there, with this same function, so both write the same text.
No torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from python_backend_lib.core.decoded import DecodedRecording, DecodedWindow
from python_backend_lib.core.segments import Segment
from python_backend_lib.text.tokenizer import Tokenizer
from python_backend_lib.text.windows import window_segments
from python_backend_lib.text.words import with_words


@dataclass(frozen=True)
class Transcript:
    text: str
    segments: tuple[Segment, ...]
    language: str | None
    language_probability: float | None
    duration: float  # seconds of audio
    windows: tuple[DecodedWindow, ...]  # every accepted window, in order


def assemble(recording: DecodedRecording, tokenizer: Tokenizer) -> Transcript:
    """Every window's segments (with words, when the windows carry their token times),
    numbered in order, and the text they make."""
    segments: list[Segment] = []
    for window in recording.windows:
        own = window_segments(window, tokenizer).segments
        segments.extend(with_words(own, window, tokenizer))
    segments = [dataclasses.replace(s, id=i) for i, s in enumerate(segments)]
    return Transcript(
        text=tokenizer.decode([t for s in segments for t in s.tokens]).strip(),
        segments=tuple(segments),
        language=recording.language,
        language_probability=recording.language_probability,
        duration=recording.duration,
        windows=recording.windows,
    )
