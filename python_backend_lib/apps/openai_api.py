"""OpenAI's audio API as the gateway speaks it: a request's form fields, checked,
and every failure as OpenAI's error body with the HTTP status its fault calls for.

Pure: no FastAPI and no Triton client here, so it is tested without a server.
Whose fault decides the status, as in the Triton adapters: a `RequestError`
(`InvalidRequest` here, or one from the library) is the client's mistake, a 4xx;
Triton's own refusals keep their meaning (INVALID_ARGUMENT is 400, overload 503);
anything else is the server's fault, a 500 that says so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from clients.connection import ServerAddress, connection_failure, triton_message
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.options import Task
from python_backend_lib.text.formats import ResponseFormat

if TYPE_CHECKING:
    from tritonclient.utils import InferenceServerException

DEFAULT_MODEL_ID = "whisper-1"  # what OpenAI's examples ask for
MAX_TEMPERATURE = 1.0  # OpenAI's range is 0 to 1
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
OPENAI_FORMATS = tuple(f.value for f in MEDIA_TYPES)  # OpenAI's formats; not our tsv
# The form fields of each endpoint, as OpenAI's API has them; any other is refused,
# so that a misspelt or unsupported option is not silently ignored.
FORM_FIELDS = {
    Task.TRANSCRIBE: ("file", "model", "language", "prompt", "response_format", "temperature",
                      "timestamp_granularities[]"),
    Task.TRANSLATE: ("file", "model", "prompt", "response_format", "temperature", "timestamp_granularities[]"),
}


# ------------------------------------------------------------------ errors


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


class InvalidRequest(ApiError, RequestError):
    """The client's mistake (a 4xx status): a missing or bad field, an unknown
    model, a file too large, a body that is not a form."""


def http_error(status: int, message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """An error of `status`: the client's mistake below 500, the server's from 500 on."""
    kind = InvalidRequest if status < 500 else ApiError
    return kind(status, message, param=param, code=code)


def api_error(error: Exception) -> ApiError:
    """Any failure of a request as OpenAI's error: an ApiError as it is, any other
    RequestError a 400 with its message, anything else a 500 that blames no client
    (its traceback belongs in the gateway's log, never in the reply)."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, RequestError):
        return InvalidRequest(400, str(error))
    return ApiError(500, f"internal error: {type(error).__name__}: {error}", code="server_error")


# Triton's gRPC status -> (HTTP status, OpenAI error code, what to say before Triton's message).
TRITON_STATUS = {
    "INVALID_ARGUMENT": (400, None, ""),
    "UNAVAILABLE": (503, "service_unavailable", "the transcription server is unavailable: "),
    "RESOURCE_EXHAUSTED": (503, "service_unavailable", "the transcription server is unavailable: "),
    "DEADLINE_EXCEEDED": (504, "timeout", "the transcription took too long: "),
}
OTHER_TRITON_STATUS = (500, "server_error", "the transcription failed: ")


def error_from_triton(error: InferenceServerException, triton: ServerAddress | None = None) -> ApiError:
    """Triton's error as the client should see it: its message (without Triton's
    "in ensemble ..." prefix), OpenAI's status; when Triton at `triton` could not be
    reached, a 503 that says why. error.status() is gRPC's status name, such as
    "StatusCode.INVALID_ARGUMENT"."""
    unreachable = None if triton is None else connection_failure(triton, error)
    if unreachable is not None:
        return http_error(503, f"cannot reach Triton: {unreachable}", code="service_unavailable")
    name = str(error.status() or "").rsplit(".", 1)[-1]
    status, code, preface = TRITON_STATUS.get(name, OTHER_TRITON_STATUS)
    return http_error(status, preface + triton_message(error.message() or str(error)), code=code)


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


def parse_form(form: Mapping[str, Any], task: Task, model_ids: Sequence[str]) -> AudioRequest:
    """The multipart fields of one request. form: field -> list of values
    (str, or an object with `read` for files); model_ids: the `model` values
    accepted. Raises InvalidRequest."""

    def text(name: str, required: bool = False) -> str | None:
        values = form.get(name) or [None]
        value = values[-1]
        if value is not None and not isinstance(value, str):
            raise InvalidRequest(400, f"'{name}' must be a text field, not a file", param=name, code="invalid_type")
        if not value:
            if required:
                raise InvalidRequest(
                    400, f"you must provide a '{name}' parameter", param=name, code="missing_required_parameter"
                )
            return None
        return value

    for name in form:
        if name not in FORM_FIELDS[task]:
            raise InvalidRequest(
                400, f"unknown field {name!r}; this endpoint takes {', '.join(FORM_FIELDS[task])}",
                param=name, code="unknown_parameter",
            )
    model = text("model", required=True)
    if model not in model_ids:
        raise InvalidRequest(
            404, f"the model {model!r} does not exist; this server has {list(model_ids)}",
            param="model", code="model_not_found",
        )
    response_format = text("response_format") or ResponseFormat.JSON.value
    if response_format not in OPENAI_FORMATS:
        raise InvalidRequest(
            400, f"response_format must be one of {list(OPENAI_FORMATS)}, got {response_format!r}",
            param="response_format", code="invalid_value",
        )
    response_format = ResponseFormat(response_format)
    temperature = _temperature(text("temperature"))
    granularities = tuple(dict.fromkeys(_granularities(form.get("timestamp_granularities[]", []))))
    if granularities and response_format is not ResponseFormat.VERBOSE_JSON:
        raise InvalidRequest(
            400, "timestamp_granularities[] needs response_format 'verbose_json'",
            param="timestamp_granularities[]", code="invalid_value",
        )
    language = text("language")
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
        raise InvalidRequest(
            400, f"temperature must be a number from 0 to {MAX_TEMPERATURE:g}, got {value!r}",
            param="temperature", code="invalid_value",
        )
    return temperature


def _granularities(values: Sequence[Any]) -> list[str]:
    for value in values:
        if value not in GRANULARITIES:
            raise InvalidRequest(
                400, f"timestamp_granularities[] may hold {list(GRANULARITIES)}, got {value!r}",
                param="timestamp_granularities[]", code="invalid_value",
            )
    return list(values)
