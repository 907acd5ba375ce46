"""The soak test's requests (loadtest/soak.py): one method per kind, each judging its own answer.

Every request ends in one `Outcome`: the right transcript, a refusal with the
error its kind calls for (named: INVALID_ARG for bad input, INTERNAL for an
injected fault, UNAVAILABLE "server overloaded" for any kind when the server is
full), cancelled by its client (a gRPC cancel, a closed channel, an HTTP
connection dropped mid-request), or UNEXPECTED: a wrong transcript, another
error, or no answer in time. The soak fails on any UNEXPECTED.
"""

from __future__ import annotations

import enum
import json
import random
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import tritonclient.grpc
import tritonclient.http
from tritonclient.utils import InferenceServerException

from loadtest.clips import Clip
from loadtest.outcomes import is_overloaded, status_name
from python_backend_lib.contract import tensor_names
from python_backend_lib.core import geometry

REQUEST_TIMEOUT_S = 180.0  # no answer by then: lost, UNEXPECTED
# Cancels and disconnects come this long after sending: before, during or after the decoding.
CANCEL_AFTER_S = (0.05, 1.5)
NOT_AUDIO = b"this is not audio at all; " * 8
MISSPELT_PARAMETER = {"temprature": 0.5}
# How often the soak picks each kind (relative). Short clips dominate, as in real traffic.
WEIGHTS = {
    "short": 30, "long": 5, "words": 8, "bad_input": 8, "fault": 4,
    "cancel": 8, "cancel_decoding": 5, "disconnect": 6,
}  # fmt: skip


class Result(enum.Enum):
    TRANSCRIBED = "transcribed"  # the right transcript
    REFUSED = "refused"  # the named error its kind calls for
    CANCELLED = "cancelled"  # by its client
    UNEXPECTED = "unexpected"  # anything else: the soak fails


@dataclass(frozen=True)
class Outcome:
    kind: str
    result: Result
    detail: str  # the error's name, how the client went away, or what was wrong
    seconds: float


@dataclass(frozen=True)
class Inputs:
    """What the soak sends. short: clips of one window; long: one of several windows;
    words: the clip asked with word timestamps; waveform: two minutes of 16 kHz
    audio for the whisper model directly, which a cancel reaches mid-decoding."""

    short: tuple[Clip, ...]
    long: Clip
    words: Clip
    waveform: np.ndarray


@dataclass(frozen=True)
class Expected:
    """What the server gave each input alone, before the load (references): the
    transcripts, and for the waveform, the log-mel preprocessing wrote and the tokens
    whisper decoded from it."""

    texts: dict[str, str]  # clip name -> text; WORDS_KEY for the clip asked with word timestamps
    waveform_log_mel: tuple[np.ndarray, int]  # (LOG_MEL [n_mels, frames], SAMPLES)
    waveform_tokens: tuple[int, ...]

    WORDS_KEY = "words"


