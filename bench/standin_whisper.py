"""A stand-in for the Triton model `whisper`: answers every request at once, with no GPU work.

`bench.standin` copies this file over whisper/1/model.py in a generated copy
of the model repository, to measure what Triton and the Python backend carry
when the engine costs nothing (the served path's ceiling). It works as the real
model does: `execute` reads each request's inputs (every input its
config.pbtxt names, so it follows the real interface) and returns None, and
another thread answers each request through its response sender, here with a
canned verbose_json transcript (CANNED_NAME beside this file) so that
`postprocessing` does its real work.
"""

import json
import queue
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from python_backend_lib.serving import tensor_names

CANNED_NAME = "canned_verbose.json"
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.inputs = [tensor["name"] for tensor in config["input"]]
        outputs = [tensor["name"] for tensor in config["output"]]
        if outputs != [tensor_names.TRANSCRIPT]:
            raise ValueError(f"the stand-in answers {tensor_names.TRANSCRIPT} only; the config names {outputs}")
        document = (Path(__file__).resolve().parent / CANNED_NAME).read_bytes()
        self.transcript = np.array([[document]], dtype=np.object_)  # [1, 1] BYTES, as the real model sends it
        self.senders = queue.SimpleQueue()
        self.responder = threading.Thread(target=self._answer, name="stand-in-responder", daemon=True)
        self.responder.start()

    def execute(self, requests):
        for request in requests:
            for name in self.inputs:  # the inputs cross into this process as they do for the real model
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    tensor.as_numpy() if tensor.is_cpu() else tensor.to_dlpack()
            self.senders.put(request.get_response_sender())
        return None

    def _answer(self):
        while (sender := self.senders.get()) is not None:
            output = pb_utils.Tensor(tensor_names.TRANSCRIPT, self.transcript)
            sender.send(pb_utils.InferenceResponse(output_tensors=[output]), flags=FINAL)

    def finalize(self):
        self.senders.put(None)
        self.responder.join(timeout=10)
