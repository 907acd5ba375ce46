"""A live session's turns complete in the order they were committed, whichever the
server transcribes first (gateway.realtime.Session): the session driven without a
WebSocket, its turns transcribed by the library's pipeline with the packaged tiny.en
(the code the whisper model runs in Triton)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_hypothesis_window import Events, LibraryTranscriber

from gateway.realtime import RealtimeOptions, Session
from gateway.realtime_protocol import SessionSettings
from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.core.geometry import SAMPLE_RATE

AUDIO = Path(__file__).resolve().parents[1] / "data" / "audio"
PROMPT = "Kennedy's inaugural address."


@pytest.fixture(scope="module")
def pipeline():
    from python_backend_lib.transcription.pipeline import Pipeline

    pipe = Pipeline.load("default", device="cpu")
    yield pipe
    pipe.close()


def test_a_short_turn_committed_after_a_long_one_completes_after_it(pipeline):
    """Two turns of the JFK recording, a long one then a short one, committed at once:
    transcribed side by side, the short one is answered first (as it was before the
    session ordered them), but its completed event comes second. Each turn is the
    audio it was given, with the session's own prompt."""
    audio = decode_audio((AUDIO / "jfk.wav").read_bytes())
    cut = int(8.5 * SAMPLE_RATE)  # "...what your country can do for you," | "ask what you can do for your country."
    transcriber, events = LibraryTranscriber(pipeline), Events()
    options = RealtimeOptions(model_ids=("tiny.en",), detector=lambda: None, hypothesis_every_s=30.0)

    async def two_turns() -> None:
        session = Session(events, transcriber, options)
        session.settings = SessionSettings(model="tiny.en", turn_detection=None, prompt=PROMPT)
        tasks = []
        for start, end in ((0, cut), (cut, len(audio))):
            session.open_turn(start, audio[start:end])
            tasks.append(session.turn.task)
            await session.close_turn()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)

    asyncio.run(two_turns())
    answered = [seconds for seconds, _ in transcriber.calls]
    assert answered == [pytest.approx((len(audio) - cut) / SAMPLE_RATE), pytest.approx(cut / SAMPLE_RATE)]
    assert [prompt for _, prompt in transcriber.calls] == [PROMPT, PROMPT]
    committed = [e["item_id"] for e in events.sent if e["type"] == "input_audio_buffer.committed"]
    completed = [e for e in events.sent if e["type"].endswith(".completed")]
    assert [e["item_id"] for e in completed] == committed
    assert "fellow Americans" in completed[0]["transcript"] and "your country" in completed[1]["transcript"]
