"""A small Python client for the `transcribe` model, over HTTP or gRPC.

    client = WhisperClient("localhost:8000")
    result = client.transcribe("jfk.wav")
    print(result.text, result.segments[0].start)
    document = client.transcribe_document("talk.mp3", word_timestamps=True)  # everything: verbose_json
    srt = client.formatted("talk.mp3", "srt")                                 # as the server writes it

The ensemble's three models may be called in turn, each on its own:

    log_mel = client.preprocess("jfk.wav")          # LOG_MEL [n_mels, frames] and SAMPLES
    decoded = client.decode(log_mel)                # whisper: tokens and their facts, as numbers
    outputs = client.postprocess(decoded)           # TEXT, SEGMENTS, FORMATTED, as transcribe gives them

Options are sent as request parameters (docs/parameters.md lists them) and
checked by the server, which answers a bad one with an error naming it.
A client holds one connection: use one client per thread.

Over gRPC, a file's segments can come as they are decoded (the `transcribe_stream`
model): each update brings the new segments, the last one the whole transcript:

    for update in WhisperClient("grpc://localhost:8001").stream("talk.mp3"):
        for segment in update.new_segments:
            print(segment.start, segment.text)

A request given an id can be stopped on the server from any thread or process
(the server frees its decoding slot within a second; the waiting call then
raises TranscriptionError "cancelled"):

    request_id = new_request_id()
    client.transcribe_document("talk.mp3", request_id=request_id)   # in one thread
    WhisperClient("localhost:8000").cancel(request_id)              # in another

A client with a timeout (`timeout_s`) gives its requests ids of their own, and a request
left unanswered past it is cancelled that way before the call raises TimedOut: Triton
2.51 does not stop a running ensemble step when its client gives up.
"""

from __future__ import annotations

import http.client
import os
import queue
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tritonclient.utils import InferenceServerException

from clients.connection import Protocol, connection_failure, parse_address, triton_message, wrong_endpoint
from clients.streaming import StreamUpdate, TranscriptStream, is_final
from python_backend_lib.contract import tensor_names
from python_backend_lib.contract.parameters import CANCEL_KEY
from python_backend_lib.text.formats import Document, ResponseFormat, TimedText, segments_from_json


class TranscriptionError(RuntimeError):
    """The server refused or failed a request; the message is the server's."""


class ServerUnreachable(TranscriptionError):
    """No answer came from the server: the message names the likely cause and the fix."""


class TimedOut(TranscriptionError):
    """No answer within the client's timeout; the message says whether the server was told to stop."""


@dataclass(frozen=True)
class TranscriptionResult:
    text: str
    segments: tuple[TimedText, ...]


@dataclass(frozen=True)
class TranscriptOutputs:
    """The three outputs of `transcribe` (and of `postprocessing`), as the server writes them."""

    text: str
    segments: str  # JSON (`text.formats.segments_from_json` reads it)
    formatted: str  # in the request's response_format


@dataclass(frozen=True)
class LogMel:
    """`preprocessing`'s answer: a recording's log-mel without its padding, and its length."""

    log_mel: np.ndarray  # float32 [n_mels, frames]
    samples: int


@dataclass(frozen=True)
class Decoded:
    """`whisper`'s answer: what decoding decided, as numeric arrays by output name
    (TOKENS, WINDOWS, ALIGNMENT, LANGUAGE, LANGUAGE_PROBABILITY), for the recording of `samples`."""

    arrays: dict[str, np.ndarray]
    samples: int


DECODED_OUTPUTS = (
    tensor_names.TOKENS, tensor_names.WINDOWS, tensor_names.ALIGNMENT, tensor_names.LANGUAGE,
    tensor_names.LANGUAGE_PROBABILITY,
)
TRANSCRIPT_OUTPUTS = (tensor_names.TEXT, tensor_names.SEGMENTS, tensor_names.FORMATTED)
# HTTP statuses that another server than Triton's HTTP endpoint gives an inference
# request (Triton's own 404, a model it does not know, is told apart by looking).
NOT_TRITONS = ("404", "405")


