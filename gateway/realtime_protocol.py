"""OpenAI's Realtime transcription session as JSON: the client events the gateway
takes, checked, and the server events it sends.

Pure: no WebSocket and no Triton here (`realtime` runs the session). The
session's settings come from `session.update` in the GA shape
(`session.audio.input.{format, transcription, turn_detection}`) or from the
beta `transcription_session.update` (`input_audio_format: "pcm16"`,
`input_audio_transcription`, `turn_detection`); a mistake raises
`ProtocolError`, which the session sends back as an `error` event and goes on.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from gateway.openai_api import DEFAULT_MODEL_ID, USAGE_TYPE
from gateway.turn_detection import ServerVad

INPUT_RATE = 24_000  # OpenAI's Realtime audio: 16-bit little-endian mono PCM at 24 kHz
GA_FORMAT = {"type": "audio/pcm", "rate": INPUT_RATE}
BETA_FORMAT = "pcm16"
SESSION_OBJECT = "realtime.transcription_session"
SESSION_TYPE = "transcription"
INTENT = "transcription"  # /v1/realtime?intent=transcription
SERVER_VAD = "server_vad"

# Client event types.
SESSION_UPDATE = "session.update"
BETA_SESSION_UPDATE = "transcription_session.update"
APPEND = "input_audio_buffer.append"
COMMIT = "input_audio_buffer.commit"
CLEAR = "input_audio_buffer.clear"
CLIENT_EVENTS = (SESSION_UPDATE, BETA_SESSION_UPDATE, APPEND, COMMIT, CLEAR)


class ProtocolError(Exception):
    """A client event the session cannot take: an `error` event, and the session goes on."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None,
                 event_id: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param, self.event_id = message, code, param, event_id


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# ----------------------------------------------------------------- settings


@dataclass(frozen=True)
class SessionSettings:
    """What a session transcribes with; turn_detection None: the client commits each turn."""

    model: str = DEFAULT_MODEL_ID
    language: str | None = None
    prompt: str | None = None
    turn_detection: ServerVad | None = field(default_factory=ServerVad)

    def ga(self, session_id: str) -> dict[str, Any]:
        """The session object of `session.created` and `session.updated`."""
        return {
            "id": session_id, "object": SESSION_OBJECT, "type": SESSION_TYPE,
            "audio": {"input": {
                "format": dict(GA_FORMAT),
                "transcription": self._transcription(),
                "turn_detection": self._turn_detection(),
                "noise_reduction": None,
            }},
            "include": [],
        }

    def beta(self, session_id: str) -> dict[str, Any]:
        """The session object of the beta `transcription_session.updated`."""
        return {
            "id": session_id, "object": SESSION_OBJECT, "modalities": ["text"],
            "input_audio_format": BETA_FORMAT,
            "input_audio_transcription": self._transcription(),
            "turn_detection": self._turn_detection(),
            "input_audio_noise_reduction": None,
            "include": [],
        }

    def _transcription(self) -> dict[str, Any]:
        return {"model": self.model, "language": self.language, "prompt": self.prompt or ""}

    def _turn_detection(self) -> dict[str, Any] | None:
        vad = self.turn_detection
        if vad is None:
            return None
        return {"type": SERVER_VAD, "threshold": vad.threshold, "prefix_padding_ms": vad.prefix_padding_ms,
                "silence_duration_ms": vad.silence_duration_ms}


def updated_settings(current: SessionSettings, event: Mapping[str, Any], model_ids: Sequence[str]) -> SessionSettings:
    """The settings after a session.update or transcription_session.update event."""
    session = _object(event.get("session", {}), "session")
    if event["type"] == SESSION_UPDATE:
        _known(session, ("type", "audio", "include", "id", "object"), "session")
        if session.get("type", SESSION_TYPE) != SESSION_TYPE:
            raise ProtocolError(f"session.type must be {SESSION_TYPE!r} on this endpoint, got {session['type']!r}",
                                param="session.type")
        audio = _object(session.get("audio", {}), "session.audio")
        _known(audio, ("input",), "session.audio")
        given = _object(audio.get("input", {}), "session.audio.input")
        _known(given, ("format", "transcription", "turn_detection", "noise_reduction"), "session.audio.input")
        prefix = "session.audio.input"
        if "format" in given:
            _check_ga_format(given["format"])
    else:
        given = session
        _known(given, ("input_audio_format", "input_audio_transcription", "turn_detection",
                       "input_audio_noise_reduction", "include", "modalities", "id", "object"), "session")
        prefix = "session"
        if given.get("input_audio_format", BETA_FORMAT) != BETA_FORMAT:
            raise ProtocolError(f"input_audio_format must be {BETA_FORMAT!r}, got {given['input_audio_format']!r}",
                                param="session.input_audio_format")
        given = {"transcription": given.get("input_audio_transcription"), **given}
    _check_no_noise_reduction(given)
    settings = current
    if given.get("transcription") is not None:
        settings = _with_transcription(settings, _object(given["transcription"], f"{prefix}.transcription"),
                                       model_ids)
    if "turn_detection" in given:
        settings = replace(settings, turn_detection=_turn_detection(given["turn_detection"], prefix))
    return settings


