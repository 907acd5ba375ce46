"""Subtitle cues against openai-whisper's own subtitle writers, on the same words."""

from __future__ import annotations

import io
import random
import re

import pytest

from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.segments import Segment, Word
from python_backend_lib.text import subtitles
from python_backend_lib.text.subtitles import Cue, SubtitleOptions, subtitle_cues

whisper_utils = pytest.importorskip("whisper.utils")

VOCABULARY = ["ask", "not", "what", "your", "country", "can", "do", "for", "you,", "Americans.", "fellow", "--> x"]


def random_segments(seed: int) -> tuple[Segment, ...]:
    """Segments of timed words with pauses, some over 3 s, as the aligner makes them."""
    rng = random.Random(seed)
    time, segments = rng.uniform(0, 2), []
    for _ in range(rng.randint(1, 5)):
        words = []
        for _ in range(rng.randint(1, 14)):
            time += rng.choice([0.0, 0.1, 0.3, 3.5]) if words else rng.uniform(0, 4)
            length = rng.uniform(0.1, 0.8)
            words.append(Word(" " + rng.choice(VOCABULARY), round(time, 3), round(time + length, 3), 0.9))
            time += length
        text = "".join(w.word for w in words)
        segments.append(Segment(words[0].start, words[-1].end, text, (), words=tuple(words)))
    return tuple(segments)


def reference_srt(segments, options: SubtitleOptions) -> str:
    """openai-whisper's WriteSRT on the same result."""
    result = {
        "segments": [
            {"start": s.start, "end": s.end, "text": s.text,
             "words": [{"word": w.word, "start": w.start, "end": w.end} for w in s.words]}
            for s in segments
        ]
    }
    if not any(s.words for s in segments):
        for record in result["segments"]:
            del record["words"]
    out = io.StringIO()
    whisper_utils.WriteSRT(".").write_result(
        result, out, max_line_width=options.max_line_width, max_line_count=options.max_line_count,
        highlight_words=options.highlight_words,
    )
    return out.getvalue()


def parsed(srt: str) -> list[tuple[str, str, str]]:
    """(start, end, text) of each SRT cue, numbered 1, 2, ... in order."""
    blocks = [b for b in srt.strip("\n").split("\n\n") if b]
    cues = []
    for number, block in enumerate(blocks, start=1):
        index, times, *lines = block.split("\n")
        assert index == str(number)
        start, end = times.split(" --> ")
        cues.append((start, end, "\n".join(lines)))
    return cues


LAYOUTS = [
    SubtitleOptions(),
    SubtitleOptions(max_line_width=20),
    SubtitleOptions(max_line_width=20, max_line_count=2),
    SubtitleOptions(max_line_width=42, max_line_count=1),
    SubtitleOptions(max_line_count=2),
    SubtitleOptions(highlight_words=True),
    SubtitleOptions(max_line_width=16, max_line_count=2, highlight_words=True),
]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda o: f"w{o.max_line_width}-c{o.max_line_count}-h{o.highlight_words}")
def test_word_cues_are_openai_whispers(seed, layout):
    segments = random_segments(seed)
    ours = parsed(subtitles.srt(subtitle_cues(segments, layout)))
    theirs = parsed(reference_srt(segments, layout))
    # openai-whisper leaves "-->" inside a word-timed cue, which ends the cue's text
    # for any SRT reader; ours writes "->" there, as it does for segment cues.
    assert ours == [(start, end, text.replace("-->", "->")) for start, end, text in theirs]


def test_without_words_each_segment_is_a_cue():
    segments = random_segments(3)
    plain = tuple(Segment(s.start, s.end, s.text, ()) for s in segments)
    assert parsed(subtitles.srt(subtitle_cues(plain, SubtitleOptions(max_line_width=10)))) == parsed(
        reference_srt(plain, SubtitleOptions())
    )


def test_word_timestamps_change_what_subtitles_show():
    words = (Word(" Ask", 0.5, 0.9, 0.9), Word(" not.", 1.0, 1.4, 0.9))
    segment = Segment(0.0, 2.0, " Ask not.", (), words=words)
    assert subtitle_cues((segment,)) == [Cue(0.5, 1.4, "Ask not.")]
    assert subtitle_cues((segment,), SubtitleOptions(highlight_words=True)) == [
        Cue(0.5, 0.9, "<u>Ask</u> not."),
        Cue(0.9, 1.0, "Ask not."),
        Cue(1.0, 1.4, "Ask <u>not.</u>"),
    ]
    assert subtitle_cues((segment,), SubtitleOptions(max_line_width=4)) == [Cue(0.5, 1.4, "Ask\nnot.")]


def test_files_follow_each_other_in_one_valid_document():
    first = [Cue(0.0, 1.0, "one")]
    second = [Cue(0.5, 2.0, "two"), Cue(2.0, 3.0, "three")]
    joined = subtitles.srt(first) + "\n" + subtitles.srt(second, first_index=2)
    assert [c[2] for c in parsed(joined)] == ["one", "two", "three"]
    document = subtitles.vtt(first, note="a.wav") + "\n" + subtitles.vtt(second, header=False, note="b --> c.wav")
    assert document.startswith("WEBVTT\n\nNOTE a.wav\n\n00:00:00.000 --> 00:00:01.000\none\n")
    assert "\nNOTE b -> c.wav\n\n00:00:00.500 --> 00:00:02.000\ntwo\n" in document
    assert document.count("WEBVTT") == 1


def test_tsv_is_openai_whispers():
    segments = random_segments(5)
    out = io.StringIO()
    whisper_utils.WriteTSV(".").write_result({"segments": [{"start": s.start, "end": s.end, "text": s.text}
                                                           for s in segments]}, out)
    assert subtitles.tsv(segments) == out.getvalue()
    with_file = subtitles.tsv(segments, file="a.wav", header=False).splitlines()
    assert [line.split("\t", 1) for line in with_file] == [["a.wav", line] for line in out.getvalue().splitlines()[1:]]


@pytest.mark.parametrize("bad", [{"max_line_width": 0}, {"max_line_count": -1}, {"max_line_width": 2.5}])
def test_bad_layouts_are_refused(bad):
    with pytest.raises(RequestError, match=re.escape(next(iter(bad)))):
        SubtitleOptions(**bad)
