"""OpenAI's error body for every failure of a gateway request, with the HTTP status
its fault calls for.

Whose fault decides the status, as in the Triton adapters: a `RequestError`
(`InvalidRequest` here, or one from the library) is the client's mistake, a 4xx;
Triton's own refusals keep their meaning (INVALID_ARGUMENT is 400, overload 503);
anything else is the server's fault, a 500 that says so. Pure: no FastAPI and no
Triton client here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from clients.connection import ServerAddress, connection_failure, triton_message
from python_backend_lib.contract.faults import Fault, fault_of_message
from python_backend_lib.core.errors import RequestError

if TYPE_CHECKING:
    from tritonclient.utils import InferenceServerException


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


def unauthorized(authorization: str | None) -> InvalidRequest:
    """A 401 for a request whose `Authorization` header is missing or holds another key."""
    if authorization is None:
        message = "no API key given: send it as the header `Authorization: Bearer <key>`"
    elif not authorization.startswith("Bearer "):
        message = "the Authorization header must be `Bearer <key>`"
    else:
        message = "incorrect API key"
    return InvalidRequest(401, message, code="invalid_api_key")


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
# The gRPC status each fault's response has (`serving.responses.error_response`).
STREAM_FAULT_STATUS = {
    Fault.CLIENT: "INVALID_ARGUMENT",
    Fault.CANCELLED: "CANCELLED",
    Fault.OVERLOADED: "UNAVAILABLE",
    Fault.UNAVAILABLE: "UNAVAILABLE",
    Fault.SERVER: "INTERNAL",
}


def is_overloaded(error: Exception) -> bool:
    """Whether Triton refused the request as overloaded (too many in flight: retry later),
    as the server says it (`serving.responses`) or Triton's own full queue does."""
    from tritonclient.utils import InferenceServerException

    if not isinstance(error, InferenceServerException):
        return False
    return fault_of_message(triton_message(error.message() or str(error))) is Fault.OVERLOADED


def error_from_triton(
    error: InferenceServerException, triton: ServerAddress | None = None, streamed: bool = False
) -> ApiError:
    """Triton's error as the client should see it: its message (without Triton's
    "in ensemble ..." prefix), OpenAI's status; when Triton at `triton` could not be
    reached, a 503 that says why. error.status() is gRPC's status name, such as
    "StatusCode.INVALID_ARGUMENT"; `streamed`: an error of gRPC's stream_infer, which
    carries none, so that its message tells whose fault it was (`fault_of_message`)."""
    unreachable = None if triton is None else connection_failure(triton, error)
    if unreachable is not None:
        return http_error(503, f"cannot reach Triton: {unreachable}", code="service_unavailable")
    message = triton_message(error.message() or str(error))
    status = error.status()
    if status is None and streamed:  # a gRPC stream's error has no status: its message says whose fault it was
        status = STREAM_FAULT_STATUS[fault_of_message(message)]
    name = str(status or "").rsplit(".", 1)[-1]
    status, code, preface = TRITON_STATUS.get(name, OTHER_TRITON_STATUS)
    return http_error(status, preface + message, code=code)
