"""What the Triton `whisper` model does with its requests, kept off the engine thread's path.

`execute` (Triton's thread) only checks each request, computes its log-mel on
the engine's device without waiting for the device, and hands it to the engine;
it returns at once, unless the engine is full and shares Triton's queue with
others (it then waits for room: `AdmissionPolicy`). The engine thread never
blocks on Triton either: it hands each finished transcript to a small pool of
responder threads, which write its TEXT, SEGMENTS and FORMATTED (the request's
response_format) and send them (a blocking round
trip to the Triton process, during which Python runs on). Cancellations are
learned in bulk on a thread of their own (`cancellation.CancellationWatcher`),
and the request limit is kept by a `RequestLedger`.
"""

from __future__ import annotations

import gc
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from python_backend_lib.core.errors import RequestError
from python_backend_lib.serving import tensor_names
from python_backend_lib.serving.admission import Entry, RequestLedger
from python_backend_lib.serving.cancellation import CancellationWatcher, Watch
from python_backend_lib.serving.inputs import NONFINITE, check_waveform, nonfinite, single_row
from python_backend_lib.serving.parameters import RequestParameters, parse_request_parameters
from python_backend_lib.serving.responses import error_response, transcript_response
from python_backend_lib.serving.settings import ModelSettings
from python_backend_lib.text.formats import Document

log = logging.getLogger(__name__)

# Threads that write and send answers. Each send waits for the Triton process,
# so a few keep answers flowing while the engine decodes; more would only
# contend for the GIL.
RESPONDER_THREADS = 4
# The whisper stub runs Triton's execute thread, the engine thread, the responders
# and two pollers in one interpreter. Python's default switch interval (5 ms) would
# let a responder hold the GIL for a whole decoder step while the engine waits.
GIL_SWITCH_INTERVAL_S = 0.0005


@dataclass(eq=False)
class _Request:
    """One admitted request, until it is answered."""

    sender: Any
    parameters: RequestParameters | None = None  # its options and response format, once parsed
    entry: Entry | None = None  # None: refused before admission
    watch: Watch | None = None


class WhisperService:
    """The whisper model's requests: start them, answer each exactly once."""

    def __init__(self, pb_utils: Any, settings: ModelSettings, pipeline: Any, engines: int = 1) -> None:
        """engines: instances of the model in all, which share Triton's queue (`engines_sharing_queue`)."""
        self.pb_utils = pb_utils
        self.settings = settings
        self.pipeline = pipeline
        on_gpu = pipeline.device.type == "cuda"
        self.admission = settings.admission(pipeline.engine.slots, on_gpu=on_gpu, engines=engines)
        self.ledger = RequestLedger(self.admission.limit)
        self.watcher = CancellationWatcher()
        self._responders = ThreadPoolExecutor(RESPONDER_THREADS, thread_name_prefix="whisper-respond")
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        # What loading made (the model, the tokenizer's tables) lives as long as the
        # process: frozen, the collector's full passes skip it and stay short.
        gc.freeze()

    def start(self, requests: list[Any]) -> None:
        """Start every request of one `execute` call; the answers come later.

        The requests' log-mels are computed together, in one pass on the engine's device.
        """
        checked: list[tuple[Any, _Request, np.ndarray]] = []
        for request in requests:
            pending = _Request(request.get_response_sender())
            try:
                pending.parameters = parse_request_parameters(request.parameters())
                tensor = self.pb_utils.get_input_tensor_by_name(request, tensor_names.WAVEFORM)
                waveform = single_row(tensor.as_numpy(), tensor_names.WAVEFORM)  # [samples]
                check_waveform(waveform, self.settings.max_audio_seconds)
                checked.append((request, pending, waveform))
            except Exception as error:
                self._finished(pending, error)
        broken = nonfinite([waveform for _, _, waveform in checked])
        deadline = time.monotonic() + self.admission.wait_s if self.admission.wait_s else None
        admitted: list[tuple[Any, _Request, np.ndarray]] = []
        for i, (request, pending, waveform) in enumerate(checked):
            try:
                if i in broken:
                    raise RequestError(NONFINITE)
                pending.entry = self.ledger.enter(deadline)  # Overloaded (UNAVAILABLE): no room by the deadline
                admitted.append((request, pending, waveform))
            except Exception as error:
                self._finished(pending, error)
        try:
            features = self.pipeline.features([waveform for _, _, waveform in admitted])
        except Exception as error:  # ours: every request of the call gets the error
            for _, pending, _ in admitted:
                self._finished(pending, error)
            return
        for (request, pending, waveform), request_features in zip(admitted, features):
            try:
                pending.watch = self.watcher.watch(request.is_cancelled)
                self.pipeline.start(
                    waveform,
                    pending.parameters.transcription,
                    on_done=lambda outcome, pending=pending: self._finished(pending, outcome),
                    is_cancelled=pending.watch.cancelled,
                    features=request_features,
                )  # RequestError at once for options that do not fit the checkpoint
            except Exception as error:
                self._finished(pending, error)

    def _finished(self, pending: _Request, outcome: Any) -> None:
        """The engine's callback (or execute's, for a refusal): answer on a responder thread."""
        self._responders.submit(self._answer, pending, outcome)

    def _answer(self, pending: _Request, outcome: Any) -> None:
        """The request's only response."""
        if pending.watch is not None:
            self.watcher.forget(pending.watch)
        try:
            response = self._response(pending.parameters, outcome)
        except Exception as error:  # a result that cannot be written still gets an answer
            outcome, response = error, error_response(self.pb_utils, error)
        self.ledger.leave(pending.entry, outcome)
        try:
            pending.sender.send(response, flags=self.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception:  # the client is gone, or Triton is stopping: nobody left to tell
            log.warning("could not send a response", exc_info=True)

    def _response(self, parameters: RequestParameters | None, outcome: Any) -> Any:
        if isinstance(outcome, BaseException):
            return error_response(self.pb_utils, outcome)
        document = Document.from_transcript(outcome, parameters.transcription)
        return transcript_response(self.pb_utils, document, parameters.response_format)

    def close(self) -> None:
        """Answer what is in flight, then stop the threads (Triton's `finalize`)."""
        self.pipeline.close()
        self._responders.shutdown(wait=True)
        self.watcher.close()
