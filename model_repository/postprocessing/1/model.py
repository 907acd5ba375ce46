"""Triton model `postprocessing`: TRANSCRIPT (verbose_json) -> TEXT, SEGMENTS and FORMATTED.

The `whisper` model sends each finished transcript as verbose_json
(`formats.Document`); here it becomes the ensemble's TEXT and SEGMENTS, and
FORMATTED in the request's `response_format` (text, json, verbose_json, srt, vtt, tsv).
Served transcripts therefore equal `Pipeline.transcribe`'s.
"""

import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

# Serving from a checkout without `pip install -e .`: the library sits beside the repository.
sys.path.append(str(Path(__file__).resolve().parents[3]))

from python_backend_lib.serving import tensor_names
from python_backend_lib.serving.inputs import single_row
from python_backend_lib.serving.parameters import parse_request_parameters
from python_backend_lib.serving.responses import error_response
from python_backend_lib.serving.settings import ModelSettings
from python_backend_lib.text.formats import Document, segments_to_json


class TritonPythonModel:
    def initialize(self, args):
        self.settings = ModelSettings.from_triton(args["model_config"])

    def execute(self, requests):
        return [self._respond(request) for request in requests]

    def _respond(self, request):
        try:
            response_format = parse_request_parameters(request.parameters()).response_format
            transcript = pb_utils.get_input_tensor_by_name(request, tensor_names.TRANSCRIPT)
            (data,) = single_row(transcript.as_numpy(), tensor_names.TRANSCRIPT)  # [1] bytes
            document = Document.from_verbose_json(data)
            outputs = {
                tensor_names.TEXT: document.text,
                tensor_names.SEGMENTS: segments_to_json(document.segments),
                tensor_names.FORMATTED: document.render(response_format),
            }
        except Exception as error:
            return error_response(pb_utils, error)
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, _bytes_row(text)) for name, text in outputs.items()]
        )


def _bytes_row(text: str) -> np.ndarray:
    return np.array([[text.encode("utf-8")]], dtype=np.object_)  # [1, 1] BYTES
