"""Beam search as accurate as faster-whisper's, with the defaults a user gets.

The packaged multilingual base on the four recordings of tests/data/multilingual,
each library's language detection, beam_size=5 and best_of=5 and every other
option left to each library's default (timestamps, the temperature fallback and
its thresholds, previous text, patience 1, the length rule, the window padding),
in float32 on the CPU: our `Pipeline.transcribe` against faster-whisper's
`WhisperModel.transcribe` on the same CTranslate2 folder. Over the four clips our
character edits are no more than faster-whisper's, we name at least as many
languages right, and each window is kept at the temperature faster-whisper keeps it. `bench.beam_wer` measures the same on 29 recordings in 9 languages
(docs/benchmarks/beam-wer/).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.beam_wer import SEARCH, edits
from bench.transcripts import words
from python_backend_lib.checkpoints.packaged import packaged_folder
from python_backend_lib.core.options import DecodingOptions, TranscribeOptions
from python_backend_lib.transcription.pipeline import Pipeline

faster_whisper = pytest.importorskip("faster_whisper")
ctranslate2 = pytest.importorskip("ctranslate2")
pytestmark = pytest.mark.slow

CHECKPOINT = "base"
DATA = Path(__file__).resolve().parents[1] / "data" / "multilingual"


@dataclass(frozen=True)
class Heard:
    language: str | None
    text: str
    temperatures: tuple[float, ...]  # each window's, where the fallback settled


@dataclass(frozen=True)
class Clip:
    file: str
    language: str
    reference: str


def clips() -> list[Clip]:
    with open(DATA / "manifest.tsv", newline="") as f:
        return [Clip(r["file"], r["language"], r["reference_text"]) for r in csv.DictReader(f, delimiter="\t")]


def character_edits(reference: str, text: str) -> int:
    """Edits between the characters of the words, spaces and punctuation left out (what
    a character error rate counts; for Japanese it is the only rate that means anything)."""
    return edits(list("".join(words(reference))), list("".join(words(text))))


def ours() -> list[Heard]:
    pipeline = Pipeline.load(CHECKPOINT, device="cpu")
    try:
        options = TranscribeOptions(decoding=DecodingOptions(timestamps=True, **SEARCH))
        heard = []
        for clip in clips():
            transcript = pipeline.transcribe((DATA / clip.file).read_bytes(), options)
            temperatures = tuple(window.temperature for window in transcript.windows)
            heard.append(Heard(transcript.language, transcript.text.strip(), temperatures))
        return heard
    finally:
        pipeline.close()


def theirs() -> list[Heard]:
    ctranslate2.set_random_seed(0)  # its temperature fallback samples
    model = faster_whisper.WhisperModel(str(packaged_folder(CHECKPOINT)), device="cpu", compute_type="float32")
    heard = []
    for clip in clips():
        segments, info = model.transcribe(io.BytesIO((DATA / clip.file).read_bytes()), beam_size=5, best_of=5)
        segments = list(segments)
        temperatures = tuple(dict.fromkeys((s.seek, s.temperature) for s in segments))  # one per window
        heard.append(Heard(info.language, "".join(s.text for s in segments).strip(), tuple(t for _, t in temperatures)))
    return heard


def test_beam_search_is_as_accurate_as_faster_whispers_by_default():
    references = clips()
    assert len(references) == 4
    mine, faster = ours(), theirs()
    report = "\n".join(f"{c.file}: ours {m.language} {m.temperatures} {m.text!r}; "
                       f"faster-whisper {f.language} {f.temperatures} {f.text!r}" for c, m, f in zip(references, mine, faster))
    # The beams' text is what both keep: a beam search that went wrong would be rescued by
    # the sampled fallback here, at another temperature than faster-whisper's.
    assert [m.temperatures for m in mine] == [f.temperatures for f in faster], report
    my_edits = sum(character_edits(c.reference, m.text) for c, m in zip(references, mine))
    their_edits = sum(character_edits(c.reference, f.text) for c, f in zip(references, faster))
    assert my_edits <= their_edits, f"{my_edits} character edits against faster-whisper's {their_edits}\n{report}"
    my_languages = sum(m.language == c.language for c, m in zip(references, mine))
    their_languages = sum(f.language == c.language for c, f in zip(references, faster))
    assert my_languages >= their_languages, report
    assert my_languages >= 3, report  # base hears most of them: a broken detection cannot pass as a tie
