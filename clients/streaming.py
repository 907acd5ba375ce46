"""Reading the streamed path (`transcribe_stream`): its responses become new segments.

Each response of `transcribe_stream` holds the transcript so far (TEXT, SEGMENTS,
FORMATTED), and the last one, with Triton's final flag, the whole. A response
can be overtaken by the next on its way (postprocessing runs several instances),
so a `TranscriptStream` keeps the transcript that extends the ones before it and
hands on only the segments no earlier response had; an overtaken response adds
nothing. A temperature fallback may read a window's first segments otherwise after
they were sent: a later response that does not extend what was handed on adds
nothing either, but the final one replaces it, and hands on its segments from
where the two part. Pure, so that the client (`api.WhisperClient.stream`), the CLI
and the gateway read a stream alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from python_backend_lib.text.formats import TimedText, segments_from_json
from python_backend_lib.text.subtitles import format_timestamp

if TYPE_CHECKING:
    from clients.api import TranscriptOutputs

# The response parameter by which Triton marks a request's last response.
FINAL_RESPONSE = "triton_final_response"
# The request parameter that asks Triton for a final response even when it has no outputs.
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"


@dataclass(frozen=True)
class StreamUpdate:
    """What a stream has told so far.

    new_segments: the segments this response added (none for the final one, at times).
    segments: every segment so far, in order.
    outputs: the transcript so far as the server wrote it; the final update's is the
        whole transcript, as the batch `transcribe` answers it.
    final: the stream's last update.
    """

    new_segments: tuple[TimedText, ...]
    segments: tuple[TimedText, ...]
    outputs: TranscriptOutputs
    final: bool


class TranscriptStream:
    """The updates of one streamed request, from its responses in the order they came."""

    def __init__(self) -> None:
        self._segments: tuple[TimedText, ...] = ()
        self._outputs: TranscriptOutputs | None = None

    def update(self, outputs: TranscriptOutputs | None, final: bool) -> StreamUpdate | None:
        """The update a response brings (outputs None: an empty final response), or None
        when it brings nothing new (a response overtaken by a later one)."""
        new: tuple[TimedText, ...] = ()
        if outputs is not None:
            segments = segments_from_json(outputs.segments)
            shared = _shared_beginning(self._segments, segments)
            extends = shared == len(self._segments) < len(segments)
            # Neither a beginning of the other: the final reading replaces what was handed on.
            reread = final and shared < min(len(self._segments), len(segments))
            if self._outputs is None or extends or reread:
                new = segments[shared:]
                self._segments, self._outputs = segments, outputs
        if not new and not final:
            return None
        if self._outputs is None:  # a stream that ended without a transcript: its error said why
            raise ValueError("the stream ended without a transcript")
        return StreamUpdate(new_segments=new, segments=self._segments, outputs=self._outputs, final=final)


def _shared_beginning(first: tuple[TimedText, ...], second: tuple[TimedText, ...]) -> int:
    """How many segments the two begin with alike."""
    shared = 0
    while shared < min(len(first), len(second)) and first[shared] == second[shared]:
        shared += 1
    return shared


def is_final(response_parameters: Any) -> bool:
    """Whether a response (its protobuf `parameters` map) is its request's last."""
    return FINAL_RESPONSE in response_parameters and bool(response_parameters[FINAL_RESPONSE].bool_param)


def verbose_line(segment: TimedText) -> str:
    """A segment as openai-whisper's --verbose prints it: `[00:00.000 --> 00:04.000]  text`
    (hours only past the first; two spaces, as its segments' text starts with one)."""
    return f"[{_short(segment.start)} --> {_short(segment.end)}]  {segment.text.lstrip()}"


def _short(seconds: float) -> str:
    stamp = format_timestamp(seconds, ".")
    return stamp[3:] if stamp.startswith("00:") else stamp
