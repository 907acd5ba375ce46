import dataclasses
import json
import math

import pytest

from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.languages import LANGUAGE_CODES, LANGUAGE_NAMES, language_code, language_name
from python_backend_lib.core.options import DecodingOptions, Task, TranscribeOptions
from python_backend_lib.core.segments import Segment, Word
from python_backend_lib.text import formats
from python_backend_lib.text.formats import Document, ResponseFormat, TimedText

SEGMENTS = (
    TimedText(start=0.0, end=2.5, text=" And so my fellow Americans,"),
    TimedText(start=2.5, end=3725.5, text=" ask not."),
)


@pytest.mark.parametrize(
    ("seconds", "marker", "expected"),
    [
        (0.0, ",", "00:00:00,000"),
        (0.02, ".", "00:00:00.020"),
        (59.9994, ",", "00:00:59,999"),
        (59.9996, ",", "00:01:00,000"),
        (3725.5, ",", "01:02:05,500"),
        (36000.0, ".", "10:00:00.000"),
    ],
)
def test_format_timestamp(seconds, marker, expected):
    assert formats.format_timestamp(seconds, marker) == expected


def test_format_timestamp_rejects_negative_time():
    with pytest.raises(ValueError, match="negative"):
        formats.format_timestamp(-0.5, ",")


def test_srt_numbers_cues_with_comma_milliseconds():
    assert formats.to_srt(SEGMENTS) == (
        "1\n00:00:00,000 --> 00:00:02,500\nAnd so my fellow Americans,\n"
        "\n"
        "2\n00:00:02,500 --> 01:02:05,500\nask not.\n"
    )


def test_vtt_has_header_and_dot_milliseconds():
    assert formats.to_vtt(SEGMENTS) == (
        "WEBVTT\n"
        "\n"
        "00:00:00.000 --> 00:00:02.500\nAnd so my fellow Americans,\n"
        "\n"
        "00:00:02.500 --> 01:02:05.500\nask not.\n"
    )


def test_empty_transcript_formats():
    assert formats.to_srt(()) == ""
    assert formats.to_vtt(()) == "WEBVTT\n"
    assert formats.to_text("") == "\n"


def test_text_is_the_stripped_transcript_on_one_line():
    assert formats.to_text(" And so.") == "And so.\n"


def test_json_puts_extra_fields_first():
    line = formats.to_json(" And so.", SEGMENTS[:1], file="jfk.wav")
    assert line.endswith("\n")
    record = json.loads(line)
    assert list(record) == ["file", "text", "segments"]
    assert record["segments"] == [{"start": 0.0, "end": 2.5, "text": " And so my fellow Americans,"}]


def test_segments_json_round_trips_exactly():
    segments = (TimedText(start=0.1 + 0.2, end=3.5025, text=" caf\u00e9"),)
    wire = formats.segments_to_json(segments)
    assert "caf\u00e9" in wire  # UTF-8, not \\u escapes
    assert formats.segments_from_json(wire) == segments
    assert formats.segments_from_json(wire.encode()) == formats.segments_from_json(wire)


@pytest.mark.parametrize("bad", ["{", '[{"start": 0}]', "[1]", "3"])
def test_segments_from_json_rejects_other_shapes(bad):
    with pytest.raises(ValueError, match="SEGMENTS"):
        formats.segments_from_json(bad)


# ---------------------------------------------------------------- the document

OPENAI_SEGMENT_FIELDS = [
    "id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob", "compression_ratio", "no_speech_prob",
]
WORDS = (Word(" Ask", 0.0, 0.4, 0.9), Word(" not.", 0.4, 1.0, 0.75))
DOCUMENT = Document(
    text="Ask not. Go.",
    segments=(
        Segment(0.0, 1.0, "Ask not.", (50364, 16, 17, 50414), id=0, seek=0, temperature=0.0,
                avg_logprob=-0.25, compression_ratio=0.8, no_speech_prob=0.01, words=WORDS),
        Segment(31.5, 32.0, "Go.", (50364, 18, 50389), id=1, seek=3000, temperature=0.2,
                avg_logprob=-0.5, compression_ratio=0.5, no_speech_prob=0.1, words=(Word(" Go.", 31.5, 31.9, 0.5),)),
    ),
    duration=32.25,
    task=Task.TRANSCRIBE,
    language="en",
    language_probability=0.96,
    word_timestamps=True,
)


def test_verbose_json_has_openais_fields_in_order_then_ours():
    record = json.loads(DOCUMENT.render(ResponseFormat.VERBOSE_JSON))
    assert list(record) == [
        "task", "language", "duration", "text", "segments", "words", "language_code", "language_probability"
    ]
    assert (record["task"], record["language"], record["duration"]) == ("transcribe", "english", 32.25)
    assert record["language_code"] == "en" and record["language_probability"] == 0.96
    assert [list(s)[:10] for s in record["segments"]] == [OPENAI_SEGMENT_FIELDS] * 2
    assert record["segments"][1] == {
        "id": 1, "seek": 3000, "start": 31.5, "end": 32.0, "text": "Go.", "tokens": [50364, 18, 50389],
        "temperature": 0.2, "avg_logprob": -0.5, "compression_ratio": 0.5, "no_speech_prob": 0.1,
        "words": [{"word": " Go.", "start": 31.5, "end": 31.9, "probability": 0.5}],
    }
    assert [w["word"] for w in record["words"]] == [" Ask", " not.", " Go."]


