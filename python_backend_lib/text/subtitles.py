"""Subtitles from a transcript: cues, their lines, and the SRT, WebVTT and TSV writers.

Without word timestamps each segment is one cue. With them, cues are built from
the words, as openai-whisper's subtitle writers build them (its `--word_timestamps`,
`--max_line_width`, `--max_line_count` and `--highlight_words`):

- each segment starts a new cue, its lines wrapped at `max_line_width`, unless
  both `max_line_width` and `max_line_count` are given: then cues are filled with
  up to `max_line_count` lines across segments, and a pause of more than 3 s
  between two words starts a new cue;
- a cue runs from its first word's start to its last word's end;
- with `highlight_words`, each word gets a cue of its own time showing the whole
  cue's text with that word underlined (`<u>word</u>`), and a gap between two
  words a cue with the plain text.

Pure functions and frozen dataclasses, torch-free: the whisper model's responders,
the clients and the gateway write subtitles with the same code.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from python_backend_lib.core.errors import RequestError

MS_PER_SECOND = 1000
MS_PER_MINUTE = 60 * MS_PER_SECOND
MS_PER_HOUR = 60 * MS_PER_MINUTE
# Across segments, a pause this long between two words' starts begins a new cue.
LONG_PAUSE_S = 3.0
# "-->" separates a cue's times: inside its text it would end the text early.
CUE_ARROW = "-->"
TSV_COLUMNS = ("start", "end", "text")


@dataclass(frozen=True)
class SubtitleOptions:
    """How word-timed cues are laid out; without words only segments are shown.

    max_line_width: characters per line at most (a longer word gets a line of its
        own); None: no limit.
    max_line_count: lines per cue at most; only with max_line_width (as in
        openai-whisper, where it has no effect alone).
    highlight_words: a cue per word, that word underlined.
    """

    max_line_width: int | None = None
    max_line_count: int | None = None
    highlight_words: bool = False

    def __post_init__(self) -> None:
        for name in ("max_line_width", "max_line_count"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise RequestError(f"{name} must be a whole number of at least 1, got {value!r}")

    @property
    def preserve_segments(self) -> bool:
        """Each segment starts a cue, unless both the width and the line count are set."""
        return self.max_line_width is None or self.max_line_count is None


@dataclass(frozen=True)
class Cue:
    """One subtitle: seconds from the start of the audio; text may hold line breaks."""

    start: float
    end: float
    text: str


@dataclass(frozen=True)
class _Piece:
    """A word as placed in a cue: its text with the space or line break before it."""

    text: str
    start: float
    end: float


def subtitle_cues(segments: Sequence[Any], options: SubtitleOptions = SubtitleOptions()) -> list[Cue]:
    """The cues of `segments` (objects with start, end, text and, when timed, words)."""
    if not any(getattr(s, "words", ()) for s in segments):
        return [Cue(s.start, s.end, _cue_text(s.text.strip())) for s in segments]
    cues = []
    for pieces in _word_cues(segments, options):
        text = _cue_text("".join(p.text for p in pieces))
        if not options.highlight_words:
            cues.append(Cue(pieces[0].start, pieces[-1].end, text))
            continue
        shown_until = pieces[0].start
        for index, piece in enumerate(pieces):
            if _ms(piece.start) != _ms(shown_until):  # a gap between words: the plain text
                cues.append(Cue(shown_until, piece.start, text))
            cues.append(Cue(piece.start, piece.end, _cue_text(_underlined(pieces, index))))
            shown_until = piece.end
    return cues


def _word_cues(segments: Sequence[Any], options: SubtitleOptions) -> Iterator[list[_Piece]]:
    """The words grouped into cues, each word's text carrying the space or the
    line break that goes before it."""
    width = options.max_line_width or float("inf")
    cue: list[_Piece] = []
    line_length, line_count = 0, 1
    previous_start = next(w.start for s in segments for w in s.words)
    for segment in segments:
        for index, word in enumerate(segment.words):
            long_pause = not options.preserve_segments and word.start - previous_start > LONG_PAUSE_S
            segment_break = options.preserve_segments and index == 0 and bool(cue)
            fits = line_length + len(word.word) <= width
            previous_start = word.start
            if line_length > 0 and fits and not long_pause and not segment_break:
                cue.append(_Piece(word.word, word.start, word.end))  # on the same line
                line_length += len(word.word)
                continue
            text = word.word.strip()  # a new line, in this cue or the next
            cue_full = options.max_line_count is not None and line_count >= options.max_line_count
            if segment_break or (cue and options.max_line_count is not None and (long_pause or cue_full)):
                yield cue
                cue, line_count = [], 1
            elif line_length > 0:
                line_count += 1
                text = "\n" + text
            cue.append(_Piece(text, word.start, word.end))
            line_length = len(text.strip())
    if cue:
        yield cue


def _underlined(pieces: Sequence[_Piece], index: int) -> str:
    """The cue's text with piece `index` underlined; its leading space or line break stays outside."""
    texts = []
    for i, piece in enumerate(pieces):
        if i == index:
            word = piece.text.lstrip()
            texts.append(f"{piece.text[: len(piece.text) - len(word)]}<u>{word}</u>")
        else:
            texts.append(piece.text)
    return "".join(texts)


