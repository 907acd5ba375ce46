"""How every load driver accounts for a request: answered, refused as overloaded, or
failed with a reason.

The flood, the soak, the locust users and bench's load generator read a Triton
error the same way here: its status by one name over HTTP and gRPC (`status_name`),
and whether it is the server's overload refusal, which the server marks by its
status and its message's prefix (`contract.faults`). Anything else failed, and its
reason is kept: a load test never counts a failure as a refusal.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from tritonclient.utils import InferenceServerException

from python_backend_lib.contract.faults import FAULT_PREFIXES, FAULT_STATUS, TRITON_FAULT_PREFIXES, Fault

# Triton's statuses, as tritonclient reports them over HTTP (the code) and gRPC, by one name.
STATUS_NAMES = {
    "400": "INVALID_ARG", "StatusCode.INVALID_ARGUMENT": "INVALID_ARG",
    "StatusCode.CANCELLED": "CANCELLED",
    "500": "INTERNAL", "StatusCode.INTERNAL": "INTERNAL",
    "503": "UNAVAILABLE", "StatusCode.UNAVAILABLE": "UNAVAILABLE",
}  # fmt: skip
GRPC_STATUS_PREFIX = "StatusCode."
# Messages that mark an overload refusal: the whisper model's, and Triton's full queue.
OVERLOAD_MARKS = (FAULT_PREFIXES[Fault.OVERLOADED].rstrip(": "),) + tuple(
    prefix for prefix, fault in TRITON_FAULT_PREFIXES.items() if fault is Fault.OVERLOADED
)


class Verdict(enum.Enum):
    ANSWERED = "answered"
    REFUSED = "refused"  # as overloaded: retry later
    FAILED = "failed"  # anything else, with its reason


@dataclass(frozen=True)
class Judged:
    """A failed request's verdict (REFUSED or FAILED), its status name and its message."""

    verdict: Verdict
    status: str
    message: str

    @property
    def reason(self) -> str:
        return f"{self.status}: {self.message}"


def status_name(error: InferenceServerException) -> str:
    """The error's status by its Triton name; a status Triton does not send (a client's
    deadline) by its gRPC name."""
    status = str(error.status())
    return STATUS_NAMES.get(status, status.removeprefix(GRPC_STATUS_PREFIX))


def is_overloaded(status: str, message: str) -> bool:
    return status == FAULT_STATUS[Fault.OVERLOADED] and any(mark in message for mark in OVERLOAD_MARKS)


def judge(error: InferenceServerException) -> Judged:
    """REFUSED for the server's overload refusal, FAILED for anything else."""
    status, message = status_name(error), " ".join((error.message() or str(error)).split())
    return Judged(Verdict.REFUSED if is_overloaded(status, message) else Verdict.FAILED, status, message)
