"""Whose fault a failure is: the client's mistakes have one type; anything else is ours."""


class RequestError(ValueError):
    """A request the server cannot serve as sent: bad audio, parameters or tensors.

    The one base for the client's mistakes: the adapters answer it with
    INVALID_ARG (HTTP 400) and its message, which names the problem. Any other
    exception, ValueError included, is the server's fault (INTERNAL, HTTP 500).
    It subclasses ValueError so that callers of the library that catch bad
    input as ValueError keep working.
    """


class ServerUnavailable(RuntimeError):
    """The server cannot take the request now (it is shutting down, or its engine
    gave up after failing repeatedly): not the client's mistake, and worth
    retrying on another server. Answered with UNAVAILABLE (HTTP 503)."""