def test_verbose_json_without_words_has_no_words_fields():
    plain = dataclasses.replace(DOCUMENT, word_timestamps=False)
    record = json.loads(plain.render("verbose_json"))
    assert "words" not in record and all("words" not in s for s in record["segments"])


def test_verbose_json_round_trips_exactly():
    for document in (DOCUMENT, dataclasses.replace(DOCUMENT, word_timestamps=False, segments=()),
                     dataclasses.replace(DOCUMENT, task=Task.TRANSLATE, language=None, language_probability=None)):
        wire = document.render(ResponseFormat.VERBOSE_JSON)
        parsed = Document.from_verbose_json(wire)
        if not document.word_timestamps:  # words that were not asked for do not travel
            document = dataclasses.replace(document, segments=tuple(
                dataclasses.replace(s, words=()) for s in document.segments))
        assert parsed == document


def test_statistics_that_are_not_numbers_travel_as_null():
    odd = dataclasses.replace(DOCUMENT, segments=(Segment(0.0, 1.0, "Hm.", (1,)),), word_timestamps=False)
    wire = odd.render("verbose_json")
    assert "NaN" not in wire and json.loads(wire)["segments"][0]["avg_logprob"] is None
    assert math.isnan(Document.from_verbose_json(wire).segments[0].avg_logprob)


@pytest.mark.parametrize("bad", ["{", "[]", '{"text": "x"}', json.dumps({"task": "summarise", "text": "",
                                 "segments": [], "duration": 1})])
def test_from_verbose_json_rejects_other_documents(bad):
    with pytest.raises(ValueError, match="not a verbose_json transcript"):
        Document.from_verbose_json(bad)


def test_every_format_renders_from_the_document():
    assert DOCUMENT.render("text") == "Ask not. Go.\n"
    record = json.loads(DOCUMENT.render("json", file="a.wav"))
    assert list(record) == ["file", "text", "segments"]
    assert record["segments"][0]["words"][0] == {"word": " Ask", "start": 0.0, "end": 0.4, "probability": 0.9}
    assert DOCUMENT.render("srt") == formats.to_srt(DOCUMENT.segments)
    assert DOCUMENT.render("vtt").startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.000\nAsk not.\n\n00:00:31.500")
    assert json.loads(DOCUMENT.render("verbose_json", file="a.wav"))["file"] == "a.wav"
    with pytest.raises(ValueError):
        DOCUMENT.render("diarized_json")


def test_document_from_a_transcript_keeps_the_request_facts():
    from python_backend_lib.text.transcript import Transcript

    transcript = Transcript(DOCUMENT.text, DOCUMENT.segments, "en", 0.96, 32.25, windows=())
    options = TranscribeOptions(decoding=DecodingOptions(task="translate"), word_timestamps=True)
    document = Document.from_transcript(transcript, options)
    assert document == dataclasses.replace(DOCUMENT, task=Task.TRANSLATE)
    assert document.words == (*WORDS, Word(" Go.", 31.5, 31.9, 0.5))


def test_every_whisper_language_has_an_english_name():
    """One table, against openai-whisper's own: the same codes in token order,
    the same names but for two that follow ISO 639 (see core/languages.py)."""
    from whisper.tokenizer import LANGUAGES as OPENAI_WHISPER

    assert LANGUAGE_CODES == tuple(LANGUAGE_NAMES) == tuple(OPENAI_WHISPER)
    differ = {code: (name, OPENAI_WHISPER[code]) for code, name in LANGUAGE_NAMES.items() if name != OPENAI_WHISPER[code]}
    assert differ == {"my": ("burmese", "myanmar"), "nn": ("norwegian nynorsk", "nynorsk")}
    assert len(set(LANGUAGE_NAMES.values())) == len(LANGUAGE_CODES)
    assert (language_name("en"), language_code("german"), language_name("yue")) == ("english", "de", "cantonese")
    with pytest.raises(ValueError, match="unknown language code"):
        language_name("xx")


def test_temperature_ladder_stops_at_one():
    assert TranscribeOptions(decoding=DecodingOptions(temperature=0.3)).temperatures == (0.3, 0.5, 0.7, 0.9)
    assert TranscribeOptions(temperature_increment=0.5).temperatures == (0.0, 0.5, 1.0)


def test_the_temperature_ladder_is_at_most_eleven_long():
    """Each temperature is a whole decode of a window: an increment of 0.1 from 0 is the
    longest ladder taken, 0.09 is refused (its check counts, never lists, the ladder)."""
    assert len(TranscribeOptions(temperature_increment=0.1).temperatures) == 11
    assert TranscribeOptions(decoding=DecodingOptions(temperature=0.5), temperature_increment=0.05).temperatures[-1] == 1.0
    for increment in (0.09, 1e-12):
        with pytest.raises(RequestError, match="at most 11 are allowed"):
            TranscribeOptions(temperature_increment=increment)
