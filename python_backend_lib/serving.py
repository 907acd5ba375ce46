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

from python_backend_lib.admission import Overloaded
from python_backend_lib.parameters import InputFormat, RequestParameters

# Overrides every model's `checkpoint` parameter; `whisper-triton serve --checkpoint` sets it.
CHECKPOINT_ENV = "WHISPER_TRITON_CHECKPOINT"
DEFAULT_CHECKPOINT = "default"  # the packaged tiny.en
# The `parameters { key: ... }` a model's config.pbtxt may set (all string values there).
CONFIG_PARAMETERS = ("checkpoint", "max_audio_seconds", "max_queued_requests", "kv_slots", "kv_memory_fraction")
# Longer audio is refused, naming the limit: an hour of 16 kHz float32 is 230 MB.
DEFAULT_MAX_AUDIO_SECONDS = 3600.0
# Numeric parameters set to this (or left out) take the library's default.
AUTO = "auto"
# For tests only: the engine fails every decoder step holding a request with this
# prompt (`EngineOptions.fault_prompt`), to show that the failure stays with it.
FAULT_PROMPT_ENV = "WHISPER_TRITON_FAULT_PROMPT"
# How often a running request asks Triton whether its client has given up.
CANCELLATION_POLL_S = 0.25


@dataclass(frozen=True)
class ModelSettings:
    """A model's config.pbtxt, as the adapters need it.

    name: the model's name in the repository.
    max_batch_size: rows a request may carry at most.
    checkpoint: the Whisper checkpoint source (see `weights.load_config`).
    max_audio_seconds: longer audio is refused (INVALID_ARG naming the limit).
    max_queued_requests: requests the whisper model holds beyond its decoding
        slots before it refuses new ones (UNAVAILABLE); None: as many as the slots.
    kv_slots: windows decoded together (KV-cache slots); None: from free GPU
        memory, 16 on the CPU.
    kv_memory_fraction: share of the free GPU memory for the KV slots when
        `kv_slots` is None; None: the library's default.
    """

    name: str
    max_batch_size: int
    checkpoint: str
    max_audio_seconds: float = DEFAULT_MAX_AUDIO_SECONDS
    max_queued_requests: int | None = None
    kv_slots: int | None = None
    kv_memory_fraction: float | None = None

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
        values = {key: parameters[key].get("string_value", "").strip() for key in parameters}
        checkpoint = environ.get(CHECKPOINT_ENV) or values.get("checkpoint") or DEFAULT_CHECKPOINT

        def number(key: str, kind: type, low: float, high: float = math.inf) -> float | int | None:
            text = values.get(key, "")
            if text in ("", AUTO):
                return None
            try:
                value = kind(text)
            except ValueError:
                value = None
            if value is None or not low <= value <= high:
                bound = "" if high == math.inf else f" and at most {high:g}"
                raise ValueError(
                    f"model {name!r}: config parameter {key!r} must be {AUTO!r} or a{'n integer' if kind is int else ' number'}"
                    f" of at least {low:g}{bound}, got {text!r}"
                )
            return value

        max_audio_seconds = number("max_audio_seconds", float, 1.0)
        return cls(
            name=name,
            max_batch_size=max_batch_size,
            checkpoint=checkpoint,
            max_audio_seconds=DEFAULT_MAX_AUDIO_SECONDS if max_audio_seconds is None else max_audio_seconds,
            max_queued_requests=number("max_queued_requests", int, 0),
            kv_slots=number("kv_slots", int, 1),
            kv_memory_fraction=number("kv_memory_fraction", float, 0.01, 0.95),
        )

    def request_limit(self, slots: int) -> int:
        """Requests the whisper model holds at most: its decoding slots plus `max_queued_requests`."""
        return slots + (slots if self.max_queued_requests is None else self.max_queued_requests)


def load_pipeline(settings: ModelSettings, environ: Mapping[str, str] = os.environ) -> Any:
    """The whisper model's `Pipeline`, as its settings (and `FAULT_PROMPT_ENV`) ask.

    Raises pipeline.GpuMemoryError, saying what to change, when it does not fit on the GPU.
    """
    from python_backend_lib.engine import EngineOptions  # torch: only in the whisper model
    from python_backend_lib.pipeline import Pipeline

    fraction = {} if settings.kv_memory_fraction is None else {"kv_memory_fraction": settings.kv_memory_fraction}
    engine_options = EngineOptions(fault_prompt=environ.get(FAULT_PROMPT_ENV) or None)
    return Pipeline.load(settings.checkpoint, slots=settings.kv_slots, engine_options=engine_options, **fraction)


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
    OVERLOADED = "overloaded"  # too many requests in flight, retry later: UNAVAILABLE
    SERVER = "server"  # ours: INTERNAL, and logged with its traceback


def describe_failure(error: BaseException) -> tuple[str, Fault]:
    """(message for the client, whose fault): never a traceback for the client."""
    if isinstance(error, ValueError):
        return str(error), Fault.CLIENT
    if isinstance(error, CancelledError):
        return f"cancelled: {error}", Fault.CANCELLED
    if isinstance(error, Overloaded):
        return str(error), Fault.OVERLOADED
    return f"internal error: {type(error).__name__}: {error}", Fault.SERVER


def error_response(pb_utils: Any, error: BaseException) -> Any:
    """An `InferenceResponse` carrying only `error`, with the code its `Fault` calls for.

    pb_utils: the `triton_python_backend_utils` module (only importable inside Triton).
    """
    message, fault = describe_failure(error)
    codes = {
        Fault.CLIENT: pb_utils.TritonError.INVALID_ARG,
        Fault.CANCELLED: pb_utils.TritonError.CANCELLED,
        Fault.OVERLOADED: pb_utils.TritonError.UNAVAILABLE,
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


def check_log_mel(log_mel: np.ndarray, audio_seconds: float, n_mels: int, max_audio_seconds: float) -> None:
    """ValueError unless LOG_MEL and AUDIO_SECONDS are what preprocessing writes
    (the whisper model may also be called directly).

    log_mel: [n_mels, frames]; audio_seconds: the audio's duration.
    """
    from python_backend_lib.audio import FRAMES_PER_SECOND, N_FRAMES

    if log_mel.ndim != 2 or log_mel.shape[0] != n_mels:
        raise ValueError(f"LOG_MEL must be [{n_mels}, frames] for this checkpoint, got {list(log_mel.shape)}")
    if not (math.isfinite(audio_seconds) and 0 <= audio_seconds):
        raise ValueError(f"AUDIO_SECONDS must be a finite duration, got {audio_seconds}")
    if audio_seconds > max_audio_seconds:
        raise ValueError(f"audio is {audio_seconds:.1f} s long; the limit is {max_audio_seconds:g} s")
    if log_mel.shape[1] > N_FRAMES + math.ceil(audio_seconds * FRAMES_PER_SECOND) + 1:
        raise ValueError(
            f"LOG_MEL has {log_mel.shape[1]} frames, more than {audio_seconds:.2f} s of audio "
            f"and {N_FRAMES} frames of padding"
        )
    if not np.isfinite(log_mel).all():
        raise ValueError("LOG_MEL contains NaN or infinite values")


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
