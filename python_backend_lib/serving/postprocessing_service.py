"""What the Triton `postprocessing` model does: a decoded recording's tensors to its transcript.

Each request carries `whisper`'s outputs (`decoded_tensors`) and the recording's
SAMPLES; the transcript is assembled from them as the library assembles it
(`text.transcript.assemble`), its times put back on the recording where
`vad_filter` left silences out (SPEECH_SPANS, `text.speech_timeline`), and written as TEXT, SEGMENTS and FORMATTED (the
request's response_format), `execute` answering every request of its call in turn.
No torch: it runs in processes of its own, several of them, away from the engine's.
"""

from __future__ import annotations

from typing import Any

from python_backend_lib.contract import tensor_names
from python_backend_lib.contract.decoded_tensors import DecodedTensors, from_tensors
from python_backend_lib.contract.parameters import parse_request_parameters
from python_backend_lib.core.options import TranscribeOptions
from python_backend_lib.serving.inputs import SpeechTimeline, read_samples, read_speech_timeline, single_row
from python_backend_lib.serving.responses import error_response, transcript_response
from python_backend_lib.serving.settings import ModelSettings
from python_backend_lib.text.formats import Document
from python_backend_lib.text.speech_timeline import on_recording_timeline
from python_backend_lib.text.tokenizer import Tokenizer
from python_backend_lib.text.transcript import assemble


class PostprocessingService:
    def __init__(self, pb_utils: Any, settings: ModelSettings, tokenizer: Tokenizer) -> None:
        self.pb_utils = pb_utils
        self.settings = settings
        self.tokenizer = tokenizer

    def respond(self, requests: list[Any]) -> list[Any]:
        """One response per request, in order: its transcript, or its own error."""
        return [self._response(request) for request in requests]

    def _response(self, request: Any) -> Any:
        try:
            parameters = parse_request_parameters(request.parameters())
            samples = read_samples(self.pb_utils, request, self.settings.max_audio_seconds)
            timeline = read_speech_timeline(self.pb_utils, request, samples)
            document = transcript_document(self._tensors(request), samples, timeline, parameters.transcription,
                                           self.tokenizer)
            return transcript_response(self.pb_utils, document, parameters.response_format)
        except Exception as error:
            return error_response(self.pb_utils, error)

    def _tensors(self, request: Any) -> DecodedTensors:
        def row(name: str):
            return single_row(self.pb_utils.get_input_tensor_by_name(request, name).as_numpy(), name)

        return DecodedTensors(
            tokens=row(tensor_names.TOKENS),
            windows=row(tensor_names.WINDOWS),
            alignment=row(tensor_names.ALIGNMENT),
            language=row(tensor_names.LANGUAGE),
            language_probability=row(tensor_names.LANGUAGE_PROBABILITY),
        )


def transcript_document(
    tensors: DecodedTensors,
    samples: int,
    timeline: SpeechTimeline | None,
    options: TranscribeOptions,
    tokenizer: Tokenizer,
) -> Document:
    """A request's transcript from its inputs, read and checked: the library's own part
    of the model's work (`bench.model_alone` times it beside the stub's `execute`)."""
    transcript = assemble(from_tensors(tensors, samples), tokenizer)
    if timeline is not None:
        transcript = on_recording_timeline(transcript, timeline.spans, timeline.recording_samples)
    return Document.from_transcript(transcript, options)