# What a cancel request carries besides its `cancel` parameter: the whisper model's inputs
# are required, so a placeholder of each (the model reads none of it).
CANCEL_INPUTS = (
    (tensor_names.LOG_MEL, np.zeros((1, 1, 1), dtype=np.float32), "FP32"),
    (tensor_names.SAMPLES, np.zeros((1, 1), dtype=np.int64), "INT64"),
)


def new_request_id() -> str:
    """A request id no other client will pick (request parameter `request_id`)."""
    return str(uuid.uuid4())


def is_timeout(error: BaseException) -> bool:
    """Whether tritonclient raised `error` because the caller's timeout passed: gRPC's
    deadline, or HTTP's socket timeout (which may also mean the server never took the
    connection)."""
    if isinstance(error, InferenceServerException):
        return str(error.status() or "").endswith("DEADLINE_EXCEEDED")
    return isinstance(error, TimeoutError)


class WhisperClient:
    """Send audio to a whisper-triton server and get the transcript back."""

    def __init__(
        self,
        url: str | None = None,
        protocol: Protocol | str | None = None,
        *,
        model: str = tensor_names.ENSEMBLE_NAME,
        timeout_s: float | None = None,
    ) -> None:
        """url: host:port, or a URL whose scheme names the protocol (http://, https://,
        grpc://); default localhost:8000, or :8001 for gRPC. protocol: "http" or "grpc";
        None takes it from the URL (HTTP without a scheme). Raises connection.AddressError
        for a URL of the other protocol."""
        self.address = parse_address(url, protocol)
        self.protocol = self.address.protocol
        self.url = self.address.location
        self.model = model
        self.timeout_s = timeout_s
        self._infer_arguments: dict[str, float] = {}
        if self.protocol is Protocol.HTTP:
            import tritonclient.http as triton

            timeouts = {} if timeout_s is None else {"network_timeout": timeout_s, "connection_timeout": timeout_s}
            self._client = triton.InferenceServerClient(self.url, ssl=self.address.tls, **timeouts)
        else:
            import tritonclient.grpc as triton

            self._client = triton.InferenceServerClient(self.url)
            if timeout_s is not None:
                self._infer_arguments["client_timeout"] = timeout_s
        self._triton = triton

    def is_ready(self) -> bool:
        """Whether the server answers and every model is loaded."""
        try:
            return bool(self._client.is_server_ready())
        except Exception:  # connection refused, DNS, ... all mean "not ready"
            return False

    def transcribe(self, audio: bytes | str | os.PathLike[str], **options: object) -> TranscriptionResult:
        """Transcribe one audio file (a path or its bytes; raw PCM with input_format="pcm_f32le").

        options: request parameters such as language="en", timestamps=False.
        """
        text, segments = self._infer(audio, (tensor_names.TEXT, tensor_names.SEGMENTS), options)
        return TranscriptionResult(text=text, segments=segments_from_json(segments))

    def formatted(
        self, audio: bytes | str | os.PathLike[str], response_format: ResponseFormat | str, **options: object
    ) -> str:
        """The transcript as the server writes it in `response_format` (text, json,
        verbose_json, srt, vtt, tsv): the FORMATTED output."""
        options["response_format"] = ResponseFormat(response_format).value
        (formatted,) = self._infer(audio, (tensor_names.FORMATTED,), options)
        return formatted

    def transcribe_document(self, audio: bytes | str | os.PathLike[str], **options: object) -> Document:
        """Everything the server knows of the transcript: segments with their window
        statistics, words (with word_timestamps=True), duration, language."""
        return Document.from_verbose_json(self.formatted(audio, ResponseFormat.VERBOSE_JSON, **options))

    def outputs(self, audio: bytes | str | os.PathLike[str], **options: object) -> TranscriptOutputs:
        """All three outputs of the `transcribe` model for one audio file."""
        return TranscriptOutputs(*self._infer(audio, TRANSCRIPT_OUTPUTS, options))

    def preprocess(self, audio: bytes | str | os.PathLike[str], **options: object) -> LogMel:
        """The `preprocessing` model alone: the file's log-mel and length."""
        response = self._call(tensor_names.PREPROCESSING_NAME, [self._audio(audio)],
                              (tensor_names.LOG_MEL, tensor_names.SAMPLES), options)
        return LogMel(response.as_numpy(tensor_names.LOG_MEL)[0], int(response.as_numpy(tensor_names.SAMPLES)[0, 0]))

    def decode(self, log_mel: LogMel, **options: object) -> Decoded:
        """The `whisper` model alone, on a log-mel from `preprocess` or computed by the caller
        (`audio.features.features_for` of the library; frames past those given repeat the last)."""
        inputs = [
            self._array(tensor_names.LOG_MEL, np.asarray(log_mel.log_mel, dtype=np.float32)[None], "FP32"),
            self._array(tensor_names.SAMPLES, np.array([[log_mel.samples]], dtype=np.int64), "INT64"),
        ]
        response = self._call(tensor_names.WHISPER_NAME, inputs, DECODED_OUTPUTS, options)
        return Decoded({name: response.as_numpy(name)[0] for name in DECODED_OUTPUTS}, log_mel.samples)

    def postprocess(self, decoded: Decoded, **options: object) -> TranscriptOutputs:
        """The `postprocessing` model alone: the transcript of `decode`'s answer."""
        types = {np.dtype(np.int32): "INT32", np.dtype(np.float64): "FP64"}
        inputs = [self._array(name, array[None], types[array.dtype]) for name, array in decoded.arrays.items()]
        inputs.append(self._array(tensor_names.SAMPLES, np.array([[decoded.samples]], dtype=np.int64), "INT64"))
        response = self._call(tensor_names.POSTPROCESSING_NAME, inputs, TRANSCRIPT_OUTPUTS, options)
        return TranscriptOutputs(*(_text(response, name) for name in TRANSCRIPT_OUTPUTS))

    def stream(self, audio: bytes | str | os.PathLike[str], **options: object) -> Iterator[StreamUpdate]:
        """Transcribe one audio file on the streamed path (gRPC only): an update each time
        more of it is decoded, with the segments it added, and last a final one whose
        outputs are the whole transcript, as `outputs` would answer it. options: request
        parameters, as for `transcribe`. Raises TranscriptionError when the server refuses
        or fails the request (the stream ends there). Closed early (a `break`), the
        request is cancelled on the server."""
        if self.protocol is not Protocol.GRPC:
            raise TranscriptionError(
                f"streamed results come over gRPC only; {self.address} is HTTP: use grpc://HOST:8001"
            )
        options = {"request_id": new_request_id(), **options}
        responses: queue.Queue = queue.Queue()
        self._client.start_stream(
            callback=lambda result, error: responses.put((result, error)),
            stream_timeout=self._infer_arguments.get("client_timeout"),
        )
        finished = False
        try:
            self._client.async_stream_infer(
                tensor_names.STREAM_ENSEMBLE_NAME,
                [self._audio(audio)],
                outputs=[self._triton.InferRequestedOutput(name) for name in TRANSCRIPT_OUTPUTS],
                parameters=options,
                enable_empty_final_response=True,
            )
            transcript = TranscriptStream()
            while not finished:
                result, error = responses.get()
                if error is not None:  # Triton's last word on the request
                    finished = True
                    if is_timeout(error):
                        raise self._timed_out(str(options["request_id"]))
                    raise self._failure(error)
                response = result.get_response()
                outputs = TranscriptOutputs(*(_text(result, n) for n in TRANSCRIPT_OUTPUTS)) if response.outputs else None
                finished = is_final(response.parameters)
                update = transcript.update(outputs, finished)
                if update is not None:
                    yield update
        finally:
            if not finished:  # closed early: stop the decoding, then wait for its last answer
                self.cancel(str(options["request_id"]))
            self._client.stop_stream()

    def cancel(self, request_id: str) -> None:
        """Stop the request sent with `request_id` wherever it is on the server; an id
        that names no request (one already answered) is no error.

        Triton 2.51 passes no cancel into a running step of the `transcribe` ensemble
        (server#6739): the `whisper` model takes the cancel, as a request of its own."""
        inputs = [self._array(name, array, datatype) for name, array, datatype in CANCEL_INPUTS]
        self._call(tensor_names.WHISPER_NAME, inputs, (), {CANCEL_KEY: request_id})

    def _infer(
        self, audio: bytes | str | os.PathLike[str], outputs: tuple[str, ...], options: dict[str, object]
    ) -> list[str]:
        """The requested BYTES outputs of one request to this client's model, as text."""
        response = self._call(self.model, [self._audio(audio)], outputs, options)
        return [_text(response, name) for name in outputs]

    def _audio(self, audio: bytes | str | os.PathLike[str]):
        data = audio if isinstance(audio, bytes) else Path(audio).read_bytes()
        return self._array(tensor_names.AUDIO, np.array([[data]], dtype=np.object_), "BYTES")

    def _array(self, name: str, array: np.ndarray, datatype: str):
        tensor = self._triton.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        return tensor

    def _call(self, model: str, inputs: list, outputs: tuple[str, ...], options: dict[str, object]):
        """One request to `model`; TranscriptionError (ServerUnreachable without an answer,
        TimedOut without one in time) when it fails. With a timeout, a request that
        decodes carries an id, by which it is cancelled once the timeout passes."""
        decodes = model in (self.model, tensor_names.WHISPER_NAME) and CANCEL_KEY not in options
        if self.timeout_s is not None and decodes and "request_id" not in options:
            options = {**options, "request_id": new_request_id()}
        try:
            return self._client.infer(
                model,
                inputs,
                outputs=[self._triton.InferRequestedOutput(name) for name in outputs],
                parameters=dict(options) or None,
                **self._infer_arguments,
            )
        except (InferenceServerException, OSError, http.client.HTTPException) as error:
            if is_timeout(error):
                raise self._timed_out(str(options["request_id"]) if "request_id" in options else None) from None
            raise self._failure(error) from None

    def _timed_out(self, request_id: str | None) -> TimedOut:
        """The error of a request left unanswered past the timeout, cancelled on the server
        first when it has an id (a cancel that fails is said, not raised)."""
        message = f"no answer from the server at {self.address} within this client's timeout of {self.timeout_s:g} s"
        if request_id is None:
            return TimedOut(message)
        try:
            self.cancel(request_id)
        except TranscriptionError as error:
            return TimedOut(f"{message}; cancelling it on the server failed too: {error}")
        return TimedOut(f"{message}; cancelled on the server (request_id {request_id})")

    def _failure(self, error: Exception) -> TranscriptionError:
        """A failed request's error as this client raises it."""
        # HTTP raises OSError (refused) and HTTPException (not HTTP) before any answer.
        unreachable = connection_failure(self.address, error)
        if unreachable is not None:
            return ServerUnreachable(unreachable)
        if not isinstance(error, InferenceServerException):
            return TranscriptionError(f"the connection to {self.address} failed: {error}")
        message = error.message() or str(error)
        if self.protocol is Protocol.HTTP and (error.status() in NOT_TRITONS or not isinstance(message, str)):
            wrong = wrong_endpoint(self.address)  # the gateway's port, or the metrics port
            if wrong is not None:
                return ServerUnreachable(wrong)
        return TranscriptionError(triton_message(str(message)))

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> WhisperClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _text(response, name: str) -> str:
    return response.as_numpy(name).reshape(-1)[0].decode("utf-8")
