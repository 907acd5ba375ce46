"""The Realtime transcription session's events as JSON (gateway.realtime_protocol), without a server."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from gateway.realtime_protocol import (
    ProtocolError,
    SessionSettings,
    parse_event,
    pcm16_samples,
    updated_settings,
)
from gateway.turn_detection import ServerVad

MODELS = ("whisper-1", "tiny.en")


def test_the_ga_session_update_sets_the_transcription_and_turn_detection():
    event = {"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 24000},
        "transcription": {"model": "tiny.en", "language": "en", "prompt": "Kennedy"},
        "turn_detection": {"type": "server_vad", "threshold": 0.6, "prefix_padding_ms": 200,
                           "silence_duration_ms": 800}}}}}
    settings = updated_settings(SessionSettings(), event, MODELS)
    assert settings == SessionSettings("tiny.en", "en", "Kennedy", ServerVad(0.6, 200, 800))
    shown = settings.ga("sess_1")
    assert shown["type"] == "transcription" and shown["object"] == "realtime.transcription_session"
    assert shown["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert shown["audio"]["input"]["turn_detection"] == {"type": "server_vad", "threshold": 0.6,
                                                         "prefix_padding_ms": 200, "silence_duration_ms": 800}
    manual = updated_settings(settings, {"type": "session.update", "session": {"audio": {"input": {
        "turn_detection": None}}}}, MODELS)
    assert manual.turn_detection is None and manual.model == "tiny.en"
    assert manual.ga("sess_1")["audio"]["input"]["turn_detection"] is None


def test_the_beta_transcription_session_update_is_an_alias():
    event = {"type": "transcription_session.update", "session": {
        "input_audio_format": "pcm16", "input_audio_transcription": {"model": "whisper-1", "language": "en"},
        "turn_detection": {"type": "server_vad", "silence_duration_ms": 300}}}
    settings = updated_settings(SessionSettings(), event, MODELS)
    assert settings == SessionSettings("whisper-1", "en", None, ServerVad(silence_duration_ms=300))
    assert settings.beta("sess_1")["input_audio_format"] == "pcm16"


@pytest.mark.parametrize(("session", "param"), [
    ({"type": "realtime"}, "session.type"),
    ({"audio": {"input": {"format": {"type": "audio/pcmu"}}}}, "session.audio.input.format"),
    ({"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}, "session.audio.input.turn_detection.type"),
    ({"audio": {"input": {"turn_detection": {"prefix_padding_ms": "300"}}}}, "session.audio.input.turn_detection"),
    ({"audio": {"input": {"transcription": {"model": "gpt-4o-transcribe"}}}}, "transcription.model"),
    ({"audio": {"input": {"transcription": {"language": 3}}}}, "transcription.language"),
    ({"audio": {"input": {"noise_reduction": {"type": "near_field"}}}}, "noise_reduction"),
    ({"audio": {"input": {"speed": 2}}}, "session.audio.input.speed"),
    ({"audio": []}, "session.audio"),
])
def test_a_bad_session_update_names_its_field(session, param):
    with pytest.raises(ProtocolError) as caught:
        updated_settings(SessionSettings(), {"type": "session.update", "session": session}, MODELS)
    assert caught.value.param == param


def test_client_events_are_checked():
    assert parse_event(json.dumps({"type": "input_audio_buffer.commit"}))["type"] == "input_audio_buffer.commit"
    with pytest.raises(ProtocolError, match="not JSON"):
        parse_event("{")
    with pytest.raises(ProtocolError, match="unknown event type 'response.create'") as caught:
        parse_event(json.dumps({"type": "response.create", "event_id": "e1"}))
    assert caught.value.event_id == "e1"


def test_appended_audio_is_little_endian_pcm16():
    samples = np.array([0, 16384, -32768, 32767], dtype="<i2")
    audio = pcm16_samples({"audio": base64.b64encode(samples.tobytes()).decode()})
    assert audio.tolist() == [0.0, 0.5, -1.0, 32767 / 32768]
    for bad in ({"audio": "not base64!"}, {"audio": base64.b64encode(b"odd").decode()}, {}):
        with pytest.raises(ProtocolError):
            pcm16_samples(bad)


def test_the_api_key_comes_as_a_bearer_header_or_a_browsers_subprotocol():
    from gateway.realtime import _authorized

    assert _authorized("Bearer s3cret", [], "s3cret")
    assert _authorized(None, ["realtime", "openai-insecure-api-key.s3cret"], "s3cret")
    assert not _authorized(None, ["realtime"], "s3cret")
    assert not _authorized("Bearer other", ["openai-insecure-api-key.other"], "s3cret")
    assert not _authorized("s3cret", [], "s3cret")  # without "Bearer "


def test_a_hypothesis_in_flight_is_cancelled_when_its_turn_ends():
    """The turn's final transcription must not wait behind a hypothesis nobody needs."""
    import asyncio

    from gateway.live_turn import Turn, TurnTranscription

    async def scenario() -> tuple[object, object, bool]:
        finished = Turn("item_a", 0)
        quick = await TurnTranscription._unless_ended(finished, asyncio.sleep(0, result="hypothesis"))
        cancelled = asyncio.Event()

        async def slow() -> str:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return "too late"

        turn = Turn("item_b", 0)
        asyncio.get_running_loop().call_later(0.05, turn.close)
        late = await asyncio.wait_for(TurnTranscription._unless_ended(turn, slow()), 5)
        return quick, late, cancelled.is_set()

    assert asyncio.run(scenario()) == ("hypothesis", None, True)
