"""What the Triton `preprocessing` model does with its requests: audio files to their log-mel.

`execute` (Triton's thread) checks every request's parameters and takes its
bytes; a pool of `decode_threads` threads decodes the files (libsndfile, soxr
and PyAV release the GIL). Once every file of one `execute` call is decoded, the
thread that finished last computes their log-mels together on the instance's
device (`LogMels`) and answers each request with LOG_MEL, without its padding
(`audio.features.without_padding`), and SAMPLES. A request that fails is
answered at once, alone; the others of its call are not held back by it.

With `vad_filter`, the decoding thread also runs Silero VAD (`audio.vad`, on the
CPU) and keeps only the speech, joined: LOG_MEL and SAMPLES are the speech's, and
SPEECH_SPANS and RECORDING_SAMPLES tell postprocessing where it lies in the recording.

Each request answered with its log-mel leaves its `RequestTiming` in `timings` (its decode, the call's
log-mels, its send), which `serving.preprocessing_metrics` publishes: the model answers
from its threads after `execute` returns, so Triton's own compute times miss that work.

Once no call has been in progress for a second, the instance gives the memory its
calls freed back to the system (`devices.host_memory.IdleRelease`): two-minute
waveforms and their spectra otherwise stay in glibc's heaps at their peak.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from python_backend_lib.audio.feature_graphs import FeatureGraphs
from python_backend_lib.audio.features import features_for_many, without_padding
from python_backend_lib.audio.vad import SpeechSpan, collect_speech, speech_timestamps
from python_backend_lib.contract import tensor_names
from python_backend_lib.contract.parameters import RequestParameters, parse_request_parameters
from python_backend_lib.core.errors import RequestError
from python_backend_lib.devices.host_memory import IdleRelease
from python_backend_lib.devices.placement import on_device, single_threaded_host
from python_backend_lib.devices.transfers import to_host_asleep, wait_idle
from python_backend_lib.serving.inputs import decode_request_audio, single_row
from python_backend_lib.serving.prometheus import unpublished
from python_backend_lib.serving.responses import error_response
from python_backend_lib.serving.settings import LogMelOutput, ModelSettings, log_mel_handover

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class RequestTiming:
    """Seconds of one request answered with its log-mel, from `execute` taking it (monotonic clock)."""

    decode: float  # until its file was decoded: the wait for a decoding thread, the decoding (and VAD)
    log_mel: float  # the log-mels of its `execute` call, from the call's last file decoded until they were ready
    send: float  # from the log-mels ready until its response was handed to Triton
    total: float  # from `execute` taking it until its response was handed to Triton


@dataclass(frozen=True)
class _Decoded:
    sender: Any
    waveform: np.ndarray  # what is transcribed: the recording, or its speech joined
    spans: tuple[SpeechSpan, ...]  # where `waveform` lies in the recording
    recording_samples: int
    decoded_at: float  # time.monotonic


def _decoded(sender: Any, recording: np.ndarray, parameters: RequestParameters) -> _Decoded:
    if parameters.vad is None:
        spans, transcribed = (SpeechSpan(0, len(recording)),), recording
    else:
        spans = tuple(speech_timestamps(recording, parameters.vad))
        # No speech at all: whisper still takes one sample, of digital silence, which it skips undecoded.
        transcribed = collect_speech(recording, list(spans)) if spans else np.zeros(1, np.float32)
    return _Decoded(sender, transcribed, spans, len(recording), time.monotonic())


class _Call:
    """The requests of one `execute` call while their files are decoded."""

    def __init__(self, requests: int) -> None:
        self.taken_at = time.monotonic()  # when `execute` took them
        self._left = requests
        self._decoded: list[_Decoded] = []
        self._lock = threading.Lock()

    def settle(self, decoded: _Decoded | None) -> list[_Decoded] | None:
        """One request is decoded (or failed: None); every decoded one once the last is."""
        with self._lock:
            if decoded is not None:
                self._decoded.append(decoded)
            self._left -= 1
            return self._decoded if self._left == 0 else None


class LogMels:
    """Log-mels on one device, several recordings at a time: on a GPU, captured replays
    of up to 16 clips of up to 30 s (`audio.feature_graphs`), handed on as GPU tensors or
    copied to the host (`LogMelOutput`); on the CPU, one batched pass."""

    def __init__(self, n_mels: int, device: str | torch.device, output: LogMelOutput | None) -> None:
        """output: the `log_mel_output` setting; None: "auto", for the GPUs this server sees."""
        self.n_mels, self.device = n_mels, torch.device(device)
        self.output = LogMelOutput.HOST
        if self.device.type == "cuda":
            gpus = torch.cuda.device_count()
            self.output = log_mel_handover(output, gpus)
            if self.output is LogMelOutput.DEVICE and gpus > 1:
                log.warning(
                    "log_mel_output 'device' on a server of %d GPUs: a LOG_MEL handed to a whisper instance "
                    "on another GPU can leave that instance idle for good (docs/reliability.md); 'auto' avoids it",
                    gpus,
                )
        self.graphs: FeatureGraphs | None = None
        if self.device.type == "cuda":
            self.graphs = FeatureGraphs(n_mels, self.device)
            self.graphs.capture()

    def __call__(self, waveforms: list[np.ndarray]) -> list[np.ndarray | torch.Tensor]:
        """Each waveform's LOG_MEL [n_mels, frames]: a host array, or a tensor on the GPU,
        ready to send (the device has finished writing it)."""
        with on_device(self.device):
            if self.graphs is not None:
                features = self.graphs.features(waveforms)
            else:
                features = features_for_many(waveforms, self.n_mels, self.device)
            trimmed = [without_padding(f, len(w)) for f, w in zip(features, waveforms)]
            if self.device.type != "cuda":
                return [t.numpy() for t in trimmed]
            if self.output is LogMelOutput.DEVICE:
                ready = [t.contiguous() for t in trimmed]
                wait_idle(self.device)
                return ready
            # One copy to the host for the whole call, then a view per recording.
            host = to_host_asleep(torch.cat([t.reshape(-1) for t in trimmed]))
            parts = np.split(host, np.cumsum([t.numel() for t in trimmed])[:-1])
            return [part.reshape(t.shape) for part, t in zip(parts, trimmed)]


class PreprocessingService:
    """The preprocessing model's requests: decode them, compute their log-mels, answer each once."""

    def __init__(self, pb_utils: Any, settings: ModelSettings, log_mels: LogMels) -> None:
        self.pb_utils = pb_utils
        self.settings = settings
        self.log_mels = log_mels
        self.decoders = ThreadPoolExecutor(settings.thread_count(), thread_name_prefix="decode-audio")
        self.idle_release = IdleRelease()
        self.timings: collections.deque[RequestTiming] = unpublished()
        single_threaded_host()

    def start(self, requests: list[Any]) -> None:
        """Take every request of one `execute` call; the answers come from the decoding threads."""
        if not requests:
            return
        call = _Call(len(requests))
        self.idle_release.begin()  # ended once the call's last request is answered (`_answer`)
        for request in requests:
            sender = request.get_response_sender()
            try:
                parameters = parse_request_parameters(request.parameters())
                if parameters.cancel is not None:
                    raise RequestError(
                        f"a cancel request goes to the {tensor_names.WHISPER_NAME!r} model, which holds "
                        "the requests it cancels"
                    )
                audio = self.pb_utils.get_input_tensor_by_name(request, tensor_names.AUDIO)
                (data,) = single_row(audio.as_numpy(), tensor_names.AUDIO)  # [1] bytes, read before execute returns
            except Exception as error:
                self._fail(sender, error)
                self._answer(call, call.settle(None))
                continue
            self.decoders.submit(self._decode, call, sender, data, parameters)

    def _decode(self, call: _Call, sender: Any, data: bytes, parameters: RequestParameters) -> None:
        decoded = None
        try:
            waveform = decode_request_audio(data, parameters, max_seconds=self.settings.max_audio_seconds)
            decoded = _decoded(sender, waveform, parameters)
        except Exception as error:
            self._fail(sender, error)
        self._answer(call, call.settle(decoded))

    def _answer(self, call: _Call, decoded: list[_Decoded] | None) -> None:
        """Every decoded request of a call, once the last is (None before): their log-mels together."""
        if decoded is None:
            return
        try:
            self._send_log_mels(call, decoded)
        finally:
            self.idle_release.end()

    def _send_log_mels(self, call: _Call, decoded: list[_Decoded]) -> None:
        if not decoded:  # every request of the call failed, and was answered
            return
        started = max(d.decoded_at for d in decoded)
        try:
            log_mels = self.log_mels([d.waveform for d in decoded])
        except Exception as error:  # ours: every request of the call gets the error
            for d in decoded:
                self._fail(d.sender, error)
            return
        ready = time.monotonic()
        for d, log_mel in zip(decoded, log_mels):
            try:
                response = self.pb_utils.InferenceResponse(output_tensors=[
                    _output(self.pb_utils, tensor_names.LOG_MEL, log_mel),
                    self.pb_utils.Tensor(tensor_names.SAMPLES, np.array([[len(d.waveform)]], dtype=np.int64)),
                    self.pb_utils.Tensor(tensor_names.SPEECH_SPANS, _spans_tensor(d.spans)),
                    self.pb_utils.Tensor(tensor_names.RECORDING_SAMPLES,
                                         np.array([[d.recording_samples]], dtype=np.int64)),
                ])  # fmt: skip
            except Exception as error:
                response = error_response(self.pb_utils, error)
            d.sender.send(response, flags=self.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            sent = time.monotonic()
            self.timings.append(RequestTiming(d.decoded_at - call.taken_at, ready - started, sent - ready,
                                              sent - call.taken_at))

    def _fail(self, sender: Any, error: BaseException) -> None:
        sender.send(error_response(self.pb_utils, error), flags=self.pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def close(self) -> None:
        self.decoders.shutdown(wait=True)
        self.idle_release.close()


def _spans_tensor(spans: tuple[SpeechSpan, ...]) -> np.ndarray:
    """SPEECH_SPANS with the batch dimension of one request: [1, spans, 2]."""
    return np.array([[span.start, span.end] for span in spans], dtype=np.int64).reshape(1, len(spans), 2)


def _output(pb_utils: Any, name: str, log_mel: np.ndarray | torch.Tensor) -> Any:
    """LOG_MEL with the batch dimension of one request: a host array, or a GPU tensor through DLPack."""
    if isinstance(log_mel, torch.Tensor):
        # torch exports a CUDA tensor only from its own device, and this thread may start on
        # another (a decoding thread of an instance on a host's second GPU).
        with on_device(log_mel.device):
            return pb_utils.Tensor.from_dlpack(name, log_mel[None])
    return pb_utils.Tensor(name, np.ascontiguousarray(log_mel[None]))