def _check_ga_format(given: Any) -> None:
    audio_format = _object(given, "session.audio.input.format")
    if audio_format.get("type") != GA_FORMAT["type"] or audio_format.get("rate", INPUT_RATE) != INPUT_RATE:
        raise ProtocolError(f"the input audio format must be {GA_FORMAT}, got {audio_format}",
                            code="unsupported_value", param="session.audio.input.format")


def _check_no_noise_reduction(given: Mapping[str, Any]) -> None:
    for key in ("noise_reduction", "input_audio_noise_reduction"):
        if given.get(key) is not None:
            raise ProtocolError("noise reduction is not supported: leave it null", code="unsupported_value",
                                param=key)


def _with_transcription(
    settings: SessionSettings, given: Mapping[str, Any], model_ids: Sequence[str]
) -> SessionSettings:
    _known(given, ("model", "language", "prompt"), "transcription")
    model = given.get("model") or settings.model
    if model not in model_ids:
        raise ProtocolError(f"the model {model!r} does not exist; this server has {list(model_ids)}",
                            code="model_not_found", param="transcription.model")
    for key in ("language", "prompt"):
        if given.get(key) is not None and not isinstance(given[key], str):
            raise ProtocolError(f"transcription.{key} must be a string", param=f"transcription.{key}")
    return replace(settings, model=model, language=given.get("language") or None, prompt=given.get("prompt") or None)


def _turn_detection(given: Any, prefix: str) -> ServerVad | None:
    if given is None:
        return None
    vad = _object(given, f"{prefix}.turn_detection")
    if vad.get("type", SERVER_VAD) != SERVER_VAD:
        raise ProtocolError(f"turn_detection.type must be {SERVER_VAD!r} (or turn_detection null for manual "
                            f"commits), got {vad.get('type')!r}", code="unsupported_value",
                            param=f"{prefix}.turn_detection.type")
    options = {key: vad[key] for key in ("threshold", "prefix_padding_ms", "silence_duration_ms")
               if vad.get(key) is not None}
    try:
        return ServerVad(**options)
    except (TypeError, ValueError) as error:
        raise ProtocolError(f"turn_detection: {error}", param=f"{prefix}.turn_detection") from None


def _object(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ProtocolError(f"{name} must be an object, got {json.dumps(value)}", param=name)
    return value


def _known(given: Mapping[str, Any], keys: Sequence[str], name: str) -> None:
    unknown = [key for key in given if key not in keys]
    if unknown:
        raise ProtocolError(f"unknown field(s) {unknown} in {name}; it takes {list(keys)}",
                            code="unknown_parameter", param=f"{name}.{unknown[0]}")


# ------------------------------------------------------------ client events


def parse_event(message: str | bytes) -> dict[str, Any]:
    """One client event, its type known; raises ProtocolError."""
    try:
        event = json.loads(message)
    except (ValueError, UnicodeDecodeError) as error:
        raise ProtocolError(f"the message is not JSON: {error}", code="invalid_json") from None
    if not isinstance(event, dict):
        raise ProtocolError("a client event must be a JSON object", code="invalid_event")
    event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
    kind = event.get("type")
    if kind not in CLIENT_EVENTS:
        raise ProtocolError(f"unknown event type {kind!r}; a transcription session takes {list(CLIENT_EVENTS)}",
                            code="invalid_event", param="type", event_id=event_id)
    return event


def pcm16_samples(event: Mapping[str, Any]) -> np.ndarray:
    """The audio of an input_audio_buffer.append event, as floats from -1 to 1."""
    audio = event.get("audio")
    if not isinstance(audio, str):
        raise ProtocolError("input_audio_buffer.append needs `audio`: base64 of 16-bit PCM", param="audio")
    try:
        data = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ProtocolError(f"audio is not base64: {error}", param="audio") from None
    if len(data) % 2:
        raise ProtocolError("audio must be whole 16-bit samples: its length is odd", param="audio")
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


# ------------------------------------------------------------ server events


def server_event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_id("event"), **fields}


def error_event(error: ProtocolError, kind: str = "invalid_request_error") -> dict[str, Any]:
    return server_event("error", error={"type": kind, "code": error.code, "message": error.message,
                                        "param": error.param, "event_id": error.event_id})


def completed_event(item_id: str, transcript: str, seconds: float) -> dict[str, Any]:
    return server_event("conversation.item.input_audio_transcription.completed", item_id=item_id, content_index=0,
                        transcript=transcript, usage={"type": USAGE_TYPE, "seconds": round(seconds, 3)})


def delta_event(item_id: str, delta: str) -> dict[str, Any]:
    return server_event("conversation.item.input_audio_transcription.delta", item_id=item_id, content_index=0,
                        delta=delta)
