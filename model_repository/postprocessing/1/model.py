"""Triton model `postprocessing`: whisper's decoded tensors and SAMPLES -> TEXT, SEGMENTS, FORMATTED.

The transcript is assembled as the library assembles it and written in the
request's response_format (`serving.postprocessing_service`). No torch.
"""

import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils

# Serving from a checkout without `pip install -e .`: the library sits beside the repository.
sys.path.append(str(Path(__file__).resolve().parents[3]))

from python_backend_lib.checkpoints.configs import load_config
from python_backend_lib.serving.parent_watch import ParentWatch
from python_backend_lib.serving.postprocessing_service import PostprocessingService
from python_backend_lib.serving.settings import ModelSettings
from python_backend_lib.text.tokenizer import load_tokenizer


class TritonPythonModel:
    def initialize(self, args):
        # Triton's own check ends this stub with tritonserver, but on a busy host only after
        # seconds; the watch ends it within one, as it does the other models' stubs.
        self.parent_watch = ParentWatch()
        self.settings = ModelSettings.from_triton(args["model_config"])
        tokenizer = load_tokenizer(load_config(self.settings.checkpoint))
        self.service = PostprocessingService(pb_utils, self.settings, tokenizer)

    def execute(self, requests):
        return self.service.respond(requests)

    def finalize(self):
        self.parent_watch.close()
