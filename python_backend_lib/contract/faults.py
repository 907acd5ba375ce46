"""Whose fault a failed request was, as the server decides it and a client reads it.

The server answers a failure with the Triton status its `Fault` calls for
(`FAULT_STATUS`) and a message that begins with the fault's prefix
(`FAULT_PREFIXES`); a gRPC stream carries a failed response's message without
its status, so `fault_of_message` reads the fault back from the message alone.
The server (`serving.responses`), the gateway and the load drivers all read it here.
"""

from __future__ import annotations

import enum


class Fault(enum.Enum):
    """Whose a failed request's error is; decides its Triton error code."""

    CLIENT = "client"  # a RequestError (bad audio, parameters or tensors): INVALID_ARG
    CANCELLED = "cancelled"  # the client went away: CANCELLED
    OVERLOADED = "overloaded"  # too many requests in flight, retry later: UNAVAILABLE
    UNAVAILABLE = "unavailable"  # out of service (stopping, or an engine gave up), retry elsewhere: UNAVAILABLE
    SERVER = "server"  # ours: INTERNAL, and logged with its traceback


# Each fault's Triton status, by the name of `pb_utils.TritonError`'s code (what
# tritonclient reports over HTTP as 400, 499, 503 and 500).
FAULT_STATUS = {
    Fault.CLIENT: "INVALID_ARG",
    Fault.CANCELLED: "CANCELLED",
    Fault.OVERLOADED: "UNAVAILABLE",
    Fault.UNAVAILABLE: "UNAVAILABLE",
    Fault.SERVER: "INTERNAL",
}
# How each fault's message begins but the client's (an overload's message says it itself).
FAULT_PREFIXES = {
    Fault.CANCELLED: "cancelled: ",
    Fault.OVERLOADED: "server overloaded: ",
    Fault.UNAVAILABLE: "server unavailable: ",
    Fault.SERVER: "internal error: ",
}
# Triton's own messages for a full queue, and for a model process that failed.
TRITON_FAULT_PREFIXES = {
    "Exceeds maximum queue size": Fault.OVERLOADED,
    "Failed to process the request": Fault.SERVER,
}


def fault_of_message(message: str) -> Fault:
    """Whose fault a failed response was, from its message alone (without Triton's "in
    ensemble ..." preface): the inverse of the server's `describe_failure`."""
    for fault, prefix in FAULT_PREFIXES.items():
        if message.startswith(prefix):
            return fault
    for prefix, fault in TRITON_FAULT_PREFIXES.items():
        if prefix in message:
            return fault
    return Fault.CLIENT
