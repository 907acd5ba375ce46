"""The adapters' input checks: one clip per request, audio bytes to a waveform, a waveform's sanity.

Nothing here imports Triton or torch. Every refusal is a `RequestError`: the
tensors are what a client sent (the whisper model may be called directly).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from python_backend_lib.audio.decode import decode_audio, pcm_to_waveform
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.geometry import SAMPLE_RATE
from python_backend_lib.serving.parameters import InputFormat, RequestParameters


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


def check_waveform(waveform: np.ndarray, max_audio_seconds: float) -> None:
    """RequestError unless WAVEFORM is what preprocessing writes (the whisper model
    may also be called directly): 16 kHz mono float32 samples, not too long.
    Whether the samples are finite is `nonfinite`'s to check, for many at once.
    """
    if waveform.ndim != 1 or waveform.dtype != np.float32:
        raise RequestError(
            f"WAVEFORM must be 16 kHz mono float32 samples [samples], got {waveform.dtype} {list(waveform.shape)}"
        )
    if waveform.size == 0:
        raise RequestError("WAVEFORM is empty")
    seconds = waveform.size / SAMPLE_RATE
    if seconds > max_audio_seconds:
        raise RequestError(f"audio is {seconds:.1f} s long; the limit is {max_audio_seconds:g} s")


NONFINITE = "WAVEFORM contains NaN or infinite values"


def nonfinite(waveforms: Sequence[np.ndarray]) -> set[int]:
    """Indexes of the waveforms that hold NaN or infinite samples.

    A waveform's sum of squares is finite when every sample is: one BLAS pass
    that allocates nothing, a third of the time of `sum` (`execute` checks
    hundreds of waveforms a second). Only a waveform whose sum is not finite,
    which huge finite samples can also cause, is scanned sample by sample.
    """
    with np.errstate(over="ignore", invalid="ignore"):  # an overflowing sum is expected, and checked
        return {i for i, w in enumerate(waveforms) if not math.isfinite(np.dot(w, w)) and not np.isfinite(w).all()}
