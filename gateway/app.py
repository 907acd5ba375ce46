"""An OpenAI-compatible HTTP gateway in front of the `transcribe` model.

    whisper-triton gateway --triton-url localhost:8001 --port 9000

    from openai import OpenAI
    client = OpenAI(base_url="http://localhost:9000/v1", api_key="unused")
    srt = client.audio.transcriptions.create(model="whisper-1", file=open("talk.mp3", "rb"), response_format="srt")

Endpoints, as OpenAI's audio API has them:
- POST /v1/audio/transcriptions and /v1/audio/translations: multipart form with
  `file`, `model`, `language` (transcriptions only), `prompt`,
  `response_format` (json, text, srt, verbose_json, vtt), `temperature` and
  `timestamp_granularities[]` (word and/or segment; verbose_json only), and
  `stream` (transcriptions: true answers with OpenAI's server-sent events,
  from Triton's streamed path: `transcript_events`);
- GET /v1/models and /v1/models/{id}: the model ids this gateway answers to;
- WebSocket /v1/realtime?intent=transcription: OpenAI's Realtime transcription
  session, live audio in and text out as it is spoken (`realtime`), at most
  `--max-live-sessions` at once;
- GET /: a page to try it, in a browser (`page/`);
- GET /health: 200 when Triton and its models are ready, else 503;
- GET /docs: the API's interactive page (Swagger UI, served from the
  swagger-ui-bundle-v2 package: it works without the internet).

With an API key (`--api-key`, or the WHISPER_TRITON_API_KEY environment
variable), every /v1 request must carry `Authorization: Bearer <key>`, else
it gets a 401; /health and /docs stay open.

With `--workers N`, N gateway processes share the port and the live session
limit (`workers`): one process runs about a hundred live sessions on a core.

Each request becomes one gRPC call to Triton's `transcribe` ensemble (the
async tritonclient, so one process serves many requests at once), asking
for its FORMATTED output in the requested format. The form and the errors
are `openai_api`'s and `openai_errors`'s. Errors have OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`: 400 for a bad request
(Triton's INVALID_ARG included: audio it cannot decode, a language the
checkpoint does not know, translation on an English-only checkpoint), 404 for
an unknown model or path, 413 for a file over the size limit, 415 for a body
that is not multipart/form-data, 503 when Triton is unreachable or overloaded,
500 for anything else: the server's fault, said as such, with the traceback in
the gateway's log only.
"""

import logging
import secrets
from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clients.connection import Protocol, ServerAddress, parse_address
from gateway import live_turn, realtime, session_slots
from gateway.api_key import PROTECTED_PREFIX
from gateway.finals_first import FinalsFirst
from gateway.openai_api import DEFAULT_MODEL_ID, MEDIA_TYPES, AudioRequest, parse_form, request_body
from gateway.openai_errors import ApiError, InvalidRequest, api_error, http_error, unauthorized
from gateway.speech_detector import speech_detectors
from gateway.transcript_events import MEDIA_TYPE as EVENTS_MEDIA_TYPE
from gateway.transcript_events import stream_events
from python_backend_lib.contract import tensor_names
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.options import Task

if TYPE_CHECKING:
    import fastapi

