"""A live transcription session over a WebSocket: OpenAI's Realtime API with
`intent=transcription`, as the gateway serves it at /v1/realtime.

The client streams 24 kHz pcm16 (`input_audio_buffer.append`); it is resampled
to Whisper's 16 kHz as it comes. Turns are cut by `server_vad` turn detection
(`turn_detection`) or by the client's `input_audio_buffer.commit`. While a turn
grows, hypotheses of its audio so far are transcribed through Triton (from near
the words already committed on: `hypothesis_window`), and the words two consecutive
hypotheses agree on, and are sure of, are sent as deltas (`local_agreement`); when
the turn ends, its whole audio is transcribed once more, as a file would be, and
that is the `completed` transcript (the last delta is its words past the committed
ones). This module holds the session's events and audio, `live_turn` each turn's
requests. Every transcription is an ordinary request to Triton's `transcribe`
ensemble, so live sessions share the engine with batch requests; a session that
ends cancels its requests in flight.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway import realtime_protocol as protocol
from gateway.finals_first import FinalsFirst
from gateway.live_transcriber import Transcriber
from gateway.live_turn import HYPOTHESIS_STEP_S, Turn, TurnTranscription, check_hypothesis_every
from gateway.openai_errors import unauthorized
from gateway.realtime_protocol import ProtocolError, SessionSettings
from gateway.session_slots import SessionSlots
from gateway.turn_detection import SpeechProbability, SpeechStarted, TurnDetector
from python_backend_lib.core.geometry import SAMPLE_RATE

if TYPE_CHECKING:
    from starlette.websockets import WebSocket

    from gateway.triton_calls import TritonCalls

DEFAULT_MAX_SESSIONS = 100
MIN_COMMIT_S = 0.1  # OpenAI refuses to commit less than 100 ms of audio
# How much audio before the present a server_vad turn can reach back for its prefix padding.
RECENT_S = 2.0
# WebSocket close codes (RFC 6455): policy violation, and "try again later".
CLOSE_POLICY = 1008
CLOSE_TRY_LATER = 1013
INSECURE_KEY_PROTOCOL = "openai-insecure-api-key."  # how a browser, which cannot set headers, sends the key
SUBPROTOCOL = "realtime"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RealtimeOptions:
    """model_ids: the transcription models a session may name; max_sessions: live sessions
    at once, one more is refused; detector: makes a session's speech detector;
    hypothesis_every_s: a turn's next hypothesis once it has grown by this much audio."""

    model_ids: tuple[str, ...]
    detector: Callable[[], SpeechProbability]
    max_sessions: int = DEFAULT_MAX_SESSIONS
    api_key: str | None = field(default=None, repr=False)
    hypothesis_every_s: float = HYPOTHESIS_STEP_S

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError(f"the live session limit must be at least 1, got {self.max_sessions}")
        check_hypothesis_every(self.hypothesis_every_s)


async def serve(websocket: WebSocket, calls: TritonCalls, options: RealtimeOptions, slots: SessionSlots,
                finals: FinalsFirst) -> None:
    """One WebSocket connection, from the handshake to its close; `calls`: the gateway's to Triton;
    `slots` and `finals`: what this process's sessions share."""
    offered = list(websocket.scope.get("subprotocols", []))
    header = websocket.headers.get("authorization")
    refused = options.api_key is not None and not _authorized(header, offered, options.api_key)
    await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
    if refused:  # accepted first, so that the client reads why, as HTTP's 401 says it (a bare 403 says nothing)
        keyed = header is not None or any(p.startswith(INSECURE_KEY_PROTOCOL) for p in offered)
        message = unauthorized(header).message if header is not None or not keyed else "incorrect API key"
        await _refuse(websocket, ProtocolError(message, code="invalid_api_key"), CLOSE_POLICY)
        return
    intent = websocket.query_params.get("intent")
    if intent != protocol.INTENT:
        await _refuse(websocket, ProtocolError(f"this endpoint serves transcription sessions: connect to "
                                               f"/v1/realtime?intent={protocol.INTENT} (got intent={intent!r})",
                                               code="invalid_intent", param="intent"), CLOSE_POLICY)
        return
    if not slots.take():
        await _refuse(websocket, ProtocolError(f"the server is at its limit of {slots.limit} live sessions: "
                                               "try again later", code="session_limit_reached"), CLOSE_TRY_LATER)
        return
    try:
        await Session(websocket, Transcriber(calls), options, finals).run()
    finally:
        slots.release()


