"""What a transcript is made of: timed segments and words.

Plain frozen dataclasses with no dependencies, shared by the library (which
makes them), the response formats (which write them) and the clients (which
read them back).
"""

from __future__ import annotations

from dataclasses import dataclass

NAN = float("nan")


@dataclass(frozen=True)
class Word:
    """One word's time from the alignment heads; probability: its tokens' mean."""

    word: str  # with its leading space, as Whisper writes it
    start: float
    end: float
    probability: float


@dataclass(frozen=True)
class Segment:
    """A stretch of speech: times in seconds from the start of the audio.

    The fields after `tokens` describe the window the segment came from
    (openai-whisper's verbose result) and are filled by long-form decoding.
    """

    start: float
    end: float
    text: str
    tokens: tuple[int, ...]  # the text's tokens with the timestamp tokens around them
    id: int = 0  # position in the transcript
    seek: int = 0  # mel frame where the window started
    temperature: float = 0.0
    avg_logprob: float = NAN
    compression_ratio: float = NAN
    no_speech_prob: float = NAN
    words: tuple[Word, ...] = ()