class SoakClient:
    """One soak worker's clients (one per protocol) and its requests."""

    def __init__(self, http_url: str, grpc_url: str, fault_prompt: str | None, inputs: Inputs) -> None:
        self.http_url, self.grpc_url = http_url, grpc_url
        self.fault_prompt = fault_prompt
        self.inputs = inputs
        self.http = tritonclient.http.InferenceServerClient(http_url, network_timeout=REQUEST_TIMEOUT_S)
        self.grpc = tritonclient.grpc.InferenceServerClient(grpc_url)

    def close(self) -> None:
        """Close the connections: Triton's stop waits (up to its exit timeout) for open HTTP ones."""
        self.http.close()
        self.grpc.close()

    def kinds(self) -> dict[str, Callable[[Expected, random.Random], Outcome]]:
        """Each kind of request, by name; `fault` only where the server has a fault prompt armed."""
        kinds = {
            "short": self.short, "long": self.long, "words": self.words, "bad_input": self.bad_input,
            "cancel": self.cancel, "cancel_decoding": self.cancel_decoding, "disconnect": self.disconnect,
        }  # fmt: skip
        if self.fault_prompt:
            kinds["fault"] = self.fault
        return kinds

    # ------------------------------------------------------------ plain requests

    def transcribe(self, protocol: str, audio: bytes, **parameters: Any) -> Any:
        """The ensemble's reply; raises InferenceServerException."""
        triton = tritonclient.grpc if protocol == "grpc" else tritonclient.http
        tensor = triton.InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[audio]], dtype=np.object_))
        if protocol == "grpc":
            return self.grpc.infer(
                tensor_names.ENSEMBLE_NAME, [tensor], parameters=parameters, client_timeout=REQUEST_TIMEOUT_S
            )
        return self.http.infer(tensor_names.ENSEMBLE_NAME, [tensor], parameters=parameters)

    def _judged(self, kind: str, call: Callable[[], Any], check: Callable[[Any], str | None],
                refusal: tuple[str, str] | None = None) -> Outcome:  # fmt: skip
        """Run `call`; its reply passes `check` (None, or what is wrong), or its error is
        `refusal` (name, a fragment of the message) or the server being overloaded."""
        started = time.monotonic()
        try:
            reply = call()
        except InferenceServerException as error:
            return judge_error(kind, error, refusal, time.monotonic() - started)
        except Exception as error:  # a timeout, a connection torn down: no answer
            return Outcome(kind, Result.UNEXPECTED, f"{type(error).__name__}: {error}", time.monotonic() - started)
        seconds = time.monotonic() - started
        if refusal is not None:
            return Outcome(kind, Result.UNEXPECTED, f"answered where {refusal[0]} was due", seconds)
        problem = check(reply)
        return Outcome(kind, Result.UNEXPECTED if problem else Result.TRANSCRIBED, problem or "", seconds)

    def _text_check(self, expected: str) -> Callable[[Any], str | None]:
        def check(reply: Any) -> str | None:
            text = text_of(reply)
            return None if text == expected else f"wrong transcript {text[:80]!r}, expected {expected[:80]!r}"

        return check

    def short(self, expected: Expected, rng: random.Random) -> Outcome:
        clip, protocol = rng.choice(self.inputs.short), rng.choice(("grpc", "http"))
        reference = expected.texts[clip.name]
        return self._judged("short", lambda: self.transcribe(protocol, clip.audio), self._text_check(reference))

    def long(self, expected: Expected, rng: random.Random) -> Outcome:
        clip, protocol = self.inputs.long, rng.choice(("grpc", "http"))
        reference = expected.texts[clip.name]
        return self._judged("long", lambda: self.transcribe(protocol, clip.audio), self._text_check(reference))

    def words(self, expected: Expected, rng: random.Random) -> Outcome:
        reference = expected.texts[Expected.WORDS_KEY]
        text_problem = self._text_check(reference)

        def check(reply: Any) -> str | None:
            segments = json.loads(reply.as_numpy(tensor_names.SEGMENTS).reshape(-1)[0])
            if not segments or not all(segment.get("words") for segment in segments):
                return "a segment without words"
            return text_problem(reply)

        protocol = rng.choice(("grpc", "http"))
        return self._judged(
            "words", lambda: self.transcribe(protocol, self.inputs.words.audio, word_timestamps=True), check
        )

    def bad_input(self, expected: Expected, rng: random.Random) -> Outcome:
        clip, protocol = rng.choice(self.inputs.short), rng.choice(("grpc", "http"))
        if rng.random() < 0.5:
            call, refusal = (lambda: self.transcribe(protocol, NOT_AUDIO)), ("INVALID_ARG", "not a decodable audio")
        else:
            call = lambda: self.transcribe(protocol, clip.audio, **MISSPELT_PARAMETER)  # noqa: E731
            refusal = ("INVALID_ARG", "unknown request parameter 'temprature'")
        return self._judged("bad_input", call, lambda reply: None, refusal)

    def fault(self, expected: Expected, rng: random.Random) -> Outcome:
        clip, protocol = rng.choice(self.inputs.short), rng.choice(("grpc", "http"))
        call = lambda: self.transcribe(protocol, clip.audio, prompt=self.fault_prompt)  # noqa: E731
        return self._judged("fault", call, lambda reply: None, ("INTERNAL", "InjectedFault"))

    # ------------------------------------------------------------ clients that give up

    def log_mel(self, waveform: np.ndarray) -> tuple[np.ndarray, int]:
        """The preprocessing model's LOG_MEL and SAMPLES for a 16 kHz waveform (sent as raw PCM)."""
        tensor = tritonclient.grpc.InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[waveform.astype("<f4").tobytes()]], dtype=np.object_))
        reply = self.grpc.infer(tensor_names.PREPROCESSING_NAME, [tensor], client_timeout=REQUEST_TIMEOUT_S,
                                parameters={"input_format": "pcm_f32le", "sample_rate": geometry.SAMPLE_RATE})
        return reply.as_numpy(tensor_names.LOG_MEL)[0], int(reply.as_numpy(tensor_names.SAMPLES)[0, 0])

    def decode(self, log_mel: tuple[np.ndarray, int]) -> Any:
        """The whisper model's reply for a log-mel; raises InferenceServerException."""
        return self.grpc.infer(tensor_names.WHISPER_NAME, whisper_inputs(log_mel), client_timeout=REQUEST_TIMEOUT_S)

    def _cancelled(self, kind: str, model: str, inputs: list, expected_text: str | tuple[int, ...],
                   rng: random.Random, how: str) -> Outcome:  # fmt: skip
        """Send over gRPC, give up after a random delay (`how`: "cancel" the call or
        "close" the channel), then judge whatever the callback got: the ensemble's text,
        or the whisper model's tokens."""
        client = self.grpc if how == "cancel" else tritonclient.grpc.InferenceServerClient(self.grpc_url)
        answered = threading.Event()
        got: list = []

        def callback(result: Any, error: InferenceServerException | None) -> None:
            got.append((result, error))
            answered.set()

        started = time.monotonic()
        call = client.async_infer(model, inputs, callback=callback, client_timeout=REQUEST_TIMEOUT_S)
        time.sleep(rng.uniform(*CANCEL_AFTER_S))
        if how == "cancel":
            call.cancel()
        else:
            client.close()
        if not answered.wait(REQUEST_TIMEOUT_S):
            return Outcome(kind, Result.UNEXPECTED, "no answer, not even to the cancel", time.monotonic() - started)
        seconds = time.monotonic() - started
        result, error = got[0]
        if error is not None and status_name(error) == "CANCELLED":
            return Outcome(kind, Result.CANCELLED, f"grpc {how}", seconds)
        if error is not None:
            return judge_error(kind, error, None, seconds)
        got = text_of(result) if model == tensor_names.ENSEMBLE_NAME else tokens_of(result)
        if got != expected_text:  # answered before the client gave up
            return Outcome(kind, Result.UNEXPECTED, f"wrong answer {str(got)[:80]!r}", seconds)
        return Outcome(kind, Result.TRANSCRIBED, f"answered before the {how}", seconds)

    def cancel(self, expected: Expected, rng: random.Random) -> Outcome:
        """Through the ensemble: Triton 2.51 passes a cancel only to steps not started
        (server#6739), so a transcription under way runs on and its answer is dropped."""
        clip = rng.choice((self.inputs.long, *self.inputs.short))
        tensor = tritonclient.grpc.InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[clip.audio]], dtype=np.object_))
        return self._cancelled("cancel", tensor_names.ENSEMBLE_NAME, [tensor], expected.texts[clip.name], rng, "cancel")

    def cancel_decoding(self, expected: Expected, rng: random.Random) -> Outcome:
        """To the whisper model directly, which drops a cancelled request between decoder steps."""
        inputs = whisper_inputs(expected.waveform_log_mel)
        return self._cancelled("cancel_decoding", tensor_names.WHISPER_NAME, inputs, expected.waveform_tokens, rng,
                               "cancel")

    def disconnect(self, expected: Expected, rng: random.Random) -> Outcome:
        """A client that goes away mid-request: an HTTP connection closed after the
        request was sent, or a gRPC channel closed under its call."""
        clip = rng.choice((self.inputs.long, *self.inputs.short))
        if rng.random() < 0.5:
            tensor = tritonclient.grpc.InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[clip.audio]], dtype=np.object_))
            return self._cancelled("disconnect", tensor_names.ENSEMBLE_NAME, [tensor], expected.texts[clip.name], rng, "close")
        started = time.monotonic()
        try:
            send_and_hang_up(self.http_url, clip.audio, rng.uniform(*CANCEL_AFTER_S))
        except OSError as error:
            return Outcome("disconnect", Result.UNEXPECTED, f"could not send: {error}", time.monotonic() - started)
        return Outcome("disconnect", Result.CANCELLED, "http hang-up", time.monotonic() - started)


