"""Where a Triton server is, and what it means when it cannot be reached.

Every URL option (`whisper-triton transcribe --url`, `gateway --triton-url`,
`WhisperClient(url)`) takes `host:port`, or a URL whose scheme names the
protocol: `http://` and `https://` (TLS) for Triton's HTTP endpoint, `grpc://`
for its gRPC endpoint, as the serve banner prints them. A scheme that names the
other protocol is refused at once, before anything is sent.

When a request fails before the server could answer it, `connection_failure`
turns tritonclient's exception into one line that names the likely cause (no
server there, or the other protocol's port) and the fix. An answer that is not
Triton's (a 404 from whisper-triton's OpenAI gateway, a 405 from Triton's
metrics port) is looked into by `wrong_endpoint`, which names what answered
and the URL to give instead. Torch-free: the clients and the gateway use it.
"""

from __future__ import annotations

import enum
import http.client
import json
import re
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass

SERVE_COMMAND = "whisper-triton serve"
HTTP_PROBE_TIMEOUT_S = 2.0
# What grpcio's UNAVAILABLE says when no connection was made (as opposed to a server's own refusal).
CONNECTION_FAILURES = ("failed to connect", "Failed to connect", "Socket closed", "errors resolving", "DNS resolution")


class Protocol(str, enum.Enum):
    HTTP = "http"
    GRPC = "grpc"


# Triton's own default ports; `whisper-triton serve` keeps them.
DEFAULT_PORTS = {Protocol.HTTP: 8000, Protocol.GRPC: 8001}
# scheme -> (the protocol it names, whether it asks for TLS)
SCHEMES = {"http": (Protocol.HTTP, False), "https": (Protocol.HTTP, True), "grpc": (Protocol.GRPC, False)}
PROTOCOL_NAMES = {Protocol.HTTP: "HTTP", Protocol.GRPC: "gRPC"}
_ARTICLES = {Protocol.HTTP: "an", Protocol.GRPC: "a"}
# Triton puts this before an error raised by a step of an ensemble; the client
# asked for `transcribe` and needs only the step's own message.
_ENSEMBLE_PREFIX = re.compile(r"^in ensemble '[^']*', ")


class AddressError(ValueError):
    """A URL option that does not name a server of the protocol in use."""


@dataclass(frozen=True)
class ServerAddress:
    """location: `host:port` (HTTP may add a path prefix), as tritonclient takes it."""

    location: str
    protocol: Protocol
    tls: bool = False

    def __str__(self) -> str:
        scheme = "https" if self.tls else self.protocol.value
        return f"{scheme}://{self.location}"


def parse_address(url: str | None, protocol: Protocol | str | None = None) -> ServerAddress:
    """The server `url` names. protocol: the one in use, or None to take it from
    the URL's scheme (HTTP without one). Raises AddressError for a scheme that
    names the other protocol, an unknown scheme, or no host."""
    wanted = None if protocol is None else Protocol(protocol)
    if url is None:
        wanted = wanted or Protocol.HTTP
        return ServerAddress(f"localhost:{DEFAULT_PORTS[wanted]}", wanted)
    scheme, separator, rest = url.strip().rpartition("://")
    tls = False
    if separator:
        if scheme.lower() not in SCHEMES:
            raise AddressError(
                f"{url!r} has the scheme {scheme!r}; give host:port, or a URL starting with "
                f"{', '.join(s + '://' for s in SCHEMES)}"
            )
        named, tls = SCHEMES[scheme.lower()]
        if wanted is not None and named is not wanted:
            raise AddressError(
                f"{url!r} is {_ARTICLES[named]} {PROTOCOL_NAMES[named]} URL, but this connection speaks "
                f"{PROTOCOL_NAMES[wanted]}: give Triton's {PROTOCOL_NAMES[wanted]} address "
                f"(localhost:{DEFAULT_PORTS[wanted]} by default)"
            )
        wanted = named
    wanted = wanted or Protocol.HTTP
    location = rest.rstrip("/")
    if not location or location.startswith((":", "/")):
        raise AddressError(f"{url!r} names no host; give host:port, such as localhost:{DEFAULT_PORTS[wanted]}")
    if wanted is Protocol.GRPC and "/" in location:
        raise AddressError(f"{url!r}: a gRPC address is host:port, without a path")
    return ServerAddress(location, wanted, tls)


def triton_message(message: str) -> str:
    """Triton's error message as the client should read it: without the ensemble's prefix."""
    return _ENSEMBLE_PREFIX.sub("", message.strip())


