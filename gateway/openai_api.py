"""OpenAI's audio API as the gateway speaks it: a request's form fields, checked
(its errors: `openai_errors`).

Pure: no FastAPI and no Triton client here, so it is tested without a server.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.openai_errors import InvalidRequest
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.options import DecodingOptions, Task, WindowPadding, choice
from python_backend_lib.text.formats import Document, ResponseFormat

DEFAULT_MODEL_ID = "whisper-1"  # what OpenAI's examples ask for
MAX_TEMPERATURE = 1.0  # OpenAI's range is 0 to 1
# verbose_json lists segments unless the request asks for words alone.
WORD, SEGMENT = "word", "segment"
GRANULARITIES = (WORD, SEGMENT)
MEDIA_TYPES = {
    ResponseFormat.TEXT: "text/plain; charset=utf-8",
    ResponseFormat.SRT: "text/plain; charset=utf-8",
    ResponseFormat.VTT: "text/plain; charset=utf-8",
    ResponseFormat.JSON: "application/json",
    ResponseFormat.VERBOSE_JSON: "application/json",
}
OPENAI_FORMATS = tuple(f.value for f in MEDIA_TYPES)  # OpenAI's formats; not our tsv
# Our fields beyond OpenAI's: faster-whisper's and openai-whisper's search options, and the seed of
# the draws at a temperature (as OpenAI-compatible servers take `seed`), with their number types.
SEARCH_FIELDS = {"beam_size": int, "best_of": int, "patience": float, "length_penalty": float, "seed": int}
# The form fields of each endpoint, as OpenAI's API has them for whisper-1; any
# other is refused, so that a misspelt or unsupported option is not silently ignored.
# Taken and ignored, as `IGNORED_FIELDS` says why.
OPENAI_FIELDS = {
    Task.TRANSCRIBE: ("file", "model", "language", "prompt", "response_format", "temperature",
                      "timestamp_granularities[]", "stream", "include[]", "chunking_strategy"),
    Task.TRANSLATE: ("file", "model", "prompt", "response_format", "temperature", "timestamp_granularities[]"),
}
# faster-whisper's options beyond OpenAI's fields, taken by both endpoints and sent
# on as the request parameters of the same names (docs/parameters.md, "Beam search and best_of",
# "Voice activity").
EXTENSION_FIELDS = (*SEARCH_FIELDS, "vad_filter", "vad_parameters", "hallucination_silence_threshold", "window_padding")
FORM_FIELDS = {task: (*fields, *EXTENSION_FIELDS) for task, fields in OPENAI_FIELDS.items()}
IGNORED_FIELDS = {
    # OpenAI gives token log probabilities only for its gpt-4o models, never for whisper-1.
    "include[]": "token log probabilities are not returned (verbose_json has each segment's avg_logprob)",
    # The audio is decoded in Whisper's 30-second windows, each placed by the
    # timestamps of the one before, whatever the request says.
    "chunking_strategy": "long audio is cut into Whisper's own 30-second windows",
}
INCLUDE_VALUES = ("logprobs",)
# chunking_strategy is "auto" or a voice-activity object, which multipart
# spells as one field per key: chunking_strategy[type]=server_vad, ...
CHUNKING_AUTO = "auto"
CHUNKING_VAD_KEYS = ("type", "prefix_padding_ms", "silence_duration_ms", "threshold")
CHUNKING_VAD_TYPE = "server_vad"
USAGE_TYPE = "duration"  # OpenAI bills whisper-1 by the audio's duration
# stream=true answers with transcript.text.delta events, which carry text alone.
STREAM_FORMATS = (ResponseFormat.JSON, ResponseFormat.TEXT)
# Each form field as the API's description (/openapi.json, the /docs page) shows it.
FIELD_SCHEMAS: dict[str, dict[str, Any]] = {
    "file": {"type": "string", "format": "binary", "description": "the audio: any common audio or video file"},
    "model": {"type": "string", "default": DEFAULT_MODEL_ID, "description": "one of GET /v1/models"},
    "language": {"type": "string", "description": "the audio's language, e.g. en (default: detected)"},
    "prompt": {"type": "string", "description": "text that comes before the audio: names, spelling, style"},
    "response_format": {"type": "string", "enum": list(OPENAI_FORMATS), "default": ResponseFormat.JSON.value},
    "temperature": {"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE, "default": 0},
    "timestamp_granularities[]": {"type": "array", "items": {"type": "string", "enum": list(GRANULARITIES)},
                                  "description": "with verbose_json"},
    "stream": {"type": "boolean", "default": False,
               "description": "true: server-sent events, transcript.text.delta as text is decoded, then "
                              "transcript.text.done (response_format json or text)"},
    "include[]": {"type": "array", "items": {"type": "string", "enum": list(INCLUDE_VALUES)},
                  "description": "ignored: " + IGNORED_FIELDS["include[]"]},
    "chunking_strategy": {"type": "string", "enum": [CHUNKING_AUTO],
                          "description": "ignored: " + IGNORED_FIELDS["chunking_strategy"]},
    "vad_filter": {"type": "boolean", "default": False,
                   "description": "leave out what Silero VAD finds is not speech before decoding"},
    "vad_parameters": {"type": "string", "description": 'with vad_filter: a JSON object of faster-whisper\'s '
                       'VAD options, e.g. {"min_silence_duration_ms": 500}'},
    "hallucination_silence_threshold": {
        "type": "number", "minimum": 0,
        "description": "with word timestamps: drop doubtful text with this many seconds of silence around it"},
    "window_padding": {"type": "string", "enum": [p.value for p in WindowPadding],
                       "default": WindowPadding.OPENAI_WHISPER.value,
                       "description": "what a 30 s window holds past the end of the audio: as openai-whisper and "
                                      "faster-whisper pad it (the default) or as transformers does"},
    "beam_size": {"type": "integer", "minimum": 1, "description": "beam search at temperature 0 (default: greedy)"},
    "best_of": {"type": "integer", "minimum": 1, "description": "above temperature 0, the best of this many samples"},
    "patience": {"type": "number", "description": "beam search ends after round(beam_size * patience) candidates"},
    "seed": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1,
             "description": "what the draws of the temperature fallback follow: the same seed, the same transcript "
                            "(default: 0)"},
    "length_penalty": {"type": "number", "minimum": 0, "maximum": 1,
                       "description": "rank by log-probability / ((5 + length) / 6) ** alpha (default: / length)"},
}


def request_body(task: Task) -> dict[str, Any]:
    """The endpoint's multipart form in OpenAPI's terms (its handler reads the raw request)."""
    schema = {"type": "object", "required": ["file", "model"],
              "properties": {name: FIELD_SCHEMAS[name] for name in FORM_FIELDS[task]}}
    return {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": schema}}}}


# ------------------------------------------------------------- the request


@dataclass(frozen=True)
class AudioRequest:
    """One transcription or translation, checked (the audio travels beside it)."""

    model: str
    task: Task
    response_format: ResponseFormat = ResponseFormat.JSON
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    granularities: tuple[str, ...] = field(default=())
    vad_filter: bool = False
    vad_parameters: str | None = None
    hallucination_silence_threshold: float | None = None
    window_padding: WindowPadding | None = None
    stream: bool = False  # answer with server-sent events (`transcript_events`)
    search: Mapping[str, float] = field(default_factory=dict)  # SEARCH_FIELDS given, checked

    def __post_init__(self) -> None:
        object.__setattr__(self, "task", Task(self.task))
        object.__setattr__(self, "response_format", ResponseFormat(self.response_format))

    @property
    def word_timestamps(self) -> bool:
        return WORD in self.granularities

    @property
    def reports_usage(self) -> bool:
        """Whether the reply carries `usage`: OpenAI's JSON transcriptions do, its translations do not."""
        return self.task is Task.TRANSCRIBE and self.response_format in (ResponseFormat.JSON,
                                                                          ResponseFormat.VERBOSE_JSON)

    @property
    def triton_format(self) -> ResponseFormat:
        """The format asked of Triton: verbose_json where `usage` needs the audio's
        duration, which json does not carry."""
        return ResponseFormat.VERBOSE_JSON if self.reports_usage else self.response_format

    def triton_parameters(self) -> dict[str, Any]:
        """The `transcribe` request parameters. Segment timestamps are always on:
        they are what long audio is seeked by, and every format but text shows them."""
        parameters: dict[str, Any] = {
            "task": self.task.value,
            "response_format": self.triton_format.value,
            "timestamps": True,
            "temperature": self.temperature,
            "word_timestamps": self.word_timestamps,
        }
        if self.language is not None:
            parameters["language"] = self.language
        if self.prompt is not None:
            parameters["prompt"] = self.prompt
        if self.vad_filter:
            parameters["vad_filter"] = True
        if self.vad_parameters is not None:
            parameters["vad_parameters"] = self.vad_parameters
        if self.hallucination_silence_threshold is not None:
            parameters["hallucination_silence_threshold"] = self.hallucination_silence_threshold
        if self.window_padding is not None:
            parameters["window_padding"] = self.window_padding.value
        return {**parameters, **self.search}

    def shape(self, formatted: str) -> str:
        """The response body from the FORMATTED output (in `triton_format`):
        verbose_json lists only the granularities asked for (segments by default);
        a transcription's JSON gets OpenAI's `usage`, the audio's duration."""
        if not self.reports_usage and not (self.response_format is ResponseFormat.VERBOSE_JSON and self.granularities):
            return formatted
        record = json.loads(formatted)
        duration = record["duration"]
        if self.response_format is ResponseFormat.JSON:
            record = json.loads(Document.from_verbose_json(record).render(ResponseFormat.JSON))
        elif self.granularities and SEGMENT not in self.granularities:
            record.pop("segments", None)
        if self.reports_usage:
            record["usage"] = {"type": USAGE_TYPE, "seconds": duration}
        return json.dumps(record, ensure_ascii=False)


