"""`stream=true` on /v1/audio/transcriptions: OpenAI's server-sent events, from the streamed path.

The gateway sends the file to Triton's `transcribe_stream` model (gRPC's
stream_infer), whose every response holds the transcript so far, and answers
with OpenAI's events, each a `data:` line of JSON:

    {"type": "transcript.text.delta", "delta": "..."}     as more text is decoded
    {"type": "transcript.text.done", "text": "...", "usage": {"type": "duration", "seconds": ...}}

A delta comes as the decoder ends a segment. The deltas joined are the done event's
text, which is the text the same request without `stream` answers, unless a temperature
fallback read a window's first segments otherwise after they went: no delta is taken
back, so the deltas then stop there and the done event alone has the rest. `usage` is
the one OpenAI gives whisper-1, the audio's duration. A failure before the first event is an ordinary error reply (its
status, OpenAI's error body); once events have gone, it is one more event,
`{"error": {...}}`, which the `openai` client raises as an APIError. A client
that leaves mid-stream gets its request cancelled on the server by its id, and
the gateway reads Triton's answers to the end (closing a gRPC call that Triton
still runs is what the CLI avoids too: server#7368).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from clients.streaming import is_final
from gateway.openai_api import USAGE_TYPE
from gateway.openai_errors import ApiError, error_from_triton
from python_backend_lib.contract import tensor_names

if TYPE_CHECKING:
    from clients.connection import ServerAddress

DELTA_EVENT = "transcript.text.delta"
DONE_EVENT = "transcript.text.done"
MEDIA_TYPE = "text/event-stream"


def sse(record: dict[str, Any]) -> bytes:
    """One server-sent event carrying `record` as JSON."""
    return f"data: {json.dumps(record, ensure_ascii=False)}\n\n".encode()


def delta_event(delta: str) -> bytes:
    return sse({"type": DELTA_EVENT, "delta": delta})


def done_event(text: str, seconds: float) -> bytes:
    return sse({"type": DONE_EVENT, "text": text, "usage": {"type": USAGE_TYPE, "seconds": seconds}})


def error_event(error: ApiError) -> bytes:
    return sse(error.body())


@dataclass
class TextDeltas:
    """The text sent so far, and what each newer transcript adds to it. A transcript
    so far is a beginning of the whole one; one that is not (an overtaken response, or
    a shorter text) adds nothing, so no delta is ever taken back."""

    sent: str = ""

    def delta(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent):], text
        return new


@dataclass(frozen=True)
class StreamedReply:
    """A response of `transcribe_stream`, as the gateway reads it: the TEXT so far and the
    FORMATTED verbose_json (for the duration), or Triton's error, and whether it is the last."""

    text: str | None
    verbose_json: str | None
    error: ApiError | None
    final: bool


async def replies_of(stream: AsyncIterator[tuple[Any, Any]], triton: ServerAddress) -> AsyncIterator[StreamedReply]:
    """The aio tritonclient's (result, error) pairs of one `transcribe_stream` request,
    asked for TEXT and FORMATTED in verbose_json; errors as the client should see them."""
    async for result, error in stream:
        if error is not None:
            yield StreamedReply(None, None, error_from_triton(error, triton, streamed=True), final=True)
            return
        response = result.get_response()
        has_outputs = bool(response.outputs)
        yield StreamedReply(
            text=_text(result, tensor_names.TEXT) if has_outputs else None,
            verbose_json=_text(result, tensor_names.FORMATTED) if has_outputs else None,
            error=None,
            final=is_final(response.parameters),
        )


def _text(result: Any, name: str) -> str:
    return result.as_numpy(name).reshape(-1)[0].decode("utf-8")


async def stream_events(first: StreamedReply, replies: AsyncIterator[StreamedReply],
                        on_abandoned: Callable[[], None]) -> AsyncIterator[bytes]:
    """The events of one streamed transcription, from its first reply (already read: an
    error there became the HTTP reply) and the rest. `on_abandoned` is called when the
    HTTP client leaves before the end: it must start the cancel without waiting here,
    where the request's task is being cancelled."""
    deltas, reply, finished = TextDeltas(), first, False
    longest = ""  # the whole text in the end, even where the final flag came with an overtaken response
    try:
        while True:
            if reply.error is not None:
                finished = True
                yield error_event(reply.error)
                return
            longest = max(longest, reply.text or "", key=len)
            new = deltas.delta(reply.text or "")
            if new:
                yield delta_event(new)
            if reply.final:
                finished = True
                # Every response holds the recording's duration.
                duration = json.loads(reply.verbose_json)["duration"] if reply.verbose_json else 0.0
                yield done_event(longest, duration)
                return
            try:
                reply = await replies.__anext__()
            except StopAsyncIteration:  # the stream ended without its final flag: Triton's fault
                finished = True
                yield error_event(ApiError(500, "the transcription stream ended early", code="server_error"))
                return
    finally:
        if not finished:
            on_abandoned()
