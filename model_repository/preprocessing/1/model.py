"""Triton model `preprocessing`: AUDIO (a file, or raw PCM) -> LOG_MEL and AUDIO_SECONDS.

Every request parameter is checked here, so a bad request fails before any audio is decoded.
"""

import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

# Serving from a checkout without `pip install -e .`: the library sits beside the repository.
sys.path.append(str(Path(__file__).resolve().parents[3]))

from python_backend_lib.audio.features import features_for  # noqa: E402
from python_backend_lib.checkpoints.weights import load_config  # noqa: E402
from python_backend_lib.core import geometry
from python_backend_lib.serving import tensor_names  # noqa: E402
from python_backend_lib.serving.inputs import decode_request_audio, single_row
from python_backend_lib.serving.parameters import parse_request_parameters  # noqa: E402
from python_backend_lib.serving.responses import error_response
from python_backend_lib.serving.settings import ModelSettings  # noqa: E402
from python_backend_lib.transcription.pipeline import default_device  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self.settings = ModelSettings.from_triton(args["model_config"])
        self.n_mels = load_config(self.settings.checkpoint).dims.n_mels
        # The log-mel is most of this model's work: on a GPU it takes a fraction of a
        # millisecond instead of ~25 ms of a CPU core.
        self.device = default_device()

    def execute(self, requests):
        # Each answer leaves as soon as it is ready, not when the whole batch is done:
        # a request refused later (overload) or a short clip does not wait for 63 others.
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            request.get_response_sender().send(self._respond(request), flags=final)
        return None

    def _respond(self, request):
        try:
            parameters = parse_request_parameters(request.parameters())
            audio_tensor = pb_utils.get_input_tensor_by_name(request, tensor_names.AUDIO)
            (data,) = single_row(audio_tensor.as_numpy(), tensor_names.AUDIO)  # [1] bytes
            waveform = decode_request_audio(data, parameters, max_seconds=self.settings.max_audio_seconds)
            features = features_for(waveform, self.n_mels, self.device).cpu()  # [n_mels, frames], as Pipeline.transcribe
        except Exception as error:
            return error_response(pb_utils, error)
        seconds = np.array([[len(waveform) / geometry.SAMPLE_RATE]], dtype=np.float32)  # [1, 1]
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor(tensor_names.LOG_MEL, features.numpy()[None]),  # [1, n_mels, frames]
                pb_utils.Tensor(tensor_names.AUDIO_SECONDS, seconds),
            ]
        )
