"""Triton model `preprocessing`: AUDIO (a file, or raw PCM) -> WAVEFORM, 16 kHz mono float32.

Every request parameter is checked here, so a bad request fails before any
audio is decoded. No torch and no GPU: the log-mel is computed in `whisper`, on
its own device. Files are decoded on a pool of `decode_threads` threads (the
decoders release the GIL), each request answered as soon as its audio is ready.
"""

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import triton_python_backend_utils as pb_utils

# Serving from a checkout without `pip install -e .`: the library sits beside the repository.
sys.path.append(str(Path(__file__).resolve().parents[3]))

from python_backend_lib.serving import tensor_names
from python_backend_lib.serving.inputs import decode_request_audio, single_row
from python_backend_lib.serving.parameters import parse_request_parameters
from python_backend_lib.serving.responses import error_response
from python_backend_lib.serving.settings import ModelSettings

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        self.settings = ModelSettings.from_triton(args["model_config"])
        self.decoders = ThreadPoolExecutor(self.settings.thread_count(), thread_name_prefix="decode-audio")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                parameters = parse_request_parameters(request.parameters())
                audio = pb_utils.get_input_tensor_by_name(request, tensor_names.AUDIO)
                (data,) = single_row(audio.as_numpy(), tensor_names.AUDIO)  # [1] bytes, read before execute returns
            except Exception as error:
                sender.send(error_response(pb_utils, error), flags=FINAL)
                continue
            self.decoders.submit(self._answer, sender, data, parameters)
        return None

    def _answer(self, sender, data, parameters):
        try:
            waveform = decode_request_audio(data, parameters, max_seconds=self.settings.max_audio_seconds)
            response = pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(tensor_names.WAVEFORM, waveform[None])]  # [1, samples]
            )
        except Exception as error:
            response = error_response(pb_utils, error)
        sender.send(response, flags=FINAL)

    def finalize(self):
        self.decoders.shutdown(wait=True)
