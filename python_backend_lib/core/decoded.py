"""What decoding a recording decided, before any text: each accepted window's tokens
and the facts that turn them into segments and words.

The engine's side (`transcription.longform`) makes a `DecodedRecording`; the text
side (`text.transcript.assemble`) turns one into a transcript with the same rules
wherever it runs: in the library's own process, or in the `postprocessing` model
after the record crossed from `whisper` as numeric tensors (`contract.decoded_tensors`).
Plain frozen dataclasses, no torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from python_backend_lib.core.geometry import SAMPLE_RATE


@dataclass(frozen=True)
class DecodedWindow:
    """One accepted 30 s window of a recording.

    tokens: the generated tokens, timestamps included (`DecodingResult.tokens`).
    seek: the mel frame where the window starts in the recording.
    frames: the frames of the window that hold the recording (or its chunk).
    temperature, avg_logprob, compression_ratio, no_speech_prob: how it was decoded,
        as openai-whisper's verbose result reports them.
    silent: skipped as silent (no speech, text not confident): it gives no segments.
    closes_chunk: batched long-form: the window reaches its chunk's end, a pause, so a
        segment the model left open ends with the chunk.
    token_times: with word timestamps, when each text token of the window's segments
        starts, then when the last one ends, in seconds from the window's start; empty
        without them.
    token_probabilities: with word timestamps, each of those text tokens' probability.
    """

    tokens: tuple[int, ...]
    seek: int
    frames: int
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    silent: bool = False
    closes_chunk: bool = False
    token_times: tuple[float, ...] = ()
    token_probabilities: tuple[float, ...] = ()


@dataclass(frozen=True)
class DecodedRecording:
    """Every accepted window of one recording, in order, and what holds for all of them.

    samples: the recording's length in 16 kHz samples (its duration, exactly).
    language: the spoken language's code, given or detected; None when no window told.
    language_probability: of the detection; None when the language was given or known.
    """

    windows: tuple[DecodedWindow, ...]
    samples: int
    language: str | None
    language_probability: float | None

    @property
    def duration(self) -> float:
        """Seconds of audio."""
        return self.samples / SAMPLE_RATE

    def to_json(self) -> str:
        """The record as JSON, every field by name (`from_json` reads it back)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> DecodedRecording:
        record = json.loads(text)
        windows = tuple(
            DecodedWindow(**{k: tuple(v) if isinstance(v, list) else v for k, v in window.items()})
            for window in record.pop("windows")
        )
        return cls(windows=windows, **record)
