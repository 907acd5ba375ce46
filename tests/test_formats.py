import json

import pytest

from python_backend_lib import formats
from python_backend_lib.formats import TimedText

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
