"""Request parameters: the one place where a client's `parameters` become typed options.

Triton hands every model of the `transcribe` ensemble the same request
parameters as a JSON object (`request.parameters()`). Each model parses the
whole object here, so an unknown key or a value of the wrong type is rejected
by the first model that sees it, with a `RequestError` naming the key.

Types are those tritonclient sends: `bool`, `int`, `str` (and `float` for
`temperature`, `temperature_increment`, the three quality thresholds, `patience`
and `length_penalty`). Strings are never reinterpreted: `"true"` is not a bool.

Two keys name requests rather than shape them: `request_id`, the client's own
name for a request (a uuid4), and `cancel`, which turns a request to the
`whisper` model into a cancel of the request of that id (`serving.cancellation`:
Triton 2.51 does not pass a client's cancel into a running ensemble step).
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from python_backend_lib.audio.decode import MAX_CHANNELS, MAX_SAMPLE_RATE, MIN_SAMPLE_RATE
from python_backend_lib.audio.vad import VadOptions, vad_options_from_json
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.options import DecodingOptions, TranscribeOptions, choice
from python_backend_lib.text.formats import ResponseFormat

# Served requests decode with timestamp tokens unless they say otherwise, whatever
# their response format: openai-whisper always does, long audio is seeked by them,
# and text is better with them (docs/long-audio.md: WER 0.079 against 0.276 on the
# three-minute recording). `timestamps: false` remains for one-window clips.
DEFAULT_TIMESTAMPS = True
# A request id names a file of the cancel board's folder: no path, no dot first.
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
CANCEL_KEY = "cancel"


class InputFormat(str, enum.Enum):
    """How the bytes of the AUDIO tensor are to be read."""

    FILE = "file"  # an audio file in any format libsndfile reads (wav, flac, ogg, mp3)
    PCM_F32LE = "pcm_f32le"  # headerless little-endian float32 samples, interleaved channels


@dataclass(frozen=True)
class RequestParameters:
    """Everything one request asks for, checked.

    transcription: how to transcribe (long-form mode, fallback, word timestamps),
        and in `transcription.decoding` how to decode each window (language,
        task, timestamps, prompt, ...).
    response_format: the format of the FORMATTED output.
    input_format: how to read the AUDIO bytes.
    sample_rate: samples per second of raw PCM; None for files.
    channels: interleaved channels of raw PCM (mixed down to mono).
    request_id: the client's name for this request, by which a cancel request
        can stop it; None: it can be cancelled only as Triton allows.
    cancel: this is no transcription but a cancel of the request of this id
        (sent to the `whisper` model).
    vad: `vad_filter`: leave out what Silero VAD finds is not speech before
        decoding, with these options (`vad_parameters`); None: decode it all.
    """

    transcription: TranscribeOptions = field(
        default_factory=lambda: TranscribeOptions(decoding=DecodingOptions(timestamps=DEFAULT_TIMESTAMPS))
    )
    response_format: ResponseFormat = ResponseFormat.JSON
    input_format: InputFormat = InputFormat.FILE
    sample_rate: int | None = None
    channels: int = 1
    request_id: str | None = None
    cancel: str | None = None
    vad: VadOptions | None = None

    @property
    def decoding(self) -> DecodingOptions:
        return self.transcription.decoding


# Each documented key with the Python types it accepts (bool is never an int here).
_DECODING_KEYS: dict[str, tuple[type, ...]] = {
    "language": (str,),
    "task": (str,),
    "timestamps": (bool,),
    "prompt": (str,),
    "max_new_tokens": (int,),
    "temperature": (int, float),
    "min_new_tokens": (int,),
    "beam_size": (int,),
    "best_of": (int,),
    "patience": (int, float),
    "length_penalty": (int, float),
    "seed": (int,),
}
# Request key -> TranscribeOptions field.
_TRANSCRIBE_KEYS: dict[str, tuple[str, tuple[type, ...]]] = {
    "word_timestamps": ("word_timestamps", (bool,)),
    "long_form": ("mode", (str,)),
    "condition_on_previous_text": ("condition_on_previous_text", (bool,)),
    "temperature_increment": ("temperature_increment", (int, float)),
    "compression_ratio_threshold": ("compression_ratio_threshold", (int, float)),
    "logprob_threshold": ("logprob_threshold", (int, float)),
    "no_speech_threshold": ("no_speech_threshold", (int, float)),
    "hallucination_silence_threshold": ("hallucination_silence_threshold", (int, float)),
    "window_padding": ("window_padding", (str,)),
    "live": ("live", (bool,)),
}
# faster-whisper's names; vad_parameters is a JSON object of `audio.vad.VadOptions`
# fields, as Triton's request parameters hold no nested values.
_VAD_KEYS: dict[str, tuple[type, ...]] = {
    "vad_filter": (bool,),
    "vad_parameters": (str,),
}
_OUTPUT_KEYS: dict[str, tuple[type, ...]] = {
    "response_format": (str,),
}
_INPUT_KEYS: dict[str, tuple[type, ...]] = {
    "input_format": (str,),
    "sample_rate": (int,),
    "channels": (int,),
}
_NAMING_KEYS: dict[str, tuple[type, ...]] = {
    "request_id": (str,),
    CANCEL_KEY: (str,),
}
PARAMETER_TYPES: Mapping[str, tuple[type, ...]] = {
    **_DECODING_KEYS,
    **{key: types for key, (_, types) in _TRANSCRIBE_KEYS.items()},
    **_VAD_KEYS,
    **_OUTPUT_KEYS,
    **_INPUT_KEYS,
    **_NAMING_KEYS,
}


def parse_request_parameters(raw: str | Mapping[str, Any] | None) -> RequestParameters:
    """Parse `request.parameters()` (a JSON object, or an already decoded mapping).

    Raises RequestError naming the offending key for an unknown key, a value of
    the wrong type, or a value out of range.
    """
    values = _as_mapping(raw)
    for key, value in values.items():
        if key not in PARAMETER_TYPES:
            raise RequestError(
                f"unknown request parameter {key!r}; known parameters: {', '.join(PARAMETER_TYPES)}"
            )
        _check_type(key, value, PARAMETER_TYPES[key])

    response_format = choice(
        ResponseFormat, values.get("response_format", ResponseFormat.JSON), "request parameter 'response_format'"
    )
    decoding_values = {key: values[key] for key in _DECODING_KEYS if key in values}
    decoding_values.setdefault("timestamps", DEFAULT_TIMESTAMPS)
    transcription = TranscribeOptions(
        decoding=DecodingOptions(**decoding_values),
        **{field_name: values[key] for key, (field_name, _) in _TRANSCRIBE_KEYS.items() if key in values},
    )
    input_format = choice(InputFormat, values.get("input_format", InputFormat.FILE), "request parameter 'input_format'")
    sample_rate = values.get("sample_rate")
    channels = values.get("channels", 1)
    if input_format is InputFormat.FILE:
        for key in ("sample_rate", "channels"):
            if key in values:
                raise RequestError(
                    f"request parameter {key!r} applies only to input_format "
                    f"{InputFormat.PCM_F32LE.value!r}; a file carries its own"
                )
    else:
        if sample_rate is None:
            raise RequestError(
                f"request parameter 'sample_rate' is required with input_format {input_format.value!r}"
            )
        if not MIN_SAMPLE_RATE <= sample_rate <= MAX_SAMPLE_RATE:
            raise RequestError(
                f"request parameter 'sample_rate' must be from {MIN_SAMPLE_RATE} to "
                f"{MAX_SAMPLE_RATE} Hz, got {sample_rate}"
            )
        if not 1 <= channels <= MAX_CHANNELS:
            raise RequestError(
                f"request parameter 'channels' must be from 1 to {MAX_CHANNELS}, got {channels}"
            )
    for key in _NAMING_KEYS:
        if key in values and not REQUEST_ID_PATTERN.fullmatch(values[key]):
            raise RequestError(
                f"request parameter {key!r} must be 1 to 128 letters, digits, '_', '.' or '-' "
                f"(a uuid4 will do), got {values[key]!r}"
            )
    if "vad_parameters" in values and not values.get("vad_filter", False):
        raise RequestError("request parameter 'vad_parameters' applies only with 'vad_filter': true")
    vad = vad_options_from_json(values.get("vad_parameters", "{}")) if values.get("vad_filter", False) else None
    if CANCEL_KEY in values and len(values) > 1:
        raise RequestError(f"request parameter {CANCEL_KEY!r} makes a cancel request: send it alone")
    return RequestParameters(
        transcription=transcription,
        response_format=response_format,
        input_format=input_format,
        sample_rate=sample_rate,
        channels=channels,
        request_id=values.get("request_id"),
        cancel=values.get(CANCEL_KEY),
        vad=vad,
    )


def _as_mapping(raw: str | Mapping[str, Any] | None) -> Mapping[str, Any]:
    if raw is None or raw == "":
        return {}
    if isinstance(raw, Mapping):
        return raw
    try:
        values = json.loads(raw)
    except json.JSONDecodeError as error:
        raise RequestError(f"request parameters are not valid JSON: {error}") from None
    if not isinstance(values, dict):
        raise RequestError(f"request parameters must be a JSON object, got {type(values).__name__}")
    return values


def _check_type(key: str, value: Any, allowed: tuple[type, ...]) -> None:
    if isinstance(value, bool) and bool not in allowed:
        ok = False
    else:
        ok = isinstance(value, allowed)
    if not ok:
        names = " or ".join(t.__name__ for t in allowed)
        raise RequestError(
            f"request parameter {key!r} must be {names}, got {type(value).__name__} {value!r}"
        )
