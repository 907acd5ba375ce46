"""The adapters' input checks: one clip per request, audio bytes to a waveform, log-mel shape.

Nothing here imports Triton or torch. Every refusal is a `RequestError`: the
tensors are what a client sent (the whisper model may be called directly).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np

from python_backend_lib.audio.decode import decode_audio, pcm_to_waveform
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.geometry import FRAMES_PER_SECOND, N_FRAMES, SAMPLE_RATE
from python_backend_lib.serving.parameters import InputFormat, RequestParameters

# How often a running request asks Triton whether its client has given up.
CANCELLATION_POLL_S = 0.25


def single_row(array: np.ndarray, tensor: str) -> np.ndarray:
    """The one row of a [1, ...] input; RequestError for any other batch size.

    Every model takes one clip per request: the server batches requests, so
    clients send clips as separate requests rather than as rows.
    """
    if array.ndim < 1 or array.shape[0] != 1:
        raise RequestError(
            f"{tensor} must hold exactly one clip (batch dimension 1), got shape {list(array.shape)}; "
            "send clips as separate requests, which the server batches"
        )
    return array[0]


def decode_request_audio(data: bytes, parameters: RequestParameters, max_seconds: float | None = None) -> np.ndarray:
    """The AUDIO bytes as Whisper's 16 kHz mono waveform, read as `input_format` says.

    Raises AudioError (a RequestError) for audio that cannot be used.
    """
    if parameters.input_format is InputFormat.PCM_F32LE:
        return pcm_to_waveform(
            data, parameters.sample_rate, channels=parameters.channels, max_seconds=max_seconds
        )
    return decode_audio(data, max_seconds=max_seconds)


def check_log_mel(log_mel: np.ndarray, audio_seconds: float, n_mels: int, max_audio_seconds: float) -> None:
    """RequestError unless LOG_MEL and AUDIO_SECONDS are what preprocessing writes
    (the whisper model may also be called directly).

    log_mel: [n_mels, frames]; audio_seconds: the audio's duration.
    """
    if log_mel.ndim != 2 or log_mel.shape[0] != n_mels:
        raise RequestError(f"LOG_MEL must be [{n_mels}, frames] for this checkpoint, got {list(log_mel.shape)}")
    if not (math.isfinite(audio_seconds) and 0 <= audio_seconds):
        raise RequestError(f"AUDIO_SECONDS must be a finite duration, got {audio_seconds}")
    if audio_seconds > max_audio_seconds:
        raise RequestError(f"audio is {audio_seconds:.1f} s long; the limit is {max_audio_seconds:g} s")
    if log_mel.shape[1] > N_FRAMES + math.ceil(audio_seconds * FRAMES_PER_SECOND) + 1:
        raise RequestError(
            f"LOG_MEL has {log_mel.shape[1]} frames, more than {audio_seconds:.2f} s of audio "
            f"and {N_FRAMES} frames of padding"
        )
    if not np.isfinite(log_mel).all():
        raise RequestError("LOG_MEL contains NaN or infinite values")


def exact_seconds(audio_seconds: float) -> float:
    """The duration that AUDIO_SECONDS stands for, as `len(waveform) / SAMPLE_RATE` in float64.

    AUDIO_SECONDS is float32 but always a whole number of samples, so the
    count is recovered exactly: float32 resolves half a sample up to 2**23
    samples (8.7 minutes), and to within a sample or two beyond.
    """
    return round(audio_seconds * SAMPLE_RATE) / SAMPLE_RATE


class CancellationProbe:
    """Asks Triton whether a request was cancelled, at most once per `interval_s`.

    The engine polls every running request between decoder steps; each real
    check is a round trip to tritonserver, so most polls reuse the last answer.
    """

    def __init__(self, is_cancelled: Callable[[], bool], interval_s: float = CANCELLATION_POLL_S) -> None:
        self._is_cancelled = is_cancelled
        self._interval_s = interval_s
        self._checked_at = -math.inf
        self._cancelled = False

    def __call__(self) -> bool:
        now = time.monotonic()
        if not self._cancelled and now - self._checked_at >= self._interval_s:
            self._checked_at = now
            self._cancelled = bool(self._is_cancelled())
        return self._cancelled