def judge_error(kind: str, error: InferenceServerException, refusal: tuple[str, str] | None,
                seconds: float) -> Outcome:  # fmt: skip
    name, message = status_name(error), error.message() or ""
    if is_overloaded(name, message):
        return Outcome(kind, Result.REFUSED, "UNAVAILABLE (overloaded)", seconds)
    if refusal is not None and name == refusal[0] and refusal[1] in message:
        return Outcome(kind, Result.REFUSED, name, seconds)
    return Outcome(kind, Result.UNEXPECTED, f"{name}: {message[:200]}", seconds)


def text_of(reply: Any) -> str:
    return reply.as_numpy(tensor_names.TEXT).reshape(-1)[0].decode("utf-8")


def tokens_of(reply: Any) -> tuple[int, ...]:
    """The tokens of the whisper model's own answer (its TOKENS output)."""
    return tuple(int(t) for t in reply.as_numpy(tensor_names.TOKENS)[0])


def whisper_inputs(log_mel: tuple[np.ndarray, int]) -> list:
    """LOG_MEL and SAMPLES for the whisper model, as preprocessing wrote them."""
    features, samples = log_mel
    mel = tritonclient.grpc.InferInput(tensor_names.LOG_MEL, [1, *features.shape], "FP32")
    mel.set_data_from_numpy(features[None])
    count = tritonclient.grpc.InferInput(tensor_names.SAMPLES, [1, 1], "INT64")
    count.set_data_from_numpy(np.array([[samples]], dtype=np.int64))
    return [mel, count]


def send_and_hang_up(http_url: str, audio: bytes, after_s: float) -> None:
    """POST a whole `transcribe` request over HTTP, then close the connection after
    `after_s` without reading the answer."""
    tensor = tritonclient.http.InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[audio]], dtype=np.object_))
    body, json_size = tritonclient.http.InferenceServerClient.generate_request_body([tensor])
    host, _, port = http_url.rpartition(":")
    head = (
        f"POST /v2/models/{tensor_names.ENSEMBLE_NAME}/infer HTTP/1.1\r\nHost: {http_url}\r\n"
        f"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: {json_size}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=REQUEST_TIMEOUT_S) as connection:
        connection.sendall(head.encode() + body)
        time.sleep(after_s)
