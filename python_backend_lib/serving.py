"""What the Triton `model.py` adapters share: their settings, and how a failure becomes an error.

Nothing here imports Triton or torch (audio decoding imports torch when called),
so it is tested without a server.
"""

from __future__ import annotations

import enum
import json
import math
import os
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any

import numpy as np

from python_backend_lib.parameters import InputFormat, RequestParameters

# Overrides every model's `checkpoint` parameter; `whisper-triton serve --checkpoint` sets it.
CHECKPOINT_ENV = "WHISPER_TRITON_CHECKPOINT"
DEFAULT_CHECKPOINT = "default"  # the packaged tiny.en
# The `parameters { key: ... }` a model's config.pbtxt may set.
CONFIG_PARAMETERS = ("checkpoint",)
# How often a running request asks Triton whether its client has given up.
CANCELLATION_POLL_S = 0.25


@dataclass(frozen=True)
class ModelSettings:
    """A model's config.pbtxt, as the adapters need it.

    name: the model's name in the repository.
    max_batch_size: rows a request may carry at most.
    checkpoint: the Whisper checkpoint source (see `weights.load_config`).
    """

    name: str
    max_batch_size: int
    checkpoint: str

    @classmethod
    def from_triton(cls, model_config: str, environ: Mapping[str, str] = os.environ) -> ModelSettings:
        """Parse `args["model_config"]`; ValueError for a config the adapters cannot serve."""
        config = json.loads(model_config)
        name = config.get("name", "?")
        max_batch_size = int(config.get("max_batch_size", 0))
        if max_batch_size < 1:
            raise ValueError(f"model {name!r}: max_batch_size must be at least 1, got {max_batch_size}")
        parameters = config.get("parameters", {})
        unknown = sorted(set(parameters) - set(CONFIG_PARAMETERS))
        if unknown:
            raise ValueError(
                f"model {name!r}: unknown config parameter(s) {unknown}; known: {list(CONFIG_PARAMETERS)}"
            )
        configured = parameters.get("checkpoint", {}).get("string_value", "") or DEFAULT_CHECKPOINT
        checkpoint = environ.get(CHECKPOINT_ENV) or configured
        return cls(name=name, max_batch_size=max_batch_size, checkpoint=checkpoint)


def single_row(array: np.ndarray, tensor: str) -> np.ndarray:
    """The one row of a [1, ...] input; ValueError for any other batch size.

    Every model takes one clip per request: the server batches requests, so
    clients send clips as separate requests rather than as rows.
    """
    if array.ndim < 1 or array.shape[0] != 1:
        raise ValueError(
            f"{tensor} must hold exactly one clip (batch dimension 1), got shape {list(array.shape)}; "
            "send clips as separate requests, which the server batches"
        )
    return array[0]


class Fault(enum.Enum):
    """Whose a failed request's error is; decides its Triton error code."""

    CLIENT = "client"  # bad audio, bad parameters, bad tensors: INVALID_ARG
    CANCELLED = "cancelled"  # the client went away: CANCELLED
    SERVER = "server"  # ours: INTERNAL, and logged with its traceback


def describe_failure(error: BaseException) -> tuple[str, Fault]:
    """(message for the client, whose fault): never a traceback for the client."""
    if isinstance(error, ValueError):
        return str(error), Fault.CLIENT
    if isinstance(error, CancelledError):
        return f"cancelled: {error}", Fault.CANCELLED
    return f"internal error: {type(error).__name__}: {error}", Fault.SERVER


def error_response(pb_utils: Any, error: BaseException) -> Any:
    """An `InferenceResponse` carrying only `error`, with the code its `Fault` calls for.

    pb_utils: the `triton_python_backend_utils` module (only importable inside Triton).
    """
    message, fault = describe_failure(error)
    codes = {
        Fault.CLIENT: pb_utils.TritonError.INVALID_ARG,
        Fault.CANCELLED: pb_utils.TritonError.CANCELLED,
        Fault.SERVER: pb_utils.TritonError.INTERNAL,
    }
    if fault is Fault.SERVER:
        pb_utils.Logger.log_error(f"{message}\n{''.join(traceback.format_exception(error))}")
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, codes[fault]))


def decode_request_audio(data: bytes, parameters: RequestParameters, max_seconds: float | None = None) -> np.ndarray:
    """The AUDIO bytes as Whisper's 16 kHz mono waveform, read as `input_format` says.

    Raises audio.AudioError (a ValueError) for audio that cannot be used.
    """
    from python_backend_lib import audio  # torch: only where audio is decoded

    if parameters.input_format is InputFormat.PCM_F32LE:
        return audio.pcm_to_waveform(
            data, parameters.sample_rate, channels=parameters.channels, max_seconds=max_seconds
        )
    return audio.decode_audio(data, max_seconds=max_seconds)



def exact_seconds(audio_seconds: float) -> float:
    """The duration that AUDIO_SECONDS stands for, as `len(waveform) / SAMPLE_RATE` in float64.

    AUDIO_SECONDS is float32 but always a whole number of samples, so the
    count is recovered exactly: float32 resolves half a sample up to 2**23
    samples (8.7 minutes), and to within a sample or two beyond.
    """
    from python_backend_lib.audio import SAMPLE_RATE

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
