"""Reading the streamed path's responses, without a server: overtaken responses add
nothing, nothing sent is taken back, and the end is the whole transcript.

The server's responses can overtake one another (postprocessing runs several
instances), which a test against the server cannot force; here they come in
every order."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

from clients.api import TranscriptOutputs
from clients.streaming import TranscriptStream, verbose_line
from gateway.openai_errors import ApiError
from gateway.transcript_events import StreamedReply, TextDeltas, stream_events
from python_backend_lib.text.formats import TimedText, segments_to_json

SEGMENTS = (TimedText(0.0, 4.0, " One."), TimedText(4.0, 9.5, " Two,"), TimedText(9.5, 31.0, " three."))


def so_far(count: int) -> TranscriptOutputs:
    """The transcript of the first `count` segments, as a response of transcribe_stream holds it."""
    text = "".join(s.text for s in SEGMENTS[:count]).strip()
    return TranscriptOutputs(text=text, segments=segments_to_json(SEGMENTS[:count]), formatted=text)


@pytest.mark.parametrize("order", list(itertools.permutations([1, 2])))
def test_overtaken_responses_add_nothing(order):
    stream = TranscriptStream()
    updates = [stream.update(so_far(count), final=False) for count in order]
    last = stream.update(so_far(3), final=True)
    told = [s for u in updates if u is not None for s in u.new_segments] + list(last.new_segments)
    assert tuple(told) == SEGMENTS and last.outputs == so_far(3) and last.final


def test_a_reading_that_does_not_extend_the_segments_waits_for_the_final_one():
    """A window decoded again by the temperature fallback read its first segment otherwise:
    the response with that reading adds nothing; the final one replaces the transcript and
    hands on its segments from where the readings part."""
    reread = (TimedText(0.0, 4.0, " Won."), *SEGMENTS[1:])
    outputs = [TranscriptOutputs(text="", segments=segments_to_json(segments), formatted="")
               for segments in (SEGMENTS[:1], reread[:2], reread)]
    stream = TranscriptStream()
    assert stream.update(outputs[0], final=False).new_segments == SEGMENTS[:1]
    assert stream.update(outputs[1], final=False) is None
    last = stream.update(outputs[2], final=True)
    assert last.new_segments == reread and last.segments == reread and last.outputs == outputs[2]


def test_the_final_flag_on_an_overtaken_response_keeps_the_whole_transcript():
    stream = TranscriptStream()
    assert stream.update(so_far(3), final=False).new_segments == SEGMENTS
    last = stream.update(so_far(2), final=True)  # the final flag came with an older response
    assert last.final and last.new_segments == () and last.outputs == so_far(3)


def test_an_empty_final_response_ends_the_stream():
    stream = TranscriptStream()
    stream.update(so_far(3), final=False)
    assert stream.update(None, final=True).outputs == so_far(3)


def test_deltas_are_never_taken_back():
    deltas = TextDeltas()
    assert deltas.delta("One. Two,") == "One. Two,"
    assert deltas.delta("One.") == ""  # overtaken
    assert deltas.delta("One. Two, three.") == " three."
    assert deltas.delta("One. Too, three. Four") == ""  # not a continuation: nothing to take back


def events_of(replies: list[StreamedReply]) -> list[dict]:
    async def run() -> list[bytes]:
        async def rest():
            for reply in replies[1:]:
                yield reply

        return [event async for event in stream_events(replies[0], rest(), on_abandoned=lambda: None)]

    return [json.loads(event.decode().removeprefix("data: ")) for event in asyncio.run(run())]


def reply(count: int, final: bool = False) -> StreamedReply:
    outputs = so_far(count)
    return StreamedReply(outputs.text, json.dumps({"duration": 31.0}), None, final)


def test_events_join_to_the_whole_text_whatever_the_order():
    events = events_of([reply(2), reply(1), reply(3), reply(2, final=True)])
    *deltas, done = events
    assert [e["type"] for e in deltas] == ["transcript.text.delta"] * 2
    assert "".join(e["delta"] for e in deltas) == done["text"] == so_far(3).text
    assert done == {"type": "transcript.text.done", "text": so_far(3).text,
                    "usage": {"type": "duration", "seconds": 31.0}}


def test_an_error_after_the_first_event_is_an_error_event():
    failed = StreamedReply(None, None, ApiError(500, "internal error: it broke", code="server_error"), final=True)
    events = events_of([reply(1), failed])
    assert events[-1] == {"error": {"message": "internal error: it broke", "type": "server_error",
                                    "param": None, "code": "server_error"}}


def test_verbose_lines_are_openai_whispers():
    assert verbose_line(TimedText(0.0, 4.0, " And so")) == "[00:00.000 --> 00:04.000]  And so"
    assert verbose_line(TimedText(3599.5, 3725.25, "late")) == "[59:59.500 --> 01:02:05.250]  late"