DEFAULT_TRITON_URL = "localhost:8001"
DEFAULT_MAX_FILE_MB = 25  # OpenAI's own limit
BYTES_PER_MB = 1024 * 1024
OWNER = "whisper-triton"
DOCS_ASSETS = "/docs-assets"  # Swagger UI's script and style, from the installed package
PAGE_FOLDER = Path(__file__).parent / "page"  # the page at /, its script and style
PAGE_ASSETS = "/page"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewaySettings:
    """triton_url: Triton's gRPC address, host:port or grpc://host:port (an HTTP
    URL raises connection.AddressError). model_ids: the `model` values accepted
    (all served by the one checkpoint Triton runs). max_file_bytes: larger
    uploads get 413. timeout_s: per request to Triton, None for none.
    api_key: what /v1 requests must bring as `Authorization: Bearer <key>`."""

    triton_url: str = DEFAULT_TRITON_URL
    model_ids: tuple[str, ...] = (DEFAULT_MODEL_ID,)
    max_file_bytes: int = DEFAULT_MAX_FILE_MB * BYTES_PER_MB
    timeout_s: float | None = None
    triton_model: str = tensor_names.ENSEMBLE_NAME
    api_key: str | None = field(default=None, repr=False)  # None: no key asked for
    max_live_sessions: int = realtime.DEFAULT_MAX_SESSIONS
    live_hypothesis_every_s: float = live_turn.HYPOTHESIS_STEP_S
    triton: ServerAddress = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "triton", parse_address(self.triton_url, Protocol.GRPC))
        if not self.model_ids:
            raise ValueError("the gateway needs at least one model id")
        if self.max_file_bytes < 1:
            raise ValueError(f"max_file_bytes must be positive, got {self.max_file_bytes}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty")
        if self.max_live_sessions < 1:
            raise ValueError(f"the live session limit must be at least 1, got {self.max_live_sessions}")
        live_turn.check_hypothesis_every(self.live_hypothesis_every_s)


# ---------------------------------------------------------------- the app