def _authorized(header: str | None, offered: Sequence[str], key: str) -> bool:
    given = [header.removeprefix("Bearer ")] if header and header.startswith("Bearer ") else []
    given += [p.removeprefix(INSECURE_KEY_PROTOCOL) for p in offered if p.startswith(INSECURE_KEY_PROTOCOL)]
    return any(secrets.compare_digest(g.encode(), key.encode()) for g in given)


async def _refuse(websocket: WebSocket, error: ProtocolError, code: int) -> None:
    await websocket.send_text(json.dumps(protocol.error_event(error)))
    await websocket.close(code, error.code)


# ------------------------------------------------------------- a session


class Session:
    """The events of one connection, and the turns they make."""

    def __init__(self, websocket: WebSocket, transcriber: Transcriber, options: RealtimeOptions,
                 finals: FinalsFirst | None = None) -> None:
        """finals: this process's sessions' gate (`serve` passes the app's); None: one of its own."""
        import soxr

        self.websocket, self.options = websocket, options
        self.id = protocol.new_id("sess")
        self.turns = TurnTranscription(transcriber, finals if finals is not None else FinalsFirst(),
                                       options.hypothesis_every_s, self.send, self.id)
        self.settings = SessionSettings(model=options.model_ids[0])
        self.new_resampler = lambda: soxr.ResampleStream(protocol.INPUT_RATE, SAMPLE_RATE, 1, dtype="float32")
        self.resampler = self.new_resampler()
        self.position = 0  # samples of 16 kHz audio so far
        self.recent = np.zeros(0, np.float32)  # the last RECENT_S of it, for prefix padding
        self.turn: Turn | None = None  # the open turn
        self.detector = self._turn_detector()
        self.finishing: set[Turn] = set()  # committed turns still being transcribed
        self.previous_item_id: str | None = None
        self.last_turn: Turn | None = None  # the turn opened last, which the next completes after
        self.send_lock = asyncio.Lock()
        self.closed = False

    async def run(self) -> None:
        await self.send(protocol.server_event("session.created", session=self.settings.ga(self.id)))
        try:
            while True:
                message = await self.websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                try:
                    await self.handle(message.get("text") if message.get("text") is not None else message["bytes"])
                except ProtocolError as error:
                    await self.send(protocol.error_event(error))
        finally:
            self.closed = True
            for turn in [*self.finishing, *([self.turn] if self.turn else [])]:
                if turn.task is not None:
                    turn.task.cancel()
            tasks = [t.task for t in [*self.finishing, *([self.turn] if self.turn else [])] if t.task]
            await asyncio.gather(*tasks, return_exceptions=True)

    async def handle(self, message: str | bytes) -> None:
        event = protocol.parse_event(message)
        kind = event["type"]
        try:
            if kind in (protocol.SESSION_UPDATE, protocol.BETA_SESSION_UPDATE):
                await self.update(event)
            elif kind == protocol.APPEND:
                await self.append(protocol.pcm16_samples(event))
            elif kind == protocol.COMMIT:
                await self.commit()
            else:
                await self.clear()
        except ProtocolError as error:
            error.event_id = error.event_id or event.get("event_id")
            raise

    async def update(self, event: dict[str, Any]) -> None:
        settings = protocol.updated_settings(self.settings, event, self.options.model_ids)
        vad_changed = settings.turn_detection != self.settings.turn_detection
        self.settings = settings
        if vad_changed:
            self.detector = self._turn_detector()
        if event["type"] == protocol.SESSION_UPDATE:
            await self.send(protocol.server_event("session.updated", session=settings.ga(self.id)))
        else:
            await self.send(protocol.server_event("transcription_session.updated", session=settings.beta(self.id)))

    def _turn_detector(self) -> TurnDetector | None:
        vad = self.settings.turn_detection
        floor = self.turn.start if self.turn is not None else self.position
        return None if vad is None else TurnDetector(vad, self.options.detector(), position=self.position,
                                                     floor=floor)

    async def append(self, samples: np.ndarray) -> None:
        await self.add_audio(self.resampler.resample_chunk(samples))

    async def add_audio(self, audio: np.ndarray) -> None:
        self.position += len(audio)
        self.recent = np.concatenate([self.recent, audio])[-int(RECENT_S * SAMPLE_RATE):]
        if self.turn is not None:
            self.turn.add(audio)
        elif self.detector is None and len(audio):
            self.open_turn(self.position - len(audio), audio)
        if self.detector is None:
            return
        for event in self.detector.feed(audio):
            if isinstance(event, SpeechStarted):
                if self.turn is None:
                    start = max(event.start, self.position - len(self.recent))
                    self.open_turn(start, self.recent[len(self.recent) - (self.position - start):])
                    await self.send(protocol.server_event(
                        "input_audio_buffer.speech_started", item_id=self.turn.item_id,
                        audio_start_ms=start * 1000 // SAMPLE_RATE,
                    ))  # fmt: skip
            elif self.turn is not None:
                item_id = self.turn.item_id
                await self.send(protocol.server_event("input_audio_buffer.speech_stopped", item_id=item_id,
                                                      audio_end_ms=event.end * 1000 // SAMPLE_RATE))
                await self.close_turn(event.end - self.turn.start)

    async def commit(self) -> None:
        # Everything sent so far belongs to the turn: the resampler gives up what it holds back.
        tail = self.resampler.resample_chunk(np.zeros(0, np.float32), last=True)
        self.resampler = self.new_resampler()
        await self.add_audio(tail)
        if self.turn is None or self.turn.samples < MIN_COMMIT_S * SAMPLE_RATE:
            have = 0 if self.turn is None else self.turn.samples * 1000 // SAMPLE_RATE
            raise ProtocolError(f"buffer too small: a commit needs at least {MIN_COMMIT_S * 1000:g} ms of audio, "
                                f"the input audio buffer has {have} ms", code="input_audio_buffer_commit_empty")
        if self.detector is not None:
            self.detector.reset_floor(self.position)
        await self.close_turn()

    async def clear(self) -> None:
        self.resampler = self.new_resampler()  # what it holds back goes too
        if self.turn is not None:
            if self.turn.task is not None:
                self.turn.task.cancel()
            self.turn = None
        if self.detector is not None:
            self.detector.reset_floor(self.position)
        await self.send(protocol.server_event("input_audio_buffer.cleared"))

    def open_turn(self, start: int, audio: np.ndarray) -> None:
        before, self.turn = self.last_turn, Turn(protocol.new_id("item"), start)
        self.last_turn = self.turn
        self.turn.add(audio)
        self.turn.task = asyncio.create_task(self.turns.run(self.turn, self.settings, before))

    async def close_turn(self, samples: int | None = None) -> None:
        turn, self.turn = self.turn, None
        turn.close(samples)
        self.finishing.add(turn)
        turn.task.add_done_callback(lambda _: self.finishing.discard(turn))
        await self.send(protocol.server_event("input_audio_buffer.committed", item_id=turn.item_id,
                                              previous_item_id=self.previous_item_id))
        self.previous_item_id = turn.item_id

    async def send(self, event: dict[str, Any]) -> None:
        if self.closed:
            return
        async with self.send_lock:
            try:
                await self.websocket.send_text(json.dumps(event, ensure_ascii=False))
            except Exception as error:  # the client has gone (how depends on the server): the session ends
                log.debug("live session %s: could not send %s: %s", self.id, event["type"], error)
                self.closed = True
