"""Triton model `whisper`: LOG_MEL and AUDIO_SECONDS -> TOKENS, on the library's engine.

`execute` only starts each request's transcription (window by window, as
`Pipeline.transcribe` does) and returns None; the engine thread answers every
request through its response sender when its last window is decoded, so
requests join and leave the running batch independently.
"""

import sys
from functools import partial
from pathlib import Path

import torch
import triton_python_backend_utils as pb_utils

# Serving from a checkout without `pip install -e .`: the library sits beside the repository.
sys.path.append(str(Path(__file__).resolve().parents[3]))

from python_backend_lib import tensor_names, token_stream  # noqa: E402
from python_backend_lib.longform import LongFormJob, TranscribeOptions, Transcript  # noqa: E402
from python_backend_lib.parameters import parse_request_parameters  # noqa: E402
from python_backend_lib.pipeline import Pipeline  # noqa: E402
from python_backend_lib.serving import (  # noqa: E402
    CancellationProbe,
    ModelSettings,
    error_response,
    exact_seconds,
    single_row,
)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        self.settings = ModelSettings.from_triton(args["model_config"])
        self.pipeline = Pipeline.load(self.settings.checkpoint)
        if self.pipeline.tokenizer is None:
            raise ValueError(f"checkpoint {self.settings.checkpoint!r} has no tokenizer.json")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                options = TranscribeOptions(decoding=parse_request_parameters(request.parameters()).decoding)
                log_mel = pb_utils.get_input_tensor_by_name(request, tensor_names.LOG_MEL)
                seconds = pb_utils.get_input_tensor_by_name(request, tensor_names.AUDIO_SECONDS)
                mel = torch.from_numpy(single_row(log_mel.as_numpy(), tensor_names.LOG_MEL))  # [n_mels, frames]
                (duration,) = single_row(seconds.as_numpy(), tensor_names.AUDIO_SECONDS).tolist()
                LongFormJob(
                    self.pipeline.engine.submit,
                    self.pipeline.config,
                    self.pipeline.tokenizer,
                    mel,
                    exact_seconds(duration),
                    options,
                    on_done=partial(self._answer, sender, options),
                    is_cancelled=CancellationProbe(request.is_cancelled),
                ).start()  # ValueError at once for features or options that do not fit the model
            except Exception as error:
                sender.send(error_response(pb_utils, error), flags=FINAL)
        return None

    def _answer(self, sender, options: TranscribeOptions, outcome: Transcript | BaseException) -> None:
        """On the engine thread: the request's only response."""
        if isinstance(outcome, BaseException):
            response = error_response(pb_utils, outcome)
        else:
            tokens = token_stream.pack(outcome, options, self.pipeline.tokenizer.special.eot)[None]  # [1, n]
            response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(tensor_names.TOKENS, tokens)])
        sender.send(response, flags=FINAL)

    def finalize(self):
        self.pipeline.close()