def connection_failure(address: ServerAddress, error: BaseException) -> str | None:
    """One line naming why `address` gave no answer, and the fix; None when
    `error` is an answer from the server (a refused request, an overload).

    error: what tritonclient raised, an OSError or http.client.HTTPException
    over HTTP, an InferenceServerException over gRPC.
    """
    if address.protocol is Protocol.HTTP:
        if isinstance(error, ConnectionRefusedError):
            return _not_running(address)
        if isinstance(error, http.client.RemoteDisconnected) and not _listens(address.location):
            # No bytes at all, and nothing listens there now: the server went away mid-request.
            return (f"the server at {address} closed the connection without answering and no longer listens: "
                    "it stopped or crashed while the request was in flight (see its log)")
        if isinstance(error, http.client.HTTPException):  # bytes that are not HTTP/1.1: gRPC's HTTP/2
            return _other_protocol(address, "did not answer in HTTP")
        if isinstance(error, OSError):
            return f"cannot reach the server at {address}: {error.strerror or error}"
        return None
    status = str(getattr(error, "status", lambda: "")() or "")
    if not status.endswith("UNAVAILABLE"):
        return None
    message = getattr(error, "message", lambda: str(error))() or str(error)
    if not any(sign in message for sign in CONNECTION_FAILURES):
        return None  # UNAVAILABLE from the server itself: overloaded
    # gRPC reports only the last address it tried (localhost is ::1 and 127.0.0.1):
    # whether an HTTP server answers there is the surer sign of the wrong port.
    if _answers_http(address.location):
        return wrong_endpoint(address) or _other_protocol(address, "closed the gRPC connection")
    if "Connection refused" in message:
        return _not_running(address)
    return f"cannot reach the server at {address}: {message}"


class Endpoint(enum.Enum):
    """What answers HTTP at an address."""

    TRITON = "Triton's HTTP endpoint"
    METRICS = "Triton's metrics port"
    GATEWAY = "whisper-triton's OpenAI-compatible gateway (whisper-triton gateway)"


def wrong_endpoint(address: ServerAddress) -> str | None:
    """One line naming what answered at `address` and the URL to give instead,
    when it is the metrics port or the gateway rather than Triton; None otherwise."""
    endpoint = identify(address.location, address.tls)
    if endpoint is None or endpoint is Endpoint.TRITON:
        return None
    host = _host(address.location)
    instead = (
        f"give Triton's address instead: --url {host}:{DEFAULT_PORTS[Protocol.HTTP]} (HTTP) "
        f"or --url grpc://{host}:{DEFAULT_PORTS[Protocol.GRPC]} (gRPC) by default"
    )
    if endpoint is Endpoint.GATEWAY:
        base = f"{'https' if address.tls else 'http'}://{address.location.split('/', 1)[0]}/v1"
        return f"{address} is {endpoint.value}, not Triton: {instead}; OpenAI clients use the gateway at {base}"
    return f"{address} is {endpoint.value}, which serves only /metrics: {instead}"


def identify(location: str, tls: bool = False) -> Endpoint | None:
    """What answers HTTP at `location` (host:port), by what it serves: Triton's
    server metadata (/v2), Prometheus text (/metrics), OpenAI's model list
    (/v1/models); None for something else, or nothing."""
    root = f"{'https' if tls else 'http'}://{location.split('/', 1)[0]}"
    metadata = _get_json(f"{root}/v2")
    if isinstance(metadata, dict) and metadata.get("name") == "triton":
        return Endpoint.TRITON
    metrics = _get_text(f"{root}/metrics")
    if metrics is not None and "# TYPE nv_" in metrics:
        return Endpoint.METRICS
    models = _get_json(f"{root}/v1/models")
    if isinstance(models, dict) and models.get("object") == "list":
        return Endpoint.GATEWAY
    return None


def _get_text(url: str) -> str | None:
    """The body of a 200 answer to GET `url`; None for any other outcome."""
    try:
        with urllib.request.urlopen(url, timeout=HTTP_PROBE_TIMEOUT_S) as reply:
            return reply.read().decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException, ValueError):  # HTTPError (a status) is an OSError
        return None


def _get_json(url: str) -> object:
    text = _get_text(url)
    try:
        return None if text is None else json.loads(text)
    except ValueError:
        return None


def _host(location: str) -> str:
    """"example.org:9000/prefix" -> "example.org" ("[::1]:9000" keeps its brackets)."""
    host_port = location.split("/", 1)[0]
    host, separator, port = host_port.rpartition(":")
    return host if separator and port.isdigit() and not host_port.endswith("]") else host_port


def _listens(location: str) -> bool:
    """Whether anything accepts a TCP connection at `location` (host:port)."""
    host, _, port = location.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "localhost", int(port)), timeout=HTTP_PROBE_TIMEOUT_S):
            return True
    except (OSError, ValueError):
        return False


def _answers_http(location: str) -> bool:
    """Whether an HTTP server answers at `location` (any status will do)."""
    try:
        with urllib.request.urlopen(f"http://{location}/v2/health/live", timeout=HTTP_PROBE_TIMEOUT_S):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, http.client.HTTPException, ValueError):
        return False


def _not_running(address: ServerAddress) -> str:
    return (
        f"no server answers at {address} (connection refused): is it running? "
        f"Start it with `{SERVE_COMMAND}`, or give the address it prints"
    )


def _other_protocol(address: ServerAddress, what_happened: str) -> str:
    other = Protocol.GRPC if address.protocol is Protocol.HTTP else Protocol.HTTP
    return (
        f"{address} {what_happened}: it is likely Triton's {PROTOCOL_NAMES[other]} port; "
        f"give its {PROTOCOL_NAMES[address.protocol]} port ({DEFAULT_PORTS[address.protocol]} by default), "
        f"or speak {PROTOCOL_NAMES[other]} to this one"
    )
