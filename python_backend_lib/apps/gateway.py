"""An OpenAI-compatible HTTP gateway in front of the `transcribe` model.

    whisper-triton gateway --triton-url localhost:8001 --port 9000

    from openai import OpenAI
    client = OpenAI(base_url="http://localhost:9000/v1", api_key="unused")
    srt = client.audio.transcriptions.create(model="whisper-1", file=open("talk.mp3", "rb"), response_format="srt")

Endpoints, as OpenAI's audio API has them:
- POST /v1/audio/transcriptions and /v1/audio/translations: multipart form with
  `file`, `model`, `language` (transcriptions only), `prompt`,
  `response_format` (json, text, srt, verbose_json, vtt), `temperature` and
  `timestamp_granularities[]` (word and/or segment; verbose_json only);
- GET /v1/models and /v1/models/{id}: the model ids this gateway answers to;
- GET /health: 200 when Triton and its models are ready, else 503.

Each request becomes one gRPC call to Triton's `transcribe` ensemble (the
async tritonclient, so one process serves many requests at once), asking
for its FORMATTED output in the requested format. Errors have OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`: 400 for a bad request
(Triton's INVALID_ARG included: audio it cannot decode, a language the
checkpoint does not know, translation on an English-only checkpoint), 404 for
an unknown model or path, 413 for a file over the size limit, 415 for a body
that is not multipart/form-data, 503 when Triton is unreachable or overloaded,
500 for anything else.
"""

import argparse
import json
import math
import signal
from collections.abc import Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from python_backend_lib.core.options import Task
from python_backend_lib.serving import tensor_names
from python_backend_lib.text.formats import ResponseFormat

DEFAULT_MODEL_ID = "whisper-1"  # what OpenAI's examples ask for
DEFAULT_PORT = 9000
DEFAULT_TRITON_URL = "localhost:8001"
DEFAULT_MAX_FILE_MB = 25  # OpenAI's own limit
BYTES_PER_MB = 1024 * 1024
MAX_TEMPERATURE = 1.0  # OpenAI's range is 0 to 1
OWNER = "whisper-triton"
# verbose_json lists segments unless the request asks for words alone.
WORD, SEGMENT = "word", "segment"
GRANULARITIES = (WORD, SEGMENT)
MEDIA_TYPES = {
    ResponseFormat.TEXT: "text/plain; charset=utf-8",
    ResponseFormat.SRT: "text/plain; charset=utf-8",
    ResponseFormat.VTT: "text/plain; charset=utf-8",
    ResponseFormat.JSON: "application/json",
    ResponseFormat.VERBOSE_JSON: "application/json",
}


@dataclass(frozen=True)
class GatewaySettings:
    """triton_url: Triton's gRPC address. model_ids: the `model` values accepted
    (all served by the one checkpoint Triton runs). max_file_bytes: larger
    uploads get 413. timeout_s: per request to Triton, None for none."""

    triton_url: str = DEFAULT_TRITON_URL
    model_ids: tuple[str, ...] = (DEFAULT_MODEL_ID,)
    max_file_bytes: int = DEFAULT_MAX_FILE_MB * BYTES_PER_MB
    timeout_s: float | None = None
    triton_model: str = tensor_names.ENSEMBLE_NAME

    def __post_init__(self) -> None:
        if not self.model_ids:
            raise ValueError("the gateway needs at least one model id")
        if self.max_file_bytes < 1:
            raise ValueError(f"max_file_bytes must be positive, got {self.max_file_bytes}")