def create_app(settings: GatewaySettings = GatewaySettings(),
               live_slots: session_slots.SessionSlots | None = None) -> "fastapi.FastAPI":
    """The ASGI application (FastAPI); Triton is connected when it starts.
    live_slots: the live session count this process keeps, against the limit that
    several gateway processes share (`workers`); default: this process alone.

    FastAPI is imported here, not at the top, so that the `whisper-triton`
    command starts quickly; this module has no `from __future__ import
    annotations`, as FastAPI reads the handlers' annotations as objects.
    """
    from fastapi import FastAPI, Request, WebSocket
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response, StreamingResponse
    from fastapi.staticfiles import StaticFiles
    from starlette.exceptions import HTTPException
    from swagger_ui_bundle import swagger_ui_path
    from tritonclient.utils import InferenceServerException

    from gateway.triton_calls import TritonCalls

    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["calls"] = TritonCalls(settings.triton, settings.triton_model, settings.timeout_s)
        try:
            yield
        finally:
            await state["calls"].close()

    app = FastAPI(title="whisper-triton", description=__doc__.split("\n\n")[0], lifespan=lifespan,
                  docs_url=None, redoc_url=None)  # FastAPI's own pages load their scripts from a CDN
    app.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_path), name="docs-assets")
    app.mount(PAGE_ASSETS, StaticFiles(directory=PAGE_FOLDER), name="page")

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(PAGE_FOLDER / "index.html")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url, title="whisper-triton: OpenAI's audio API",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js", swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png",
        )

    if settings.api_key is not None:
        expected = f"Bearer {settings.api_key}".encode()

        @app.middleware("http")
        async def require_api_key(request: Request, call_next: Any) -> Response:
            if request.url.path.startswith(PROTECTED_PREFIX):
                given = request.headers.get("authorization")
                if given is None or not secrets.compare_digest(given.encode(), expected):
                    failure = unauthorized(given)
                    return JSONResponse(failure.body(), status_code=failure.status,
                                        headers={"WWW-Authenticate": "Bearer"})
            return await call_next(request)

    async def reply(request: Request, error: Exception) -> JSONResponse:
        """Every failure in OpenAI's shape, its status from whose fault it was."""
        failure = api_error(error)
        return JSONResponse(failure.body(), status_code=failure.status)

    app.add_exception_handler(ApiError, reply)
    app.add_exception_handler(RequestError, reply)
    # Registered for Exception, Starlette answers with it and then raises the error
    # again, so the traceback reaches the gateway's log and never the client.
    app.add_exception_handler(Exception, reply)

    @app.exception_handler(HTTPException)  # unknown paths, bad multipart bodies: OpenAI's shape too
    async def http_exception(request: Request, error: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {error.detail}"
        return await reply(request, http_error(error.status_code, message))

    def model_record(model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": 0, "owned_by": OWNER}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_record(m) for m in settings.model_ids]}

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str) -> dict[str, Any]:
        if model_id not in settings.model_ids:
            raise InvalidRequest(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return model_record(model_id)

    @app.get("/health")
    async def health() -> Response:
        try:
            ready = await state["calls"].client.is_model_ready(settings.triton_model)
        except InferenceServerException:
            ready = False
        return Response("ready\n" if ready else "not ready\n", status_code=200 if ready else 503)

    async def handle(request: Request, task: Task) -> Response:
        content_type = request.headers.get("content-type", "")
        if not content_type.startswith("multipart/form-data"):
            raise InvalidRequest(415, f"the body must be multipart/form-data, got {content_type or 'none'!r}",
                                 code="unsupported_media_type")
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_file_bytes + BYTES_PER_MB:
            raise _too_large(settings)
        async with request.form() as form:
            fields = {key: form.getlist(key) for key in form.keys()}
            audio_request = parse_form(fields, task, settings.model_ids)
            audio = await _read_file(fields.get("file", []), settings)
        return await transcribe(request, audio_request, audio)

    async def transcribe(http_request: Request, audio_request: AudioRequest, audio: bytes) -> Response:
        calls: TritonCalls = state["calls"]
        if not audio_request.stream:
            formatted = await calls.transcribe(http_request, audio, audio_request.triton_parameters())
            return Response(audio_request.shape(formatted), media_type=MEDIA_TYPES[audio_request.response_format])
        first, replies, request_id = await calls.stream(http_request, audio, audio_request.triton_parameters())
        if first.error is not None:  # before any event: an ordinary error reply
            raise first.error
        events = stream_events(first, replies, on_abandoned=lambda: calls.abandon(request_id, replies))
        return StreamingResponse(events, media_type=EVENTS_MEDIA_TYPE)

    live_options = realtime.RealtimeOptions(model_ids=settings.model_ids, detector=speech_detectors(),
                                            max_sessions=settings.max_live_sessions, api_key=settings.api_key,
                                            hypothesis_every_s=settings.live_hypothesis_every_s)
    if live_slots is None:
        live_slots = session_slots.SessionSlots(settings.max_live_sessions)
    finals_first = FinalsFirst()

    @app.websocket("/v1/realtime")
    async def live(websocket: WebSocket) -> None:
        await realtime.serve(websocket, state["calls"], live_options, live_slots, finals_first)

    @app.post("/v1/audio/transcriptions", openapi_extra=request_body(Task.TRANSCRIBE))
    async def transcriptions(request: Request) -> Response:
        return await handle(request, Task.TRANSCRIBE)

    @app.post("/v1/audio/translations", openapi_extra=request_body(Task.TRANSLATE))
    async def translations(request: Request) -> Response:
        return await handle(request, Task.TRANSLATE)

    if settings.api_key is not None:  # so that the /docs page can send the key (its Authorize button)
        describe = app.openapi

        def openapi_with_key() -> dict[str, Any]:
            schema = describe()
            schema.setdefault("components", {})["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
            for path, operations in schema["paths"].items():
                if path.startswith(PROTECTED_PREFIX):
                    for operation in operations.values():
                        operation["security"] = [{"apiKey": []}]
            return schema

        app.openapi = openapi_with_key

    return app


async def _read_file(values: Sequence[Any], settings: GatewaySettings) -> bytes:
    if not values or isinstance(values[-1], str):
        raise InvalidRequest(400, "you must provide a 'file' parameter: the audio, as a file upload",
                             param="file", code="missing_required_parameter")
    data = await values[-1].read(settings.max_file_bytes + 1)
    if len(data) > settings.max_file_bytes:
        raise _too_large(settings)
    if not data:
        raise InvalidRequest(400, "the audio file is empty", param="file", code="invalid_value")
    return data


def _too_large(settings: GatewaySettings) -> InvalidRequest:
    return InvalidRequest(413, f"the audio file is larger than {settings.max_file_bytes / BYTES_PER_MB:g} MB",
                          param="file", code="file_too_large")
