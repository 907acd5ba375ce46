"""Triton model `postprocessing`: TOKENS and AUDIO_SECONDS -> TEXT and SEGMENTS (JSON).

Text and segments come from the windows' tokens by the library's own rules
(`token_stream`), so served transcripts equal `Pipeline.transcribe`'s.
Request parameters are not read: timestamp tokens, when asked for, are in TOKENS.
"""

import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

# Serving from a checkout without `pip install -e .`: the library sits beside the repository.
sys.path.append(str(Path(__file__).resolve().parents[3]))

from python_backend_lib import tensor_names, token_stream  # noqa: E402
from python_backend_lib.formats import segments_to_json  # noqa: E402
from python_backend_lib.serving import ModelSettings, error_response, exact_seconds, single_row  # noqa: E402
from python_backend_lib.tokenizer import load_tokenizer  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self.settings = ModelSettings.from_triton(args["model_config"])
        self.tokenizer = load_tokenizer(self.settings.checkpoint)

    def execute(self, requests):
        return [self._respond(request) for request in requests]

    def _respond(self, request):
        try:
            tokens_tensor = pb_utils.get_input_tensor_by_name(request, tensor_names.TOKENS)
            seconds_tensor = pb_utils.get_input_tensor_by_name(request, tensor_names.AUDIO_SECONDS)
            tokens = single_row(tokens_tensor.as_numpy(), tensor_names.TOKENS).tolist()  # windows, each closed by EOT
            (seconds,) = single_row(seconds_tensor.as_numpy(), tensor_names.AUDIO_SECONDS).tolist()
            windows = token_stream.unpack(tokens, self.tokenizer.special.eot)
            text, segments = token_stream.transcript_text_and_segments(self.tokenizer, windows, exact_seconds(seconds))
        except Exception as error:
            return error_response(pb_utils, error)
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor(tensor_names.TEXT, _bytes_row(text)),
                pb_utils.Tensor(tensor_names.SEGMENTS, _bytes_row(segments_to_json(segments))),
            ]
        )


def _bytes_row(text: str) -> np.ndarray:
    return np.array([[text.encode("utf-8")]], dtype=np.object_)  # [1, 1] BYTES
