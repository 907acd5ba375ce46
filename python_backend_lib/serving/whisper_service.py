"""What the Triton `whisper` model does with its requests, kept off the engine thread's path.

`execute` (Triton's thread) only checks each request, copies its log-mel to the
engine's device without waiting for the device (the host inputs of a call in
one copy; a GPU input on a stream of its own, waited for, since Triton frees it
when `execute` returns) and hands it to the engine; it returns at once, unless
the engine is full and shares Triton's queue with others (it then waits for
room: `AdmissionPolicy`). The engine thread never blocks on Triton either: it
hands each finished `DecodedRecording` to a small pool of responder threads,
which write it as numeric tensors (`decoded_tensors`) and send them (a blocking
round trip to the Triton process, during which Python runs on); the text is
the `postprocessing` model's. Cancellations are learned in bulk on a thread of
their own (`cancellation.CancellationWatcher`), and the request limit is kept
by a `RequestLedger`. A request whose parameters hold only `cancel` is no
recording: its id goes on the server's `CancelBoard`, and it is answered at once
with no outputs.

Decoupled (the `whisper_stream` model of the streamed path, `settings.decoupled`),
a request is also answered while it is decoded: each time the window in progress
ends a segment and each time more windows are settled (`LongFormJob`'s progress),
a response with the record so far, then the whole record (or the error) with the
final flag, always last. Every response
carries SAMPLES too, and vad_filter's SPEECH_SPANS and RECORDING_SAMPLES when
they came, since an ensemble hands the next step only tensors of the same
response. Each response holds everything so far, not only what is new, so that
a response overtaken on its way (postprocessing runs several instances) loses
nothing.
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from python_backend_lib.contract import tensor_names
from python_backend_lib.contract.decoded_tensors import to_tensors
from python_backend_lib.contract.parameters import RequestParameters, parse_request_parameters
from python_backend_lib.core.decoded import DecodedRecording
from python_backend_lib.core.errors import RequestError, ServerUnavailable
from python_backend_lib.devices.placement import single_threaded_host
from python_backend_lib.devices.transfers import through_pinned
from python_backend_lib.serving.admission import Entry, RequestLedger
from python_backend_lib.serving.cancellation import CancelBoard, CancellationWatcher, Watch, board_folder
from python_backend_lib.serving.inputs import LogMelInput, check_log_mel, nonfinite
from python_backend_lib.serving.prometheus import unpublished
from python_backend_lib.serving.responses import error_response, tensors_response
from python_backend_lib.serving.settings import (
    ModelSettings,
    device_label,
)
from python_backend_lib.serving.stall_watch import (
    Beat,
    EngineStalled,
    StallWatch,
    kernel_waits,
    stall_bound_s,
    thread_stacks,
    where,
)

log = logging.getLogger(__name__)

# Threads that write and send answers. Each send waits for the Triton process,
# so a few keep answers flowing while the engine decodes; more would only
# contend for the GIL.
RESPONDER_THREADS = 4
# The whisper stub runs Triton's execute thread, the engine thread, the responders
# and two pollers in one interpreter. Python's default switch interval (5 ms) would
# let a responder hold the GIL for a whole decoder step while the engine waits.
GIL_SWITCH_INTERVAL_S = 0.0005
# A stall answers each held request on the watch's thread; a responder stuck inside
# Triton's send may hold a request's lock: it is skipped after this long.
STALL_SEND_WAIT_S = 5.0


@dataclass(eq=False)
class _Request:
    """One admitted request, until it is answered."""

    sender: Any
    samples: int = 0  # the recording's length, sent with every response when decoupled
    passed_on: dict[str, np.ndarray] = field(default_factory=dict)  # decoupled: inputs every response repeats
    entry: Entry | None = None  # None: refused before admission
    watch: Watch | None = None
    # Decoupled: the responses' order: what went already (`sent`), and whether the final one did.
    sending: threading.Lock = field(default_factory=threading.Lock)
    sent: tuple[int, int] = (0, 0)  # decoupled: the windows and the last one's tokens last sent
    closed: bool = False
    outcome_at: float | None = None  # time.monotonic() when its result (or error) was handed to the responders


@dataclass(eq=False)
class _Checked:
    """A request whose inputs passed the checks, before admission."""

    request: Any
    pending: _Request
    parameters: RequestParameters
    log_mel: LogMelInput


class WhisperService:
    """The whisper model's requests: start them, answer each exactly once."""

    def __init__(
        self,
        pb_utils: Any,
        settings: ModelSettings,
        pipeline: Any,
        engines: int = 1,
        board: CancelBoard | None = None,
        instance: str = "whisper",
    ) -> None:
        """engines: instances of the model in all, which share Triton's queue (`engines_sharing_queue`).
        board: where cancels by request id are posted; default: the board of the
        tritonserver that started this process, shared by its whisper instances.
        instance: Triton's name for this instance, which a stall's error names."""
        self.pb_utils = pb_utils
        self.settings = settings
        self.pipeline = pipeline
        on_gpu = pipeline.device.type == "cuda"
        self.admission = settings.admission(pipeline.engine.slots, on_gpu=on_gpu, engines=engines)
        self.ledger = RequestLedger(self.admission.limit)
        self.board = board or CancelBoard(board_folder(os.getppid()))
        self.watcher = CancellationWatcher(self.board, on_stopping=self._stopping)
        self._responders = ThreadPoolExecutor(RESPONDER_THREADS, thread_name_prefix="whisper-respond")
        self.instance = f"{instance} on {device_label(pipeline.device)}"
        # What the stall watch reads: requests admitted and not answered, execute calls in
        # progress, answers sent (with the engine's loop turns, its signs of progress).
        self._held: dict[_Request, None] = {}
        self._held_lock = threading.Lock()
        self._executing = 0
        self._sent = 0
        # Seconds from each request's outcome to its final response handed to Triton (a
        # responder's wait, the outputs written, the send), for a metrics reader to drain.
        self.answer_times: collections.deque[float] = unpublished()
        # GPU inputs are copied on a stream of their own and waited for there, not behind the engine's steps.
        self._copies = torch.cuda.Stream(pipeline.device) if on_gpu else None
        if on_gpu:
            single_threaded_host()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        # What loading made (the model, the tokenizer's tables) lives as long as the
        # process: frozen, the collector's full passes skip it and stay short.
        gc.freeze()
        self.stall_watch = StallWatch(self._beat, self._stalled, stall_bound_s(on_gpu, settings.stall_timeout_s))

    def start(self, requests: list[Any]) -> None:
        """Start every request of one `execute` call; the answers come later."""
        with self._held_lock:
            self._executing += 1
        try:
            self._start(requests)
        finally:
            with self._held_lock:
                self._executing -= 1

    def _start(self, requests: list[Any]) -> None:
        checked: list[_Checked] = []
        for request in requests:
            pending = _Request(request.get_response_sender())
            try:
                parameters = parse_request_parameters(request.parameters())
                if parameters.cancel is not None:
                    self.watcher.post(parameters.cancel)
                    self._responders.submit(self._send, pending, self.pb_utils.InferenceResponse(output_tensors=[]))
                    continue
                log_mel = check_log_mel(self.pb_utils, request, self.pipeline.n_mels, self.settings.max_audio_seconds)
                checked.append(_Checked(request, pending, parameters, log_mel))
            except Exception as error:
                self._finished(pending, error)
        broken = nonfinite([c.log_mel.host for c in checked])
        deadline = time.monotonic() + self.admission.wait_s if self.admission.wait_s else None
        admitted: list[_Checked] = []
        for i, item in enumerate(checked):
            try:
                if i in broken:
                    raise RequestError(f"{tensor_names.LOG_MEL} contains NaN or infinite values")
                item.pending.entry = self.ledger.enter(deadline)  # Overloaded (UNAVAILABLE): no room by the deadline
                with self._held_lock:
                    self._held[item.pending] = None
                admitted.append(item)
            except Exception as error:
                self._finished(item.pending, error)
        try:
            features = self._on_device([item.log_mel for item in admitted])
        except Exception as error:  # ours: every request of the call gets the error
            for item in admitted:
                self._finished(item.pending, error)
            return
        with self.pipeline.engine.together():  # the call's requests encode in one pass
            self._start_each(admitted, features)

    def _start_each(self, admitted: list[_Checked], features: list[torch.Tensor]) -> None:
        for item, log_mel in zip(admitted, features):
            try:
                item.pending.watch = self.watcher.watch(item.request.is_cancelled, item.parameters.request_id)
                item.pending.samples = item.log_mel.samples
                if self.settings.decoupled:
                    item.pending.passed_on = self._passed_on(item.request)
                progress = partial(self._progressed, item.pending) if self.settings.decoupled else None
                self.pipeline.start(
                    log_mel,
                    item.log_mel.samples,
                    item.parameters.transcription,
                    on_done=lambda outcome, pending=item.pending: self._finished(pending, outcome),
                    is_cancelled=item.pending.watch.cancelled,
                    on_progress=progress,
                )  # RequestError at once for options that do not fit the checkpoint
            except Exception as error:
                self._finished(item.pending, error)

    def _on_device(self, inputs: list[LogMelInput]) -> list[torch.Tensor]:
        """Each request's LOG_MEL on the engine's device before `execute` returns (Triton
        frees its inputs then): the host ones end to end through one pinned copy, the
        GPU ones copied on a stream of their own and waited for there."""
        device = self.pipeline.device
        results: list[torch.Tensor | None] = [None] * len(inputs)
        on_host = [i for i, item in enumerate(inputs) if item.host is not None]
        if on_host:
            arrays = [inputs[i].host.reshape(-1) for i in on_host]
            if device.type == "cuda":
                total = (sum(a.size for a in arrays),)
                flat = through_pinned(total, lambda out: np.concatenate(arrays, out=out), device)
            else:
                flat = torch.from_numpy(np.concatenate(arrays))
            for i, part in zip(on_host, flat.split([a.size for a in arrays])):
                results[i] = part.view(inputs[i].host.shape)
        on_gpu = [i for i in range(len(inputs)) if results[i] is None]
        if on_gpu:
            engine_stream = torch.cuda.default_stream(device)
            with torch.cuda.stream(self._copies):
                for i in on_gpu:
                    results[i] = torch.from_dlpack(inputs[i].gpu.to_dlpack())[0].to(device, copy=True)
                    results[i].record_stream(engine_stream)  # the engine reads it there: not reused before
            self._copies.synchronize()
        return results

    def _finished(self, pending: _Request, outcome: Any) -> None:
        """The engine's callback (or execute's, for a refusal): answer on a responder thread."""
        pending.outcome_at = time.monotonic()
        self._responders.submit(self._answer, pending, outcome)

    def _progressed(self, pending: _Request, record: DecodedRecording) -> None:
        """Decoupled: the engine's report of the windows settled so far; sent on a responder thread."""
        self._responders.submit(self._send_progress, pending, record)

    def _send_progress(self, pending: _Request, record: DecodedRecording) -> None:
        """A response with the record so far, unless a later one (or the final one) went first:
        later means more windows, or more tokens in the last one (a segment in progress)."""
        progress = (len(record.windows), len(record.windows[-1].tokens) if record.windows else 0)
        with pending.sending:
            if pending.closed or progress <= pending.sent:
                return
            try:
                response = tensors_response(self.pb_utils, self._outputs(pending, record))
                pending.sender.send(response, flags=0)
                pending.sent = progress
            except Exception:  # the final response still comes, and says what failed
                log.warning("could not send a partial response", exc_info=True)

    def _passed_on(self, request: Any) -> dict[str, np.ndarray]:
        """The optional inputs a decoupled response repeats for postprocessing: vad_filter's,
        without the request's batch dimension, as the other outputs are written."""
        arrays = {}
        for name in (tensor_names.SPEECH_SPANS, tensor_names.RECORDING_SAMPLES):
            tensor = self.pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                arrays[name] = tensor.as_numpy()[0]
        return arrays

    def _outputs(self, pending: _Request, record: DecodedRecording) -> dict[str, np.ndarray]:
        arrays = to_tensors(record).by_name()
        if self.settings.decoupled:
            arrays[tensor_names.SAMPLES] = np.array([pending.samples], dtype=np.int64)
            arrays.update(pending.passed_on)
        return arrays

    def _answer(self, pending: _Request, outcome: Any, wait_s: float = -1) -> None:
        """The request's only response, or a decoupled request's final one (`_send`'s wait_s)."""
        if pending.watch is not None:
            self.watcher.forget(pending.watch)
        try:
            if isinstance(outcome, BaseException):
                response = error_response(self.pb_utils, outcome)
            else:
                response = tensors_response(self.pb_utils, self._outputs(pending, outcome))
        except Exception as error:  # a result that cannot be written still gets an answer
            outcome, response = error, error_response(self.pb_utils, error)
        self.ledger.leave(pending.entry, outcome)
        self._send(pending, response, wait_s)

    def _send(self, pending: _Request, response: Any, wait_s: float = -1) -> None:
        """The final response, once: a request answered already (by a stall) stays answered.
        wait_s: how long to wait for a partial response in progress (-1: as long as it takes)."""
        if not pending.sending.acquire(timeout=wait_s):  # after any partial response in progress
            log.warning("a response in progress did not finish in %.0f s: not answered again", wait_s)
            return
        try:
            if pending.closed:
                return
            pending.closed = True
            try:
                pending.sender.send(response, flags=self.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:  # the client is gone, or Triton is stopping: nobody left to tell
                log.warning("could not send a response", exc_info=True)
            if pending.outcome_at is not None:
                self.answer_times.append(time.monotonic() - pending.outcome_at)
        finally:
            pending.sending.release()
            with self._held_lock:
                self._held.pop(pending, None)
                self._sent += 1

    def _beat(self) -> Beat:
        with self._held_lock:
            return Beat(progress=self.pipeline.engine.turns + self._sent, held=len(self._held) + self._executing)

    def _stalled(self, seconds: float) -> None:
        """The stall watch's verdict: fail every held request, and refuse new ones from now on."""
        engine = self.pipeline.engine
        with self._held_lock:
            held = list(self._held)
        reason = (
            f"whisper instance {self.instance} made no progress for {seconds:.0f} s while holding "
            f"{len(held)} requests; its engine thread is at {where(engine.thread)}"
        )
        log.error("%s. Every thread's stack:\n%s\nThis process's threads in the kernel: %s\n"
                  "Its parent's (tritonserver, pid %d): %s", reason, thread_stacks(),
                  kernel_waits(os.getpid()), os.getppid(), kernel_waits(os.getppid()))
        engine.stall(reason)
        error = EngineStalled(f"{reason}. The instance refuses new requests; the server stops to be replaced")
        for pending in held:  # on this thread: the responders may be the ones stuck
            self._answer(pending, error, wait_s=STALL_SEND_WAIT_S)

    def _stopping(self) -> None:
        """The launcher's drain ran out: answer every held request now, and free its rows."""
        with self._held_lock:
            held = list(self._held)
        if held:
            log.warning("the server is stopping: %d requests held by %s get no transcript", len(held), self.instance)
        error = ServerUnavailable(
            "the server stopped before this request was transcribed (its drain ran out); retry on another server"
        )
        for pending in held:
            if pending.watch is not None:
                pending.watch.cancel()  # the engine drops its rows at the next step
            self._answer(pending, error)

    def close(self) -> None:
        """Answer what is in flight, then stop the threads (Triton's `finalize`)."""
        self.stall_watch.close()
        self.pipeline.close()
        self._responders.shutdown(wait=True)
        self.watcher.close()
