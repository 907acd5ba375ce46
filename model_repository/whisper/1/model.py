"""Triton model `whisper`: LOG_MEL and SAMPLES -> what decoding decided, on the library's engine.

`execute` only starts each request's decoding (window by window, as
`Pipeline.transcribe` does) and returns None; each request is answered later
through its response sender, once its last window is decoded, so requests join
and leave the running batch independently. The answer is numeric
(`contract.decoded_tensors`): the `postprocessing` model writes the text. Each
instance is one engine on the device Triton names (KIND_AUTO: a GPU, or the CPU
on a host without one); instances on one device split its KV memory or its cores.
"""

import os
import sys
from pathlib import Path

import triton_python_backend_utils as pb_utils

# Serving from a checkout without `pip install -e .`: the library sits beside the repository.
sys.path.append(str(Path(__file__).resolve().parents[3]))

from python_backend_lib.serving.metrics import WhisperMetrics
from python_backend_lib.serving.parent_watch import ParentWatch
from python_backend_lib.serving.settings import (
    ModelSettings,
    device_label,
    engines_on_device,
    engines_sharing_queue,
    instance_device,
)
from python_backend_lib.serving.whisper_pipeline import load_pipeline
from python_backend_lib.serving.whisper_service import WhisperService


class TritonPythonModel:
    def initialize(self, args):
        # Triton 2.51 leaves this model's process running when tritonserver dies: end it then.
        self.parent_watch = ParentWatch()
        self.settings = ModelSettings.from_triton(args["model_config"])
        device = instance_device(args)
        engines = engines_on_device(args["model_config"], device)
        pipeline = load_pipeline(self.settings, device=device, engines=engines)
        if pipeline.tokenizer is None:
            raise ValueError(f"checkpoint {self.settings.checkpoint!r} has no tokenizer.json")
        self.service = WhisperService(
            pb_utils, self.settings, pipeline, engines_sharing_queue(args["model_config"]),
            instance=args["model_instance_name"],
        )
        self.metrics = WhisperMetrics(
            pb_utils,
            pipeline.engine,
            self.service.ledger,
            self.service.stall_watch,
            self.service.answer_times,
            gpu=device_label(pipeline.device),
            instance=args["model_instance_name"],
            backend=pipeline.attention_backend.value,
        )
        pb_utils.Logger.log_info(
            f"whisper {args['model_instance_name']} (pid {os.getpid()}) serving {self.settings.checkpoint} "
            f"on {pipeline.device} "
            f"(one of {engines} engines there) "
            f"with {pipeline.attention_backend.value}, {self.settings.quantization.value} quantization, "
            f"{pipeline.engine.slots} slots; started in {pipeline.load_times.describe()}"
        )

    def execute(self, requests):
        self.service.start(requests)
        return None

    def finalize(self):
        self.service.close()
        self.metrics.close()
        self.parent_watch.close()
