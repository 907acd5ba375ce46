"""Transcripts as text: the response formats and the SEGMENTS wire format.

A finished transcript is a `Document`: its text, its segments (with their
window statistics and, on request, words), the audio's duration, the task and
the language. The `whisper` model writes its outputs from it, and every
response format is written from it:

- text: the transcript on one line;
- json: {"text", "segments": [{"start", "end", "text"}]};
- verbose_json: OpenAI's fields (task, language, duration, text, segments with
  id, seek, start, end, text, tokens, temperature, avg_logprob,
  compression_ratio, no_speech_prob, and words when they were asked for),
  plus our own language_code and language_probability;
- srt and vtt: subtitles, one cue per segment, or cues of words laid out as
  openai-whisper lays them when words were timed (`subtitles`);
- tsv: start and end in milliseconds and the text, a segment per row.

Pure functions and frozen dataclasses; nothing here imports torch, so the
clients and the gateway use this module too. SEGMENTS and verbose_json carry
times exactly as the library computed them; subtitles write them to the
millisecond.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.languages import language_code, language_name
from python_backend_lib.core.options import Task, TranscribeOptions
from python_backend_lib.core.segments import NAN, Segment, Word
from python_backend_lib.text import subtitles
from python_backend_lib.text.subtitles import SubtitleOptions, format_timestamp

__all__ = ["Document", "ResponseFormat", "SubtitleOptions", "TimedText", "format_timestamp"]


class ResponseFormat(str, enum.Enum):
    TEXT = "text"
    JSON = "json"
    VERBOSE_JSON = "verbose_json"
    SRT = "srt"
    VTT = "vtt"
    TSV = "tsv"


FORMATS = tuple(f.value for f in ResponseFormat)


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


def _segment_records(segments: Iterable[Timed]) -> list[dict[str, Any]]:
    """{"start", "end", "text"}, and "words" for segments that have words."""
    records = []
    for s in segments:
        record: dict[str, Any] = {"start": float(s.start), "end": float(s.end), "text": s.text}
        words = getattr(s, "words", ())
        if words:
            record["words"] = [_word_record(w) for w in words]
        records.append(record)
    return records


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
    """One JSON object: {**extra, "text", "segments"} (extra such as "file" goes first);
    segments that have words carry them."""
    record = {**extra, "text": text, "segments": _segment_records(segments)}
    return json.dumps(record, ensure_ascii=False) + "\n"


def to_srt(segments: Sequence[Timed], options: SubtitleOptions = SubtitleOptions()) -> str:
    """SubRip: numbered cues with HH:MM:SS,mmm times (`subtitles.subtitle_cues`)."""
    return subtitles.srt(subtitles.subtitle_cues(segments, options))


def to_vtt(segments: Sequence[Timed], options: SubtitleOptions = SubtitleOptions()) -> str:
    """WebVTT: a WEBVTT header, then cues with HH:MM:SS.mmm times."""
    return subtitles.vtt(subtitles.subtitle_cues(segments, options))


# ----------------------------------------------------------------- the document


@dataclass(frozen=True)
class Document:
    """A finished transcript, as every response format writes it.

    language: the spoken language's code ("en"); None when no window was decoded
        on a multilingual checkpoint (all silence) and none was given.
    language_probability: how sure detection was; None when the language was given
        or the checkpoint is English-only.
    word_timestamps: whether words were asked for (verbose_json then lists them,
        even when there are none).
    """

    text: str
    segments: tuple[Segment, ...]
    duration: float
    task: Task = Task.TRANSCRIBE
    language: str | None = None
    language_probability: float | None = None
    word_timestamps: bool = False

    @classmethod
    def from_transcript(cls, transcript: Any, options: TranscribeOptions) -> Document:
        """transcript: a `longform.Transcript`; options: those it was made with."""
        return cls(
            text=transcript.text,
            segments=tuple(transcript.segments),
            duration=float(transcript.duration),
            task=options.decoding.task,
            language=transcript.language,
            language_probability=transcript.language_probability,
            word_timestamps=options.word_timestamps,
        )

    @property
    def words(self) -> tuple[Word, ...]:
        return tuple(w for s in self.segments for w in s.words)

    def render(
        self, response_format: ResponseFormat | str, *, layout: SubtitleOptions = SubtitleOptions(), **extra: object
    ) -> str:
        """The document in `response_format`; `layout`: how srt and vtt lay out
        word-timed cues; `extra` fields (such as "file") go first in the JSON
        formats and are ignored by the others."""
        response_format = ResponseFormat(response_format)
        if response_format is ResponseFormat.TEXT:
            return to_text(self.text)
        if response_format is ResponseFormat.JSON:
            return to_json(self.text, self.segments, **extra)
        if response_format is ResponseFormat.VERBOSE_JSON:
            return json.dumps({**extra, **self.verbose_record()}, ensure_ascii=False) + "\n"
        if response_format is ResponseFormat.SRT:
            return to_srt(self.segments, layout)
        if response_format is ResponseFormat.VTT:
            return to_vtt(self.segments, layout)
        return subtitles.tsv(self.segments)

    def verbose_record(self) -> dict[str, Any]:
        """verbose_json as a dict: OpenAI's fields, then ours."""
        record: dict[str, Any] = {
            "task": self.task.value,
            "language": language_name(self.language) if self.language is not None else None,
            "duration": self.duration,
            "text": self.text,
            "segments": [self._verbose_segment(s) for s in self.segments],
        }
        if self.word_timestamps:
            record["words"] = [_word_record(w) for w in self.words]
        record["language_code"] = self.language
        record["language_probability"] = _finite_or_none(self.language_probability)
        return record

    def _verbose_segment(self, s: Segment) -> dict[str, Any]:
        record: dict[str, Any] = {
            "id": s.id,
            "seek": s.seek,
            "start": s.start,
            "end": s.end,
            "text": s.text,
            "tokens": list(s.tokens),
            "temperature": s.temperature,
            "avg_logprob": _finite_or_none(s.avg_logprob),
            "compression_ratio": _finite_or_none(s.compression_ratio),
            "no_speech_prob": _finite_or_none(s.no_speech_prob),
        }
        if self.word_timestamps:
            record["words"] = [_word_record(w) for w in s.words]
        return record

    @classmethod
    def from_verbose_json(cls, data: str | bytes | Mapping[str, Any]) -> Document:
        """Inverse of `render(VERBOSE_JSON)`, for the clients. RequestError if `data`
        is not verbose_json."""
        try:
            record = json.loads(data) if isinstance(data, (str, bytes)) else data
            code = record.get("language_code")
            if code is None and record.get("language") is not None:
                code = language_code(record["language"])
            return cls(
                text=str(record["text"]),
                segments=tuple(_segment_from_record(s) for s in record["segments"]),
                duration=float(record["duration"]),
                task=Task(record["task"]),
                language=code,
                language_probability=_float_or_none(record.get("language_probability")),
                word_timestamps="words" in record,
            )
        except (json.JSONDecodeError, TypeError, KeyError, AttributeError, ValueError) as error:
            raise RequestError(f"not a verbose_json transcript: {error}") from None


def _word_record(w: Word) -> dict[str, Any]:
    return {"word": w.word, "start": w.start, "end": w.end, "probability": _finite_or_none(w.probability)}


def _segment_from_record(r: Mapping[str, Any]) -> Segment:
    return Segment(
        start=float(r["start"]),
        end=float(r["end"]),
        text=str(r["text"]),
        tokens=tuple(int(t) for t in r["tokens"]),
        id=int(r["id"]),
        seek=int(r["seek"]),
        temperature=float(r["temperature"]),
        avg_logprob=_nan_for_none(r["avg_logprob"]),
        compression_ratio=_nan_for_none(r["compression_ratio"]),
        no_speech_prob=_nan_for_none(r["no_speech_prob"]),
        words=tuple(
            Word(str(w["word"]), float(w["start"]), float(w["end"]), _nan_for_none(w["probability"]))
            for w in r.get("words", ())
        ),
    )


# JSON has no NaN or infinity: a statistic that is not a number travels as null.
def _finite_or_none(value: float | None) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _nan_for_none(value: Any) -> float:
    return NAN if value is None else float(value)