class ApiError(Exception):
    """A request that fails, with what OpenAI's error body says about it."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ------------------------------------------------------------- the request


@dataclass(frozen=True)
class AudioRequest:
    """One transcription or translation, checked (the audio travels beside it)."""

    model: str
    task: Task
    response_format: ResponseFormat = ResponseFormat.JSON
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    granularities: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "task", Task(self.task))
        object.__setattr__(self, "response_format", ResponseFormat(self.response_format))

    @property
    def word_timestamps(self) -> bool:
        return WORD in self.granularities

    def triton_parameters(self) -> dict[str, Any]:
        """The `transcribe` request parameters. Segment timestamps are always on:
        they are what long audio is seeked by, and every format but text shows them."""
        parameters: dict[str, Any] = {
            "task": self.task.value,
            "response_format": self.response_format.value,
            "timestamps": True,
            "temperature": self.temperature,
            "word_timestamps": self.word_timestamps,
        }
        if self.language is not None:
            parameters["language"] = self.language
        if self.prompt is not None:
            parameters["prompt"] = self.prompt
        return parameters

    def shape(self, formatted: str) -> str:
        """The response body from the FORMATTED output: verbose_json lists only
        the granularities asked for (segments by default)."""
        if self.response_format is not ResponseFormat.VERBOSE_JSON or not self.granularities:
            return formatted
        record = json.loads(formatted)
        if SEGMENT not in self.granularities:
            record.pop("segments", None)
        return json.dumps(record, ensure_ascii=False)


def parse_form(form: Mapping[str, Any], task: Task, settings: GatewaySettings) -> AudioRequest:
    """The multipart fields of one request. form: field -> list of values
    (str, or an object with `read` for files). Raises ApiError."""

    def text(name: str, required: bool = False) -> str | None:
        values = form.get(name) or [None]
        value = values[-1]
        if value is not None and not isinstance(value, str):
            raise ApiError(400, f"'{name}' must be a text field, not a file", param=name, code="invalid_type")
        if not value:
            if required:
                raise ApiError(400, f"you must provide a '{name}' parameter", param=name, code="missing_required_parameter")
            return None
        return value

    model = text("model", required=True)
    if model not in settings.model_ids:
        raise ApiError(
            404, f"the model {model!r} does not exist; this server has {list(settings.model_ids)}",
            param="model", code="model_not_found",
        )
    response_format = text("response_format") or ResponseFormat.JSON.value
    try:
        response_format = ResponseFormat(response_format)
    except ValueError:
        raise ApiError(
            400, f"response_format must be one of {[f.value for f in ResponseFormat]}, got {response_format!r}",
            param="response_format", code="invalid_value",
        ) from None
    temperature = _temperature(text("temperature"))
    granularities = tuple(dict.fromkeys(_granularities(form.get("timestamp_granularities[]", []))))
    if granularities and response_format is not ResponseFormat.VERBOSE_JSON:
        raise ApiError(
            400, "timestamp_granularities[] needs response_format 'verbose_json'",
            param="timestamp_granularities[]", code="invalid_value",
        )
    language = text("language") if task is Task.TRANSCRIBE else None
    return AudioRequest(
        model=model,
        task=task,
        response_format=response_format,
        language=language,
        prompt=text("prompt"),
        temperature=temperature,
        granularities=granularities,
    )


def _temperature(value: str | None) -> float:
    if value is None:
        return 0.0
    try:
        temperature = float(value)
    except ValueError:
        temperature = math.nan
    if not 0.0 <= temperature <= MAX_TEMPERATURE:  # False for NaN too
        raise ApiError(
            400, f"temperature must be a number from 0 to {MAX_TEMPERATURE:g}, got {value!r}",
            param="temperature", code="invalid_value",
        )
    return temperature


def _granularities(values: Sequence[Any]) -> list[str]:
    for value in values:
        if value not in GRANULARITIES:
            raise ApiError(
                400, f"timestamp_granularities[] may hold {list(GRANULARITIES)}, got {value!r}",
                param="timestamp_granularities[]", code="invalid_value",
            )
    return list(values)


# Triton's gRPC status -> (HTTP status, OpenAI error code, what to say before Triton's message).
TRITON_STATUS = {
    "INVALID_ARGUMENT": (400, None, ""),
    "UNAVAILABLE": (503, "service_unavailable", "the transcription server is unavailable: "),
    "RESOURCE_EXHAUSTED": (503, "service_unavailable", "the transcription server is unavailable: "),
    "DEADLINE_EXCEEDED": (504, "timeout", "the transcription took too long: "),
}
OTHER_TRITON_STATUS = (500, "server_error", "the transcription failed: ")


def error_from_triton(error: "InferenceServerException") -> ApiError:  # noqa: F821
    """Triton's error as the client should see it: its message, OpenAI's status.
    error.status() is gRPC's status name, such as "StatusCode.INVALID_ARGUMENT"."""
    name = str(error.status() or "").rsplit(".", 1)[-1]
    status, code, preface = TRITON_STATUS.get(name, OTHER_TRITON_STATUS)
    return ApiError(status, preface + (error.message() or str(error)), code=code)


# ---------------------------------------------------------------- the app


