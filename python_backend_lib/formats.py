"""Transcripts as text: the SEGMENTS wire format and the subtitle formats.

Pure functions from timed segments to strings. A segment is anything with
`start` and `end` in seconds and `text` (the tokenizer's `Segment`, the
client's `TimedText`). SEGMENTS carries the times exactly as the library
computed them; the subtitle formats write them to the millisecond.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

MS_PER_SECOND = 1000
MS_PER_MINUTE = 60 * MS_PER_SECOND
MS_PER_HOUR = 60 * MS_PER_MINUTE

FORMATS = ("text", "json", "srt", "vtt")  # what `to_<format>` exists for


class Timed(Protocol):
    @property
    def start(self) -> float: ...
    @property
    def end(self) -> float: ...
    @property
    def text(self) -> str: ...


@dataclass(frozen=True)
class TimedText:
    """One segment as it travels in SEGMENTS: seconds from the start of the audio."""

    start: float
    end: float
    text: str


def segments_to_json(segments: Iterable[Timed]) -> str:
    """The SEGMENTS tensor's content: a JSON list of {"start", "end", "text"}."""
    return json.dumps(_segment_records(segments), ensure_ascii=False)


def _segment_records(segments: Iterable[Timed]) -> list[dict[str, float | str]]:
    return [{"start": float(s.start), "end": float(s.end), "text": s.text} for s in segments]


def segments_from_json(data: str | bytes) -> tuple[TimedText, ...]:
    """Inverse of `segments_to_json`; ValueError if `data` is not such a list."""
    try:
        items = json.loads(data)
        return tuple(
            TimedText(start=float(item["start"]), end=float(item["end"]), text=str(item["text"]))
            for item in items
        )
    except (json.JSONDecodeError, TypeError, KeyError) as error:
        raise ValueError(f"SEGMENTS is not a JSON list of {{start, end, text}}: {error}") from None


def to_text(text: str) -> str:
    """Plain text: the transcript on one line."""
    return text.strip() + "\n"


def to_json(text: str, segments: Sequence[Timed], **extra: object) -> str:
    """One JSON object: {"text", "segments", **extra} (extra such as "file" goes first)."""
    record = {**extra, "text": text, "segments": _segment_records(segments)}
    return json.dumps(record, ensure_ascii=False) + "\n"


def to_srt(segments: Sequence[Timed]) -> str:
    """SubRip: numbered cues with HH:MM:SS,mmm times."""
    cues = [
        f"{index}\n{format_timestamp(s.start, ',')} --> {format_timestamp(s.end, ',')}\n{s.text.strip()}\n"
        for index, s in enumerate(segments, start=1)
    ]
    return "\n".join(cues)


def to_vtt(segments: Sequence[Timed]) -> str:
    """WebVTT: a WEBVTT header, then cues with HH:MM:SS.mmm times."""
    cues = [
        f"{format_timestamp(s.start, '.')} --> {format_timestamp(s.end, '.')}\n{s.text.strip()}\n"
        for s in segments
    ]
    return "\n".join(["WEBVTT\n", *cues])


def format_timestamp(seconds: float, decimal_marker: str) -> str:
    """HH:MM:SS<marker>mmm, e.g. 3725.5 s with ',' -> '01:02:05,500'."""
    if seconds < 0:
        raise ValueError(f"a timestamp cannot be negative, got {seconds}")
    total_ms = round(seconds * MS_PER_SECOND)
    hours, rest = divmod(total_ms, MS_PER_HOUR)
    minutes, rest = divmod(rest, MS_PER_MINUTE)
    secs, ms = divmod(rest, MS_PER_SECOND)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal_marker}{ms:03d}"

