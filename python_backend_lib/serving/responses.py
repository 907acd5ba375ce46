"""How a request's outcome becomes its Triton response: outputs with the batch
dimension of one request (a transcript's three, or any arrays), a failure its
error, whose fault it was deciding the code.

Nothing here imports Triton (the `pb_utils` module is passed in), so it is tested without a server.
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from concurrent.futures import CancelledError
from typing import Any, NamedTuple

import numpy as np

from python_backend_lib.contract import tensor_names
from python_backend_lib.contract.faults import FAULT_PREFIXES, FAULT_STATUS, Fault
from python_backend_lib.core.errors import RequestError, ServerUnavailable
from python_backend_lib.serving.admission import Overloaded
from python_backend_lib.text.formats import Document, ResponseFormat, segments_to_json


class Failure(NamedTuple):
    """What a client is told about a failed request, and whose fault it was."""

    message: str
    fault: Fault


def describe_failure(error: BaseException) -> Failure:
    """Whose fault `error` is, and what the client is told: never a traceback.

    Only a `RequestError` is the client's mistake. Any other exception, a plain
    ValueError included, is ours: the message says so rather than blame the request.
    """
    if isinstance(error, RequestError):
        return Failure(str(error), Fault.CLIENT)
    if isinstance(error, CancelledError):
        return Failure(f"{FAULT_PREFIXES[Fault.CANCELLED]}{error}", Fault.CANCELLED)
    if isinstance(error, Overloaded):
        return Failure(str(error), Fault.OVERLOADED)
    if isinstance(error, ServerUnavailable):
        return Failure(f"{FAULT_PREFIXES[Fault.UNAVAILABLE]}{error}; retry on another server", Fault.UNAVAILABLE)
    return Failure(f"{FAULT_PREFIXES[Fault.SERVER]}{type(error).__name__}: {error}", Fault.SERVER)


def error_response(pb_utils: Any, error: BaseException) -> Any:
    """An `InferenceResponse` carrying only `error`, with the code its `Fault` calls for.

    pb_utils: the `triton_python_backend_utils` module (only importable inside Triton).
    """
    message, fault = describe_failure(error)
    if fault is Fault.SERVER:
        pb_utils.Logger.log_error(f"{message}\n{''.join(traceback.format_exception(error))}")
    code = getattr(pb_utils.TritonError, FAULT_STATUS[fault])
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def tensors_response(pb_utils: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    """An `InferenceResponse` with these outputs, each given the batch dimension of one request."""
    return pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor(name, np.ascontiguousarray(array[None])) for name, array in arrays.items()]
    )


def transcript_response(pb_utils: Any, document: Document, response_format: ResponseFormat) -> Any:
    """An `InferenceResponse` with a finished transcript's TEXT, SEGMENTS and FORMATTED
    (the document in `response_format`), each a [1, 1] BYTES tensor of UTF-8."""
    rows = {name: np.array([text.encode("utf-8")], dtype=np.object_)  # [1] each
            for name, text in transcript_outputs(document, response_format).items()}
    return tensors_response(pb_utils, rows)


def transcript_outputs(document: Document, response_format: ResponseFormat) -> dict[str, str]:
    """A finished transcript's three outputs, by tensor name: its text, its segments as
    JSON and the document in `response_format`."""
    return {
        tensor_names.TEXT: document.text,
        tensor_names.SEGMENTS: segments_to_json(document.segments),
        tensor_names.FORMATTED: document.render(response_format),
    }