def parse_form(form: Mapping[str, Any], task: Task, model_ids: Sequence[str]) -> AudioRequest:
    """The multipart fields of one request. form: field -> list of values
    (str, or an object with `read` for files); model_ids: the `model` values
    accepted. Raises InvalidRequest."""
    for name in form:
        if _field_name(name) not in FORM_FIELDS[task]:
            raise InvalidRequest(
                400, f"unknown field {name!r}; this endpoint takes {', '.join(FORM_FIELDS[task])}",
                param=name, code="unknown_parameter",
            )
    _check_ignored_fields(form)
    stream = _stream(form)
    model = _text(form, "model", required=True)
    if model not in model_ids:
        raise InvalidRequest(
            404, f"the model {model!r} does not exist; this server has {list(model_ids)}",
            param="model", code="model_not_found",
        )
    response_format = _text(form, "response_format") or ResponseFormat.JSON.value
    if response_format not in OPENAI_FORMATS:
        raise InvalidRequest(
            400, f"response_format must be one of {list(OPENAI_FORMATS)}, got {response_format!r}",
            param="response_format", code="invalid_value",
        )
    response_format = ResponseFormat(response_format)
    temperature = _temperature(_text(form, "temperature"))
    granularities = tuple(dict.fromkeys(_granularities(form.get("timestamp_granularities[]", []))))
    if granularities and response_format is not ResponseFormat.VERBOSE_JSON:
        raise InvalidRequest(
            400, "timestamp_granularities[] needs response_format 'verbose_json'",
            param="timestamp_granularities[]", code="invalid_value",
        )
    if stream and response_format not in STREAM_FORMATS:
        raise InvalidRequest(
            400, f"stream=true sends the text as it is decoded (transcript.text.delta events): response_format "
            f"must be one of {[f.value for f in STREAM_FORMATS]}, got {response_format.value!r}; leave stream "
            "unset or false for the whole transcript in this format",
            param="response_format", code="unsupported_value",
        )
    language = _text(form, "language")
    return AudioRequest(
        model=model,
        task=task,
        response_format=response_format,
        language=language,
        prompt=_text(form, "prompt"),
        temperature=temperature,
        granularities=granularities,
        vad_filter=_boolean(form, "vad_filter"),
        vad_parameters=_text(form, "vad_parameters"),
        hallucination_silence_threshold=_number(form, "hallucination_silence_threshold"),
        window_padding=_choice(form, "window_padding", WindowPadding),
        stream=stream,
        search=_search(form),
    )


