"""Triton model `whisper`: LOG_MEL and AUDIO_SECONDS -> TRANSCRIPT, on the library's engine.

`execute` only starts each request's transcription (window by window, as
`Pipeline.transcribe` does) and returns None; the engine thread answers every
request through its response sender when its last window is decoded, so
requests join and leave the running batch independently. Beyond the request
limit (slots + max_queued_requests) a request is refused at once (UNAVAILABLE);
the `whisper_*` metrics are published from a thread of their own. TRANSCRIPT is
the whole result as verbose_json, for `postprocessing` to write in every format.
"""

import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

# Serving from a checkout without `pip install -e .`: the library sits beside the repository.
sys.path.append(str(Path(__file__).resolve().parents[3]))

from python_backend_lib.serving import tensor_names  # noqa: E402
from python_backend_lib.serving.admission import RequestLedger  # noqa: E402
from python_backend_lib.serving.inputs import CancellationProbe, check_log_mel, exact_seconds, single_row  # noqa: E402
from python_backend_lib.serving.metrics import WhisperMetrics  # noqa: E402
from python_backend_lib.serving.parameters import parse_request_parameters  # noqa: E402
from python_backend_lib.serving.responses import error_response
from python_backend_lib.serving.settings import ModelSettings, load_pipeline
from python_backend_lib.text.formats import Document, ResponseFormat  # noqa: E402
from python_backend_lib.transcription.longform import TranscribeOptions, Transcript  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        self.settings = ModelSettings.from_triton(args["model_config"])
        self.pipeline = load_pipeline(self.settings)
        if self.pipeline.tokenizer is None:
            raise ValueError(f"checkpoint {self.settings.checkpoint!r} has no tokenizer.json")
        engine = self.pipeline.engine
        self.ledger = RequestLedger(self.settings.request_limit(engine.slots))
        self.metrics = WhisperMetrics(pb_utils, engine, self.ledger)

    def execute(self, requests):
        for request in requests:
            sender, entry = request.get_response_sender(), None
            try:
                options = parse_request_parameters(request.parameters()).transcription
                log_mel = pb_utils.get_input_tensor_by_name(request, tensor_names.LOG_MEL)
                seconds = pb_utils.get_input_tensor_by_name(request, tensor_names.AUDIO_SECONDS)
                mel = single_row(log_mel.as_numpy(), tensor_names.LOG_MEL)  # [n_mels, frames]
                (duration,) = single_row(seconds.as_numpy(), tensor_names.AUDIO_SECONDS).tolist()
                check_log_mel(mel, duration, self.pipeline.n_mels, self.settings.max_audio_seconds)
                entry = self.ledger.enter()  # Overloaded (UNAVAILABLE) when the limit is reached
                self.pipeline.start(
                    torch.from_numpy(mel),
                    exact_seconds(duration),
                    options,
                    on_done=partial(self._answer, sender, options, entry),
                    is_cancelled=CancellationProbe(request.is_cancelled),
                )  # ValueError at once for features or options that do not fit the model
            except Exception as error:
                self._answer(sender, None, entry, error)
        return None

    def _answer(self, sender, options: TranscribeOptions, entry, outcome: Transcript | BaseException) -> None:
        """The request's only response: on the engine thread, or in `execute` when refused."""
        try:
            response = self._response(options, outcome)
        except Exception as error:  # a result that cannot be written still gets an answer
            outcome, response = error, error_response(pb_utils, error)
        self.ledger.leave(entry, outcome)
        sender.send(response, flags=FINAL)

    def _response(self, options: TranscribeOptions, outcome: Transcript | BaseException):
        if isinstance(outcome, BaseException):
            return error_response(pb_utils, outcome)
        document = Document.from_transcript(outcome, options).render(ResponseFormat.VERBOSE_JSON)
        transcript = np.array([[document.encode("utf-8")]], dtype=np.object_)  # [1, 1] BYTES
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(tensor_names.TRANSCRIPT, transcript)])

    def finalize(self):
        self.pipeline.close()
        self.metrics.close()
