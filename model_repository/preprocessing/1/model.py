"""Triton model `preprocessing`: AUDIO (a file, or raw PCM) -> LOG_MEL and SAMPLES.

Every request parameter is checked here, so a bad request fails before any
audio is decoded. Files are decoded on a pool of threads; the log-mels of an
`execute` call are computed together on this instance's device (a GPU, or the
CPU on a host without one) and each request is answered from the decoding
threads (`serving.preprocessing_service`), whose timings it publishes as metrics
(`serving.preprocessing_metrics`).
"""

import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils

# Serving from a checkout without `pip install -e .`: the library sits beside the repository.
sys.path.append(str(Path(__file__).resolve().parents[3]))

from python_backend_lib.checkpoints.configs import load_config
from python_backend_lib.serving.parent_watch import ParentWatch
from python_backend_lib.serving.preprocessing_metrics import PreprocessingMetrics
from python_backend_lib.serving.preprocessing_service import LogMels, PreprocessingService
from python_backend_lib.serving.settings import ModelSettings, device_label, instance_device


class TritonPythonModel:
    def initialize(self, args):
        # On a GPU this process holds GPU memory: end it with tritonserver (whisper's has the same watch).
        self.parent_watch = ParentWatch()
        self.settings = ModelSettings.from_triton(args["model_config"])
        n_mels = load_config(self.settings.checkpoint).dims.n_mels
        device = instance_device(args)
        log_mels = LogMels(n_mels, device, self.settings.log_mel_output)
        self.service = PreprocessingService(pb_utils, self.settings, log_mels)
        self.metrics = PreprocessingMetrics(
            pb_utils, self.service.timings, gpu=device_label(device), instance=args["model_instance_name"]
        )

    def execute(self, requests):
        self.service.start(requests)
        return None

    def finalize(self):
        self.service.close()
        self.metrics.close()
        self.parent_watch.close()
