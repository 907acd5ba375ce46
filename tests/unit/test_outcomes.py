"""loadtest/outcomes.py reads a failed request as the server meant it: each failure
the whisper model can answer with (`serving.responses.describe_failure`), sent with
the status its fault calls for, over HTTP (the code) and gRPC, is refused as
overloaded only when it is the overload refusal, and failed with its reason otherwise."""

from __future__ import annotations

from concurrent.futures import CancelledError

import pytest
from tritonclient.utils import InferenceServerException

from loadtest.outcomes import Verdict, judge
from python_backend_lib.contract.faults import FAULT_STATUS
from python_backend_lib.core.errors import RequestError, ServerUnavailable
from python_backend_lib.serving.admission import RequestLedger
from python_backend_lib.serving.responses import describe_failure

# Each status as tritonclient reports it: HTTP's code, gRPC's name. A cancel is gRPC's
# alone: an HTTP client that goes away reads no answer.
REPORTED = {
    "INVALID_ARG": ("400", "StatusCode.INVALID_ARGUMENT"),
    "CANCELLED": (None, "StatusCode.CANCELLED"),
    "UNAVAILABLE": ("503", "StatusCode.UNAVAILABLE"),
    "INTERNAL": ("500", "StatusCode.INTERNAL"),
}


def overloaded() -> Exception:
    ledger = RequestLedger(limit=1)
    ledger.enter()
    with pytest.raises(Exception) as refused:
        ledger.enter()
    return refused.value


FAILURES = {
    "overloaded": (overloaded, Verdict.REFUSED),
    "bad audio": (lambda: RequestError("AUDIO is not a decodable file"), Verdict.FAILED),
    "cancelled": (lambda: CancelledError("request cancelled"), Verdict.FAILED),
    "stopping": (lambda: ServerUnavailable("the server is stopping"), Verdict.FAILED),
    "our bug": (lambda: IndexError("list index out of range"), Verdict.FAILED),
}


@pytest.mark.parametrize("protocol", [0, 1], ids=["http", "grpc"])
@pytest.mark.parametrize("name", FAILURES)
def test_each_failure_of_the_server_is_read_as_it_meant_it(name, protocol):
    make, verdict = FAILURES[name]
    message, fault = describe_failure(make())
    status = FAULT_STATUS[fault]
    if REPORTED[status][protocol] is None:
        pytest.skip(f"no {status} over this protocol")
    for preface in ("", "in ensemble 'transcribe', "):  # as the whisper model says it, and through the ensemble
        judged = judge(InferenceServerException(preface + message, status=REPORTED[status][protocol]))
        assert judged.verdict is verdict, (name, judged)
        assert judged.status == status and message in judged.reason


def test_tritons_own_full_queue_is_a_refusal():
    judged = judge(InferenceServerException("Exceeds maximum queue size", status="StatusCode.UNAVAILABLE"))
    assert judged.verdict is Verdict.REFUSED


def test_a_client_deadline_is_a_failure_by_its_grpc_name():
    judged = judge(InferenceServerException("Deadline Exceeded", status="StatusCode.DEADLINE_EXCEEDED"))
    assert (judged.verdict, judged.status) == (Verdict.FAILED, "DEADLINE_EXCEEDED")
