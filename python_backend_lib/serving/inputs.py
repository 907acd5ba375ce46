"""The adapters' input checks: one clip per request, audio bytes to a waveform, and
what `whisper` takes (a log-mel and its recording's length), checked as a client's.

Nothing here imports torch (`pb_utils` is passed in). Every refusal is a
`RequestError`: each model may be called directly, so its tensors are what a
client sent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from python_backend_lib.audio.decode import decode_audio, pcm_to_waveform
from python_backend_lib.audio.vad import SpeechSpan
from python_backend_lib.contract import tensor_names
from python_backend_lib.contract.parameters import InputFormat, RequestParameters
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.geometry import SAMPLE_RATE, padded_frames


def single_row(array: np.ndarray, tensor: str) -> np.ndarray:
    """The one row of a [1, ...] input; RequestError for any other batch size.

    Every model takes one clip per request: the server batches requests, so
    clients send clips as separate requests rather than as rows.
    """
    _one_row(list(array.shape), tensor)
    return array[0]


def _one_row(shape: list[int], tensor: str) -> None:
    if len(shape) < 1 or shape[0] != 1:
        raise RequestError(
            f"{tensor} must hold exactly one clip (batch dimension 1), got shape {shape}; "
            "send clips as separate requests, which the server batches"
        )


def decode_request_audio(data: bytes, parameters: RequestParameters, max_seconds: float | None = None) -> np.ndarray:
    """The AUDIO bytes as Whisper's 16 kHz mono waveform, read as `input_format` says.

    Raises AudioError (a RequestError) for audio that cannot be used.
    """
    if parameters.input_format is InputFormat.PCM_F32LE:
        return pcm_to_waveform(
            data, parameters.sample_rate, channels=parameters.channels, max_seconds=max_seconds
        )
    return decode_audio(data, max_seconds=max_seconds)


@dataclass(frozen=True)
class LogMelInput:
    """One request's LOG_MEL ([n_mels, frames]) and SAMPLES, checked. The log-mel came
    in host memory (`host`) or, from a GPU instance of `preprocessing`, in GPU memory
    (`gpu`, the `pb_utils.Tensor`, read through DLPack)."""

    samples: int
    host: np.ndarray | None = None
    gpu: Any = None


def read_samples(pb_utils: Any, request: Any, max_audio_seconds: float) -> int:
    """The request's SAMPLES: a recording of at least one sample and at most `max_audio_seconds`."""
    row = single_row(pb_utils.get_input_tensor_by_name(request, tensor_names.SAMPLES).as_numpy(), tensor_names.SAMPLES)
    if row.shape != (1,):
        raise RequestError(f"{tensor_names.SAMPLES} must have the shape [1, 1], got {[1, *row.shape]}")
    samples = int(row[0])
    if samples < 1:
        raise RequestError(f"{tensor_names.SAMPLES} must be at least 1, got {samples}")
    seconds = samples / SAMPLE_RATE
    if seconds > max_audio_seconds:
        raise RequestError(f"audio is {seconds:.1f} s long; the limit is {max_audio_seconds:g} s")
    return samples


@dataclass(frozen=True)
class SpeechTimeline:
    """Where the audio that was transcribed lies in the recording (`vad_filter`)."""

    spans: tuple[SpeechSpan, ...]
    recording_samples: int