def create_app(settings: GatewaySettings = GatewaySettings()) -> "fastapi.FastAPI":  # noqa: F821
    """The ASGI application (FastAPI); Triton is connected when it starts.

    FastAPI is imported here, not at the top, so that the `whisper-triton`
    command starts quickly; this module has no `from __future__ import
    annotations`, as FastAPI reads the handlers' annotations as objects.
    """
    import tritonclient.grpc.aio as triton
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from starlette.exceptions import HTTPException
    from tritonclient.utils import InferenceServerException

    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["client"] = triton.InferenceServerClient(settings.triton_url)
        try:
            yield
        finally:
            await state["client"].close()

    app = FastAPI(title="whisper-triton", description=__doc__.split("\n\n")[0], lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)  # unknown paths, bad multipart bodies: OpenAI's shape too
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {error.detail}"
        return await api_error(request, ApiError(error.status_code, message))

    def model_record(model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": 0, "owned_by": OWNER}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_record(m) for m in settings.model_ids]}

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id not in settings.model_ids:
            raise ApiError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return model_record(model_id)

    @app.get("/health")
    async def health() -> Response:
        try:
            ready = await state["client"].is_model_ready(settings.triton_model)
        except InferenceServerException:
            ready = False
        return Response("ready\n" if ready else "not ready\n", status_code=200 if ready else 503)

    async def handle(request: Request, task: Task) -> Response:
        content_type = request.headers.get("content-type", "")
        if not content_type.startswith("multipart/form-data"):
            raise ApiError(415, f"the body must be multipart/form-data, got {content_type or 'none'!r}",
                           code="unsupported_media_type")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_file_bytes + BYTES_PER_MB:
            raise _too_large(settings)
        async with request.form() as form:
            fields = {key: form.getlist(key) for key in form.keys()}
            audio_request = parse_form(fields, task, settings)
            audio = await _read_file(fields.get("file", []), settings)
        return await transcribe(audio_request, audio)

    async def transcribe(audio_request: AudioRequest, audio: bytes) -> Response:
        tensor = triton.InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[audio]], dtype=np.object_))
        try:
            result = await state["client"].infer(
                settings.triton_model,
                [tensor],
                outputs=[triton.InferRequestedOutput(tensor_names.FORMATTED)],
                parameters=audio_request.triton_parameters(),
                client_timeout=settings.timeout_s,
            )
        except InferenceServerException as error:
            raise error_from_triton(error) from None
        formatted = result.as_numpy(tensor_names.FORMATTED).reshape(-1)[0].decode("utf-8")
        body = audio_request.shape(formatted)
        return Response(body, media_type=MEDIA_TYPES[audio_request.response_format])

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request) -> Response:
        return await handle(request, Task.TRANSCRIBE)

    @app.post("/v1/audio/translations")
    async def translations(request: Request) -> Response:
        return await handle(request, Task.TRANSLATE)

    return app


async def _read_file(values: Sequence[Any], settings: GatewaySettings) -> bytes:
    if not values or isinstance(values[-1], str):
        raise ApiError(400, "you must provide a 'file' parameter: the audio, as a file upload",
                       param="file", code="missing_required_parameter")
    data = await values[-1].read(settings.max_file_bytes + 1)
    if len(data) > settings.max_file_bytes:
        raise _too_large(settings)
    if not data:
        raise ApiError(400, "the audio file is empty", param="file", code="invalid_value")
    return data


def _too_large(settings: GatewaySettings) -> ApiError:
    return ApiError(413, f"the audio file is larger than {settings.max_file_bytes / BYTES_PER_MB:g} MB",
                    param="file", code="file_too_large")


# ----------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--triton-url", default=DEFAULT_TRITON_URL, help="Triton's gRPC address (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on (default: %(default)s)")
    parser.add_argument(
        "--model-id", action="append", dest="model_ids", metavar="ID",
        help=f"a `model` value to accept, repeatable (default: {DEFAULT_MODEL_ID}); "
        "name the checkpoint here, e.g. --model-id whisper-1 --model-id tiny.en",
    )
    parser.add_argument("--max-file-mb", type=float, default=DEFAULT_MAX_FILE_MB, help="upload limit (default: %(default)s)")
    parser.add_argument("--timeout", type=float, metavar="SECONDS", help="per request to Triton (default: none)")


class _Stopped(Exception):
    """SIGTERM, raised again by uvicorn once it has shut down gracefully."""


def _raise_stopped(signum: int, frame: object) -> None:
    raise _Stopped()


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM; 0 after a graceful stop."""
    import uvicorn

    settings = GatewaySettings(
        triton_url=args.triton_url,
        model_ids=tuple(args.model_ids or (DEFAULT_MODEL_ID,)),
        max_file_bytes=int(args.max_file_mb * BYTES_PER_MB),
        timeout_s=args.timeout,
    )
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host=args.host, port=args.port, log_level="info"))
    # uvicorn finishes the requests in flight on SIGINT or SIGTERM, restores the
    # handlers it found and raises the signal again: these turn it into a clean exit.
    signal.signal(signal.SIGTERM, _raise_stopped)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        server.run()
    except (KeyboardInterrupt, _Stopped):
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="whisper-triton gateway", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
