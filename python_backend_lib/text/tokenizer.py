"""Tokens to text, and timestamp tokens to typed segments.

Text comes from the checkpoint's `tokenizer.json` through the `tokenizers`
library. Control and timestamp tokens are never looked up by string: their ids
come from `core.model_facts.SpecialTokens` (the packaged tokenizer.json stops at
<|notimestamps|>, so a string lookup would not find a single timestamp).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from python_backend_lib.checkpoints.configs import DEFAULT_SOURCE, load_config
from python_backend_lib.core.geometry import SECONDS_PER_POSITION
from python_backend_lib.core.model_facts import ModelConfig, SpecialTokens
from python_backend_lib.core.segments import Segment


class Tokenizer:
    def __init__(self, tokenizer_json: Path, special: SpecialTokens) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tokenizer = HFTokenizer.from_file(str(tokenizer_json))
        self.special = special

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of the ordinary tokens; control and timestamp tokens are dropped."""
        return self._tokenizer.decode([t for t in tokens if t < self.special.eot])

    def timestamp_seconds(self, token: int) -> float:
        return round((token - self.special.timestamp_begin) * SECONDS_PER_POSITION, 2)

    def segments(self, tokens: Sequence[int], duration: float, offset: float = 0.0) -> tuple[Segment, ...]:
        """Split generated tokens into segments at timestamp tokens.

        Whisper writes `<|t0|> text <|t1|>` for each segment; a pair of adjacent
        timestamps closes one segment and opens the next. Text with no closing
        timestamp runs to the end of the audio; without any timestamps the whole
        text is one segment from 0 to `duration`. `offset` shifts the times (a
        window's start in long audio). A segment's tokens are its text tokens with
        the timestamps around them, as openai-whisper keeps them: long-form
        decoding conditions later windows on them, timestamps included.
        """
        begin = self.special.timestamp_begin
        segments: list[Segment] = []
        start: float | None = None
        pending: list[int] = []  # the open segment's tokens: its opening timestamp, then text
        for token in tokens:
            if token < begin:
                if token < self.special.eot:
                    pending.append(token)
                continue
            time = self.timestamp_seconds(token)
            if start is not None and _has_text(pending, begin):
                segments.append(self._segment(start + offset, time + offset, [*pending, token]))
                start, pending = None, []
            else:  # an opening timestamp (text before any timestamp stays in the segment)
                start = time
                pending = [*pending, token] if _has_text(pending, begin) else [token]
        if _has_text(pending, begin):
            segments.append(self._segment((start or 0.0) + offset, max(duration, start or 0.0) + offset, pending))
        return tuple(s for s in segments if s.text)

    def _segment(self, start: float, end: float, tokens: list[int]) -> Segment:
        # Times are multiples of 10 ms; rounding drops float noise from offsets.
        return Segment(start=round(start, 3), end=round(end, 3), text=self.decode(tokens).strip(), tokens=tuple(tokens))


def _has_text(tokens: Sequence[int], timestamp_begin: int) -> bool:
    return any(t < timestamp_begin for t in tokens)


def load_tokenizer(source: str | ModelConfig = DEFAULT_SOURCE) -> Tokenizer:
    config = source if isinstance(source, ModelConfig) else load_config(source)
    if config.tokenizer_path is None:
        raise ValueError(f"checkpoint {config.source!r} has no tokenizer.json")
    return Tokenizer(config.tokenizer_path, config.special)
