"""Where `whisper-triton transcribe` puts each transcript: files in --output-dir, or stdout.

In a folder, each input gets `<stem>.<ext>` per format; two inputs with the same
stem (a/talk.wav and b/talk.mp3) never overwrite each other: the later ones get
`<stem>-2`, `<stem>-3`, ... On stdout, several files make one valid document
of the format: SRT cues numbered on across files, one WebVTT header with a NOTE
naming each file, one TSV table with a `file` column, one JSON object per line
with a "file" field, and `==> file <==` headers before plain text. One file's
JSON is the server's own, key for key OpenAI's json or verbose_json.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from python_backend_lib.text import subtitles
from python_backend_lib.text.formats import Document, ResponseFormat, SubtitleOptions

STDIN = "-"
STDIN_STEM = "stdin"
ALL = "all"
# openai-whisper's name for plain text, accepted beside ours.
FORMAT_ALIASES = {"txt": ResponseFormat.TEXT.value}
CHOICES = (*(f.value for f in ResponseFormat), *FORMAT_ALIASES, ALL)
# What `all` writes: openai-whisper's five formats.
ALL_FORMATS = (ResponseFormat.TEXT, ResponseFormat.SRT, ResponseFormat.VTT, ResponseFormat.TSV, ResponseFormat.JSON)
EXTENSIONS = {
    ResponseFormat.TEXT: "txt",
    ResponseFormat.JSON: "json",
    ResponseFormat.VERBOSE_JSON: "json",
    ResponseFormat.SRT: "srt",
    ResponseFormat.VTT: "vtt",
    ResponseFormat.TSV: "tsv",
}


def output_formats(choice: str) -> tuple[ResponseFormat, ...]:
    """The formats a --format choice writes ("all" is several)."""
    if choice == ALL:
        return ALL_FORMATS
    return (ResponseFormat(FORMAT_ALIASES.get(choice, choice)),)


@dataclass(frozen=True)
class Input:
    """One audio input as given on the command line: a path, or "-" for standard input."""

    name: str

    @property
    def stem(self) -> str:
        return STDIN_STEM if self.name == STDIN else Path(self.name).stem


def unique_stems(inputs: Sequence[Input]) -> list[str]:
    """Each input's output stem, in order: its own, or `<stem>-N` when an earlier
    input (or another input's own stem) already has it."""
    wanted = {i.stem for i in inputs}
    taken: set[str] = set()
    stems = []
    for item in inputs:
        stem, number = item.stem, 1
        while stem in taken or (stem != item.stem and stem in wanted):
            number += 1
            stem = f"{item.stem}-{number}"
        taken.add(stem)
        stems.append(stem)
    return stems


def write_files(
    directory: Path, stem: str, formats: Sequence[ResponseFormat], document: Document, layout: SubtitleOptions
) -> list[Path]:
    """Write `document` in each format as `directory/<stem>.<ext>`; the paths written."""
    paths = []
    for response_format in formats:
        path = directory / f"{stem}.{EXTENSIONS[response_format]}"
        path.write_text(document.render(response_format, layout=layout), encoding="utf-8")
        paths.append(path)
    return paths


class StdoutDocument:
    """Transcripts written one after another to `stream` as one document of `response_format`.

    several: more than one input, so each transcript is named (and SRT cues numbered on).
    """

    def __init__(self, stream: TextIO, response_format: ResponseFormat, layout: SubtitleOptions, several: bool):
        self.stream, self.format, self.layout, self.several = stream, response_format, layout, several
        self._cues = 0  # SRT cues written so far
        self._started = False  # something was written (subtitle formats: a header, a cue)

    def write(self, name: str, document: Document) -> None:
        self.stream.write(self._render(name, document))
        self.stream.flush()

    def _render(self, name: str, document: Document) -> str:
        label = name if self.several else None
        if self.format is ResponseFormat.SRT:
            cues = subtitles.subtitle_cues(document.segments, self.layout)
            text = subtitles.srt(cues, first_index=self._cues + 1)
            self._cues += len(cues)
        elif self.format is ResponseFormat.VTT:
            cues = subtitles.subtitle_cues(document.segments, self.layout)
            text = subtitles.vtt(cues, header=not self._started, note=label)
        elif self.format is ResponseFormat.TSV:
            text = subtitles.tsv(document.segments, header=not self._started, file=label)
        elif self.format is ResponseFormat.TEXT:
            rendered = document.render(self.format)
            return f"==> {name} <==\n{rendered}\n" if self.several else rendered
        elif self.several:  # JSON lines, each naming its file
            return document.render(self.format, file=name)
        else:  # one file: exactly the server's (and OpenAI's) json or verbose_json
            return document.render(self.format)
        separator = "\n" if self._started and text and self.format is not ResponseFormat.TSV else ""
        self._started = self._started or bool(text)
        return separator + text