def _boolean(form: Mapping[str, Any], name: str) -> bool:
    value = (_text(form, name) or "false").lower()
    if value not in ("true", "false"):
        raise InvalidRequest(400, f"{name} must be true or false, got {value!r}", param=name, code="invalid_value")
    return value == "true"


def _choice(form: Mapping[str, Any], name: str, kind: type[enum.Enum]) -> Any:
    """One of `kind`'s values (`core.options.choice`), None when absent."""
    value = _text(form, name)
    if value is None:
        return None
    try:
        return choice(kind, value, name)
    except RequestError as error:
        raise InvalidRequest(400, str(error), param=name, code="invalid_value") from None


def _number(form: Mapping[str, Any], name: str) -> float | None:
    """A number field (the server checks its range), None when absent."""
    value = _text(form, name)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise InvalidRequest(400, f"{name} must be a number, got {value!r}", param=name, code="invalid_value") from None


def _search(form: Mapping[str, Any]) -> dict[str, float]:
    """The search fields given, as numbers the decoding options accept."""
    search: dict[str, float] = {}
    for name, kind in SEARCH_FIELDS.items():
        if (text := _text(form, name)) is None:
            continue
        try:
            search[name] = kind(text)
        except ValueError:
            wanted = "an integer" if kind is int else "a number"
            raise InvalidRequest(400, f"{name} must be {wanted}, got {text!r}", param=name,
                                 code="invalid_value") from None
    try:
        DecodingOptions(**search)
    except RequestError as error:
        param = next((name for name in search if str(error).startswith(name)), None)
        raise InvalidRequest(400, str(error), param=param, code="invalid_value") from None
    return search