def _cue_text(text: str) -> str:
    return text.replace(CUE_ARROW, "->")


def _ms(seconds: float) -> int:
    return round(seconds * MS_PER_SECOND)


def format_timestamp(seconds: float, decimal_marker: str) -> str:
    """HH:MM:SS<marker>mmm, e.g. 3725.5 s with ',' -> '01:02:05,500'."""
    if seconds < 0:
        raise ValueError(f"a timestamp cannot be negative, got {seconds}")
    hours, rest = divmod(_ms(seconds), MS_PER_HOUR)
    minutes, rest = divmod(rest, MS_PER_MINUTE)
    secs, ms = divmod(rest, MS_PER_SECOND)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal_marker}{ms:03d}"


def srt(cues: Sequence[Cue], first_index: int = 1) -> str:
    """SubRip: numbered cues (from `first_index`, so that files can follow each
    other in one valid document) with HH:MM:SS,mmm times."""
    blocks = [
        f"{number}\n{format_timestamp(c.start, ',')} --> {format_timestamp(c.end, ',')}\n{c.text}\n"
        for number, c in enumerate(cues, start=first_index)
    ]
    return "\n".join(blocks)


def vtt(cues: Sequence[Cue], *, header: bool = True, note: str | None = None) -> str:
    """WebVTT: a WEBVTT header (unless this continues a document), an optional
    NOTE block (a comment, e.g. naming the file), then cues with HH:MM:SS.mmm times."""
    blocks = ["WEBVTT\n"] if header else []
    if note is not None:
        blocks.append(f"NOTE {_cue_text(note)}\n")
    blocks += [f"{format_timestamp(c.start, '.')} --> {format_timestamp(c.end, '.')}\n{c.text}\n" for c in cues]
    return "\n".join(blocks)


def tsv(segments: Sequence[Any], *, header: bool = True, file: str | None = None) -> str:
    """Tab-separated values, as openai-whisper writes them: start and end in whole
    milliseconds, then the segment's text. With `file`, a first column names it
    (files then follow each other in one table)."""
    columns = (("file",) if file is not None else ()) + TSV_COLUMNS
    lines = ["\t".join(columns)] if header else []
    prefix = () if file is None else (_tsv_cell(file),)
    for s in segments:
        lines.append("\t".join((*prefix, str(_ms(s.start)), str(_ms(s.end)), _tsv_cell(s.text.strip()))))
    return "".join(line + "\n" for line in lines)


def _tsv_cell(text: str) -> str:
    return " ".join(text.replace("\t", " ").splitlines())