def read_speech_timeline(pb_utils: Any, request: Any, samples: int) -> SpeechTimeline | None:
    """The request's SPEECH_SPANS and RECORDING_SAMPLES (both or neither): ordered spans
    inside the recording whose lengths add up to SAMPLES (none, when SAMPLES is the one
    sample that stands for a recording without speech). None: neither was sent."""
    spans_tensor = pb_utils.get_input_tensor_by_name(request, tensor_names.SPEECH_SPANS)
    length_tensor = pb_utils.get_input_tensor_by_name(request, tensor_names.RECORDING_SAMPLES)
    if spans_tensor is None and length_tensor is None:
        return None
    if spans_tensor is None or length_tensor is None:
        raise RequestError(f"{tensor_names.SPEECH_SPANS} and {tensor_names.RECORDING_SAMPLES} go together: send both")
    rows = single_row(spans_tensor.as_numpy(), tensor_names.SPEECH_SPANS)
    length = single_row(length_tensor.as_numpy(), tensor_names.RECORDING_SAMPLES)
    if rows.ndim != 2 or rows.shape[1] != 2 or length.shape != (1,):
        raise RequestError(
            f"{tensor_names.SPEECH_SPANS} must be [1, spans, 2] and {tensor_names.RECORDING_SAMPLES} [1, 1], "
            f"got {[1, *rows.shape]} and {[1, *length.shape]}"
        )
    recording = int(length[0])
    bounds = [int(v) for v in rows.reshape(-1)]
    ordered = all(a <= b for a, b in zip([0, *bounds], [*bounds, recording]))
    lengths = sum(end - start for start, end in zip(bounds[::2], bounds[1::2]))
    if not ordered or any(e <= s for s, e in zip(bounds[::2], bounds[1::2])) or lengths not in (samples, 0):
        raise RequestError(
            f"{tensor_names.SPEECH_SPANS} must be ordered, non-empty spans inside the {recording} samples of "
            f"{tensor_names.RECORDING_SAMPLES} whose lengths add up to {tensor_names.SAMPLES} {samples}"
        )
    return SpeechTimeline(tuple(SpeechSpan(s, e) for s, e in zip(bounds[::2], bounds[1::2])), recording)


def check_log_mel(pb_utils: Any, request: Any, n_mels: int, max_audio_seconds: float) -> LogMelInput:
    """The request's LOG_MEL and SAMPLES, as `preprocessing` writes them: SAMPLES as
    `read_samples` checks it; LOG_MEL float32 [n_mels, frames] with 1 to
    `padded_frames(samples)` frames. Whether it is finite is `nonfinite`'s to check."""
    samples = read_samples(pb_utils, request, max_audio_seconds)
    tensor = pb_utils.get_input_tensor_by_name(request, tensor_names.LOG_MEL)
    if tensor.is_cpu():
        host = single_row(tensor.as_numpy(), tensor_names.LOG_MEL)
        _check_shape(list(host.shape), str(host.dtype), n_mels, samples)
        return LogMelInput(samples, host=host)
    shape = list(tensor.shape())
    _one_row(shape, tensor_names.LOG_MEL)
    _check_shape(shape[1:], "float32", n_mels, samples)  # Triton checked the type against the config
    return LogMelInput(samples, gpu=tensor)


def _check_shape(shape: list[int], dtype: str, n_mels: int, samples: int) -> None:
    most = padded_frames(samples)
    if dtype != "float32" or len(shape) != 2 or shape[0] != n_mels or not 1 <= shape[1] <= most:
        raise RequestError(
            f"{tensor_names.LOG_MEL} must be float32 [{n_mels}, frames] with 1 to {most} frames for "
            f"{tensor_names.SAMPLES} {samples} (the log-mel preprocessing writes), got {dtype} {shape}"
        )


def nonfinite(log_mels: Sequence[np.ndarray | None]) -> set[int]:
    """Indexes of the host log-mels that hold NaN or infinite values (None: one on a GPU,
    which only `preprocessing` sends).

    A sum of squares is finite when every value is: one BLAS pass that allocates
    nothing, a third of the time of `sum` (`execute` checks hundreds of inputs a
    second). Only an input whose sum is not finite, which huge finite values can also
    cause, is scanned value by value.
    """
    found = set()
    with np.errstate(over="ignore", invalid="ignore"):  # an overflowing sum is expected, and checked
        for i, array in enumerate(log_mels):
            if array is None:
                continue
            flat = array.reshape(-1)
            if not math.isfinite(np.dot(flat, flat)) and not np.isfinite(flat).all():
                found.add(i)
    return found
