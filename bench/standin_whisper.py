"""A stand-in for the Triton model `whisper`: answers every request at once, with no GPU work.

`bench.standin` copies this file over whisper/1/model.py in a generated copy
of the model repository, to measure what Triton and the Python backend carry
when the engine costs nothing (the served path's ceiling). It works as the real
model does: `execute` reads each request's inputs (every input its
config.pbtxt names, so it follows the real interface) and its parameters, and
returns None; another thread answers each request through its response
sender, with a canned decoded recording (CANNED_NAME beside this file, a real
one) as numeric tensors, as the real model's responders do; postprocessing then
writes its transcript.
"""

import json
import queue
import threading
from pathlib import Path

import triton_python_backend_utils as pb_utils

from python_backend_lib.contract import tensor_names
from python_backend_lib.contract.decoded_tensors import to_tensors
from python_backend_lib.contract.parameters import parse_request_parameters
from python_backend_lib.core.decoded import DecodedRecording
from python_backend_lib.serving.responses import error_response, tensors_response

CANNED_NAME = "canned_decoded.json"
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
OUTPUTS = [tensor_names.TOKENS, tensor_names.WINDOWS, tensor_names.ALIGNMENT, tensor_names.LANGUAGE,
           tensor_names.LANGUAGE_PROBABILITY]


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.inputs = [tensor["name"] for tensor in config["input"]]
        outputs = [tensor["name"] for tensor in config["output"]]
        if outputs != OUTPUTS:
            raise ValueError(f"the stand-in answers {OUTPUTS}; the config names {outputs}")
        recording = DecodedRecording.from_json((Path(__file__).resolve().parent / CANNED_NAME).read_text())
        self.answer = to_tensors(recording).by_name()
        self.senders = queue.SimpleQueue()
        self.responder = threading.Thread(target=self._answer, name="stand-in-responder", daemon=True)
        self.responder.start()

    def execute(self, requests):
        for request in requests:
            for name in self.inputs:  # the inputs cross into this process as they do for the real model
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    tensor.as_numpy() if tensor.is_cpu() else tensor.to_dlpack()
            self.senders.put((request.get_response_sender(), request.parameters()))
        return None

    def _answer(self):
        while (item := self.senders.get()) is not None:
            sender, parameters = item
            try:
                parse_request_parameters(parameters)  # as the real model checks them
                response = tensors_response(pb_utils, self.answer)
            except Exception as error:
                response = error_response(pb_utils, error)
            sender.send(response, flags=FINAL)

    def finalize(self):
        self.senders.put(None)
        self.responder.join(timeout=10)
