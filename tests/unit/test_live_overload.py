"""A live turn's final transcription that the server refuses as overloaded is asked again
(gateway.realtime.Session, live_turn.FINAL_RETRY_PAUSES_S): the turn completes once the server has
room, fails after the last pause, and any other failure fails it at once. While it waits,
the process's sessions send no hypotheses (gateway.finals_first). The session is
driven without a WebSocket, its turns transcribed by the library's pipeline with the
packaged tiny.en; the refusals are the whisper model's own, as Triton hands them on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_hypothesis_window import Events, LibraryTranscriber
from test_outcomes import overloaded  # a full whisper instance's refusal, from its request ledger
from tritonclient.utils import InferenceServerException

from gateway import live_turn
from gateway.finals_first import FinalsFirst
from gateway.realtime import RealtimeOptions, Session
from gateway.realtime_protocol import SessionSettings
from python_backend_lib.audio.decode import decode_audio
from python_backend_lib.serving.responses import describe_failure

AUDIO = Path(__file__).resolve().parents[1] / "data" / "audio"


def refusal(error: Exception) -> InferenceServerException:
    """`error` as a gRPC client of the `transcribe` ensemble receives it from the whisper model."""
    message, _ = describe_failure(error)
    return InferenceServerException(msg=f"in ensemble 'transcribe', {message}", status="StatusCode.UNAVAILABLE")


class RefusingTranscriber(LibraryTranscriber):
    """Refuses its first `refusals` transcriptions with `error`, then transcribes."""

    def __init__(self, pipeline, error: InferenceServerException, refusals: int) -> None:
        super().__init__(pipeline)
        self.error, self.refusals, self.asked = error, refusals, 0

    async def transcribe(self, audio, model, language, prompt):
        self.asked += 1
        if self.asked <= self.refusals:
            raise self.error
        return await super().transcribe(audio, model, language, prompt)


@pytest.fixture(scope="module")
def pipeline():
    from python_backend_lib.transcription.pipeline import Pipeline

    pipe = Pipeline.load("default", device="cpu")
    yield pipe
    pipe.close()


def one_turn(transcriber) -> list[dict]:
    """One turn of the JFK recording, committed at once (no hypotheses): the events sent."""
    audio = decode_audio((AUDIO / "jfk.wav").read_bytes())
    events = Events()
    options = RealtimeOptions(model_ids=("tiny.en",), detector=lambda: None, hypothesis_every_s=30.0)

    async def run() -> None:
        session = Session(events, transcriber, options)
        session.settings = SessionSettings(model="tiny.en", turn_detection=None)
        session.open_turn(0, audio)
        task = session.turn.task
        await session.close_turn()
        await asyncio.wait_for(task, 120)

    asyncio.run(run())
    return [e for e in events.sent if e["type"].startswith("conversation.item.input_audio_transcription.")]


@pytest.fixture
def no_pauses(monkeypatch):
    monkeypatch.setattr(live_turn, "FINAL_RETRY_PAUSES_S", (0.0, 0.0, 0.0))


def test_a_turn_refused_as_overloaded_completes_once_the_server_has_room(pipeline, no_pauses):
    transcriber = RefusingTranscriber(pipeline, refusal(overloaded()), refusals=2)
    events = one_turn(transcriber)
    assert [e["type"].rsplit(".", 1)[-1] for e in events if not e["type"].endswith("delta")] == ["completed"]
    assert "fellow Americans" in events[-1]["transcript"] and transcriber.asked == 3


def test_a_turn_still_refused_after_the_last_pause_fails(pipeline, no_pauses):
    transcriber = RefusingTranscriber(pipeline, refusal(overloaded()), refusals=10)
    events = one_turn(transcriber)
    assert [e["type"] for e in events] == ["conversation.item.input_audio_transcription.failed"]
    assert "server overloaded" in events[0]["error"]["message"] and transcriber.asked == 4  # 3 pauses, 4 tries


def test_any_other_failure_fails_the_turn_at_once(pipeline, no_pauses):
    broken = refusal(RuntimeError("a CUDA error"))
    transcriber = RefusingTranscriber(pipeline, broken, refusals=1)
    events = one_turn(transcriber)
    assert [e["type"] for e in events] == ["conversation.item.input_audio_transcription.failed"]
    assert transcriber.asked == 1


def test_no_hypothesis_is_sent_while_another_sessions_final_waits_for_room(pipeline, monkeypatch):
    """Hypotheses sent every cadence would take the room a refused final waits for: while
    one session's final waits, another session of the process skips its hypotheses, and
    sends them again once the final is answered."""
    monkeypatch.setattr(live_turn, "FINAL_RETRY_PAUSES_S", (0.5,))
    audio = decode_audio((AUDIO / "jfk.wav").read_bytes())
    options = RealtimeOptions(model_ids=("tiny.en",), detector=lambda: None)
    settings = SessionSettings(model="tiny.en", turn_detection=None)
    finals = FinalsFirst()
    refused_once = RefusingTranscriber(pipeline, refusal(overloaded()), refusals=1)
    other = RefusingTranscriber(pipeline, refusal(overloaded()), refusals=0)

    async def run():
        waiting = Session(Events(), refused_once, options, finals)
        sending = Session(Events(), other, options, finals)
        final = asyncio.create_task(waiting.turns._final(audio, settings))
        await asyncio.sleep(0.2)  # refused at once, now in its pause (or asked again: still held)
        held = finals.holding
        during = await sending.turns._hypothesis(audio, settings, None)
        transcript = await asyncio.wait_for(final, 120)
        after = await sending.turns._hypothesis(audio, settings, None)
        return held, during, transcript, after

    held, during, transcript, after = asyncio.run(run())
    assert held and during is None
    assert "fellow Americans" in transcript.text and refused_once.asked == 2
    assert after is not None and "fellow Americans" in after.text
    assert other.asked == 1 and not finals.holding  # the one hypothesis sent, after the final