def _field_name(name: str) -> str:
    """The field a multipart name belongs to: chunking_strategy[type] is chunking_strategy's."""
    head, bracket, key = name.partition("[")
    if head == "chunking_strategy" and bracket and key.removesuffix("]") in CHUNKING_VAD_KEYS:
        return head
    return name


def _text(form: Mapping[str, Any], name: str, required: bool = False) -> str | None:
    """A text field's value (the last, if repeated); None when absent or empty."""
    values = form.get(name) or [None]
    value = values[-1]
    if value is not None and not isinstance(value, str):
        raise InvalidRequest(400, f"'{name}' must be a text field, not a file", param=name, code="invalid_type")
    if not value:
        if required:
            raise InvalidRequest(
                400, f"you must provide a '{name}' parameter", param=name, code="missing_required_parameter"
            )
        return None
    return value


def _stream(form: Mapping[str, Any]) -> bool:
    stream = (_text(form, "stream") or "false").lower()
    if stream not in ("true", "false"):
        raise InvalidRequest(400, f"stream must be true or false, got {stream!r}", param="stream",
                             code="invalid_value")
    return stream == "true"


def _check_ignored_fields(form: Mapping[str, Any]) -> None:
    """The fields that change nothing here must still be what OpenAI's API takes."""
    for value in form.get("include[]", []):
        if value not in INCLUDE_VALUES:
            raise InvalidRequest(400, f"include[] may hold {list(INCLUDE_VALUES)}, got {value!r}",
                                 param="include[]", code="invalid_value")
    chunking = _text(form, "chunking_strategy")
    vad_type = _text(form, "chunking_strategy[type]")
    if chunking is not None and chunking != CHUNKING_AUTO:
        raise InvalidRequest(400, f"chunking_strategy must be {CHUNKING_AUTO!r} or a {CHUNKING_VAD_TYPE} object, "
                             f"got {chunking!r}", param="chunking_strategy", code="invalid_value")
    vad_fields = [name for name in form if name.startswith("chunking_strategy[")]
    if vad_fields and vad_type != CHUNKING_VAD_TYPE:
        raise InvalidRequest(400, f"chunking_strategy[type] must be {CHUNKING_VAD_TYPE!r}, got {vad_type!r}",
                             param="chunking_strategy", code="invalid_value")


def _temperature(value: str | None) -> float:
    if value is None:
        return 0.0
    try:
        temperature = float(value)
    except ValueError:
        temperature = math.nan
    if not 0.0 <= temperature <= MAX_TEMPERATURE:  # False for NaN too
        raise InvalidRequest(
            400, f"temperature must be a number from 0 to {MAX_TEMPERATURE:g}, got {value!r}",
            param="temperature", code="invalid_value",
        )
    return temperature


def _granularities(values: Sequence[Any]) -> list[str]:
    for value in values:
        if value not in GRANULARITIES:
            raise InvalidRequest(
                400, f"timestamp_granularities[] may hold {list(GRANULARITIES)}, got {value!r}",
                param="timestamp_granularities[]", code="invalid_value",
            )
    return list(values)
