"""A locust user holding live transcription sessions: the gateway's /v1/realtime.

Each task is one session and one turn: a clip picked at random, sent as 24 kHz
pcm16 in 100 ms chunks at the speed of speech, then committed (manual turns).
Two rows are reported per turn, request type "live":
- "live first delta": from the first audio sent to the first delta (a turn with
  no delta before its commit reports none: short clips end before a hypothesis);
- "live completed": from the commit to the completed transcript; it fails on an
  `error` or `...failed` event, on a timeout, or on an empty transcript of speech.

Run it with `python -m loadtest.run --protocols live --gateway-url http://HOST:9000/v1`.
"""

from __future__ import annotations

import base64
import io
import json
import random
import time

import gevent
import numpy as np
import soundfile
import soxr
from locust import User, between, task
from websockets.sync.client import connect

from loadtest.clips import Clip

RATE = 24_000  # what the Realtime API takes
CHUNK_S = 0.1
MODEL = "whisper-1"
REQUEST_TYPE = "live"
FIRST_DELTA = "live first delta"
COMPLETED = "live completed"


class LiveTurnFailed(Exception):
    """The session answered the turn with an error, or not in time."""


def pcm24(clip: Clip) -> bytes:
    """The clip as 24 kHz mono pcm16."""
    audio, rate = soundfile.read(io.BytesIO(clip.audio), dtype="float32", always_2d=True)
    resampled = soxr.resample(audio.mean(axis=1), rate, RATE)
    return (np.clip(resampled, -1, 1) * 32767).round().astype("<i2").tobytes()


class LiveTranscriptionUser(User):
    abstract = True  # the locustfile makes the concrete one, with its clips
    wait_time = between(0.0, 0.5)

    def clips(self) -> tuple[Clip, ...]:
        raise NotImplementedError

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.url = options.gateway_url.replace("http://", "ws://").rstrip("/") + "/realtime?intent=transcription"
        self.timeout_s = options.request_timeout
        self.headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        self.speech = [c for c in self.clips() if c.is_speech]

    @task
    def live_turn(self) -> None:
        clip = random.choice(self.speech)
        events: list[tuple[float, dict]] = []
        started = committed = time.perf_counter()
        try:
            with connect(self.url, open_timeout=self.timeout_s, max_size=None, additional_headers=self.headers) as socket:
                reader = gevent.spawn(self._read, socket, events)
                socket.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {
                    "input": {"format": {"type": "audio/pcm", "rate": RATE},
                              "transcription": {"model": MODEL, "language": "en"}, "turn_detection": None}}}}))
                audio, step = pcm24(clip), int(CHUNK_S * RATE) * 2
                started = time.perf_counter()
                for index, offset in enumerate(range(0, len(audio), step)):
                    gevent.sleep(max(0.0, started + index * CHUNK_S - time.perf_counter()))
                    socket.send(json.dumps({"type": "input_audio_buffer.append",
                                            "audio": base64.b64encode(audio[offset:offset + step]).decode()}))
                committed = time.perf_counter()
                socket.send(json.dumps({"type": "input_audio_buffer.commit"}))
                transcript = self._completed(events, committed)
                reader.kill()
        except Exception as error:  # every failure is reported to locust, not raised
            said = [event for _, event in events if event["type"] == "error"]  # the session's reason, if it gave one
            failure = LiveTurnFailed(json.dumps(said[0])[:300]) if said else error
            self._fire(COMPLETED, time.perf_counter() - committed, failure, clip)
            return
        deltas = [at for at, event in events if event["type"].endswith(".delta") and at < committed]
        if deltas:
            self._fire(FIRST_DELTA, deltas[0] - started, None, clip)
        failure = None if transcript.strip() else LiveTurnFailed(f"empty transcript of {clip.name}")
        self._fire(COMPLETED, time.perf_counter() - committed, failure, clip, len(transcript))

    @staticmethod
    def _read(socket, events: list[tuple[float, dict]]) -> None:
        for message in socket:
            events.append((time.perf_counter(), json.loads(message)))

    def _completed(self, events: list[tuple[float, dict]], since: float) -> str:
        deadline = since + self.timeout_s
        while time.perf_counter() < deadline:
            for _, event in events:
                if event["type"] == "conversation.item.input_audio_transcription.completed":
                    return event["transcript"]
                if event["type"] in ("error", "conversation.item.input_audio_transcription.failed"):
                    raise LiveTurnFailed(json.dumps(event)[:300])
            gevent.sleep(0.02)
        raise LiveTurnFailed(f"no completed transcript {self.timeout_s:g} s after the commit")

    def _fire(self, name: str, seconds: float, exception: Exception | None, clip: Clip, length: int = 0) -> None:
        self.environment.events.request.fire(
            request_type=REQUEST_TYPE, name=name, response_time=seconds * 1000.0, response_length=length,
            exception=exception, context={"clip": clip.name},
        )  # fmt: skip
