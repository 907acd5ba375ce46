"""The OpenAI-compatible gateway, through the official `openai` client, against the real server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc
from conftest import (
    AUDIO_DIR,
    FAULT_PROMPT,
    GATEWAY_MAX_FILE_MB,
    GATEWAY_MODEL_IDS,
    RunningServer,
    free_port,
    whisper_triton_command,
)

from gateway.api_key import API_KEY_ENV
from gateway.app import GatewaySettings, create_app
from gateway.openai_api import FORM_FIELDS, SEARCH_FIELDS, AudioRequest, parse_form
from gateway.openai_errors import ApiError, InvalidRequest, api_error, error_from_triton
from python_backend_lib.contract import tensor_names
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.options import Task
from python_backend_lib.text.formats import Document

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.server, pytest.mark.filterwarnings("ignore::DeprecationWarning")]  # "whisper-1"

JFK = AUDIO_DIR / "jfk.wav"
SONNET = AUDIO_DIR / "sonnet1_longform.wav"
FORMATS = ["json", "text", "srt", "verbose_json", "vtt"]


@pytest.fixture(scope="module")
def client(gateway: str):
    with openai.OpenAI(base_url=gateway, api_key="unused", max_retries=0) as openai_client:
        yield openai_client


def transcribe(client, clip=JFK, **options):
    with open(clip, "rb") as audio:
        return client.audio.transcriptions.create(model="whisper-1", file=audio, **options)


def served(server: RunningServer, request: AudioRequest, clip=JFK) -> str:
    """FORMATTED straight from Triton, with the parameters the gateway sends, but
    in the request's own response_format."""
    triton = tritonclient.grpc.InferenceServerClient(server.grpc_url)
    audio = tritonclient.grpc.InferInput(tensor_names.AUDIO, [1, 1], "BYTES")
    audio.set_data_from_numpy(np.array([[clip.read_bytes()]], dtype=np.object_))
    parameters = {**request.triton_parameters(), "response_format": request.response_format.value}
    response = triton.infer(tensor_names.ENSEMBLE_NAME, [audio], parameters=parameters)
    return response.as_numpy(tensor_names.FORMATTED)[0, 0].decode()


def test_models_lists_the_ids_the_gateway_answers_to(client):
    assert [m.id for m in client.models.list().data] == list(GATEWAY_MODEL_IDS)
    assert client.models.retrieve("tiny.en").owned_by == "whisper-triton"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o-transcribe")
    assert caught.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("response_format", FORMATS)
def test_every_response_format_is_what_triton_writes(client, server, response_format):
    result = transcribe(client, response_format=response_format)
    expected = served(server, AudioRequest(model="whisper-1", task=Task.TRANSCRIBE, response_format=response_format))
    if response_format in ("text", "srt", "vtt"):
        assert isinstance(result, str) and result == expected
    else:  # and OpenAI's usage of a transcription: the audio's duration, as Triton measures it
        verbose = served(server, AudioRequest(model="whisper-1", task=Task.TRANSCRIBE, response_format="verbose_json"))
        usage = {"type": "duration", "seconds": json.loads(verbose)["duration"]}
        assert json.loads(result.model_dump_json(exclude_unset=True)) == {**json.loads(expected), "usage": usage}
        assert (result.usage.type, result.usage.seconds) == ("duration", 11.0)
    words = "ask not what your country can do for you"
    text = result if isinstance(result, str) else result.text
    assert words in text.lower()


@pytest.mark.parametrize(("clip", "phrase"), [(JFK, "for you ask"), (SONNET, "thy self thy foe")], ids=["jfk", "sonnet"])
def test_the_cli_and_the_gateway_give_the_same_text(client, server, clip, phrase):
    """Both decode with timestamps by default, as openai-whisper does: the same text."""
    command = whisper_triton_command() + ["transcribe", str(clip), f"--url={server.http_url}"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    assert transcribe(client, clip, response_format="text") == completed.stdout
    assert phrase in completed.stdout.lower()  # as decoded with timestamps (without: "for you, ask", "self-thigh foe")


def test_verbose_json_has_openais_fields(client):
    result = transcribe(client, response_format="verbose_json")
    assert (result.language, result.duration) == ("english", 11.0)
    assert result.text == " ".join(s.text for s in result.segments)
    assert [s.id for s in result.segments] == list(range(len(result.segments)))
    for segment in result.segments:
        assert 0 <= segment.start < segment.end <= result.duration
        assert segment.seek == 0 and segment.temperature == 0.0
        assert segment.avg_logprob < 0 and 0 <= segment.no_speech_prob <= 1 and segment.compression_ratio > 0
        assert segment.tokens and all(isinstance(t, int) for t in segment.tokens)
    assert result.words is None


@pytest.mark.parametrize(
    ("granularities", "segments"), [(["word"], False), (["word", "segment"], True), (["segment"], True)]
)
def test_timestamp_granularities(client, granularities, segments):
    result = transcribe(client, response_format="verbose_json", timestamp_granularities=granularities)
    assert (result.segments is not None) == segments
    if "word" not in granularities:
        assert result.words is None
        return
    words = result.words
    assert "".join(w.word for w in words).strip() == result.text
    assert all(0 <= w.start <= w.end <= result.duration for w in words)
    assert [w.start for w in words] == sorted(w.start for w in words)
    # The second "ask" follows a pause that ends at 8.18 s (tests/unit/test_alignment.py).
    second_ask = [w for w in words if w.word.strip(" ,.") == "ask"][1]
    assert abs(second_ask.start - 8.18) < 0.2


def test_language_and_prompt_reach_the_model(client):
    assert "country" in transcribe(client, language="en", prompt="Kennedy's inaugural address.").text
    with pytest.raises(openai.BadRequestError, match="English-only"):
        transcribe(client, language="de")


@pytest.mark.parametrize("response_format", ["json", "text"])
def test_translation_on_an_english_only_checkpoint_is_a_clear_400(client, response_format):
    with open(JFK, "rb") as audio, pytest.raises(openai.BadRequestError) as caught:
        client.audio.translations.create(model="whisper-1", file=audio, response_format=response_format)
    body = caught.value.body
    assert body["message"].startswith("task 'translate' needs a multilingual checkpoint")  # no "in ensemble"
    assert body["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("options", "error", "param"),
    [
        ({"model": "whisper-2"}, openai.NotFoundError, "model"),
        ({"response_format": "diarized_json"}, openai.BadRequestError, "response_format"),
        ({"temperature": 1.5}, openai.BadRequestError, "temperature"),
        ({"timestamp_granularities": ["word"]}, openai.BadRequestError, "timestamp_granularities[]"),
        ({"timestamp_granularities": ["sentence"], "response_format": "verbose_json"}, openai.BadRequestError,
         "timestamp_granularities[]"),
        ({"extra_body": {"diarize": "true"}}, openai.BadRequestError, "diarize"),
        ({"response_format": "tsv"}, openai.BadRequestError, "response_format"),  # ours, not OpenAI's
    ],
)
def test_bad_requests_get_openais_error_shape(client, options, error, param):
    with open(JFK, "rb") as audio, pytest.raises(error) as caught:
        client.audio.transcriptions.create(file=audio, **{"model": "whisper-1", **options})
    body = caught.value.body
    assert set(body) == {"message", "type", "param", "code"}
    assert (body["type"], body["param"]) == ("invalid_request_error", param)


@pytest.mark.parametrize(
    "options",
    [{"stream": False}, {"include": ["logprobs"]}, {"chunking_strategy": "auto"},
     {"chunking_strategy": {"type": "server_vad", "threshold": 0.5, "silence_duration_ms": 500}}],
    ids=["stream-false", "include-logprobs", "chunking-auto", "chunking-vad"],
)
def test_openais_other_fields_are_taken_and_change_nothing(client, options):
    result = transcribe(client, **options)
    assert result.text == transcribe(client).text and "country" in result.text
    assert result.usage.seconds == 11.0


@pytest.mark.parametrize(
    ("form", "param"),
    [({"stream": ["maybe"]}, "stream"), ({"include[]": ["everything"]}, "include[]"),
     ({"chunking_strategy": ["by-the-minute"]}, "chunking_strategy"),
     ({"chunking_strategy[type]": ["semantic"]}, "chunking_strategy"),
     ({"chunking_strategy[depth]": ["2"]}, "chunking_strategy[depth]")],
)
def test_openais_other_fields_must_hold_what_openai_takes(form, param):
    with pytest.raises(ApiError) as caught:
        parse_form({"model": ["whisper-1"], **form}, Task.TRANSCRIBE, ("whisper-1",))
    assert (caught.value.status, caught.value.param) == (400, param)


def test_translations_have_no_usage_as_at_openai():
    for response_format in ("json", "verbose_json"):
        translation = AudioRequest(model="whisper-1", task=Task.TRANSLATE, response_format=response_format)
        assert not translation.reports_usage
        assert translation.triton_parameters()["response_format"] == response_format


def test_the_docs_page_needs_no_internet(gateway):
    root = gateway.removesuffix("/v1")
    with urllib.request.urlopen(f"{root}/docs", timeout=10) as reply:
        page = reply.read().decode()
    scripts = re.findall(r'<script src="([^"]+)"', page) + re.findall(r'<link [^>]*href="([^"]+)"', page)
    assert scripts and all(src.startswith("/docs-assets/") for src in scripts), scripts
    for asset in scripts:
        with urllib.request.urlopen(root + asset, timeout=10) as reply:
            assert reply.status == 200 and len(reply.read()) > 0
    with urllib.request.urlopen(f"{root}/openapi.json", timeout=10) as reply:
        paths = json.loads(reply.read())["paths"]
    for path, task in (("/v1/audio/transcriptions", Task.TRANSCRIBE), ("/v1/audio/translations", Task.TRANSLATE)):
        form = paths[path]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
        assert tuple(form["properties"]) == FORM_FIELDS[task]  # the page's form is the one parse_form reads


async def refused_websocket(base_url: str, headers: dict[str, str]) -> tuple[dict, tuple[int, str]]:
    """The first event of a Realtime session opened with `headers`, and its close (code, reason)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    url = base_url.replace("http://", "ws://") + "/realtime?intent=transcription"
    async with connect(url, additional_headers=headers) as socket:
        event = json.loads(await asyncio.wait_for(socket.recv(), timeout=30))
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(socket.recv(), timeout=30)
        return event, (socket.close_code, socket.close_reason)


@pytest.mark.parametrize("given_by", ["flag", "environment"])
def test_an_api_key_is_required_when_set(server, tmp_path, given_by):
    key = "sk-test-" + given_by
    arguments, environ = ([f"--api-key={key}"], {}) if given_by == "flag" else ([], {API_KEY_ENV: key})
    process, base_url = start_gateway(server.grpc_url, tmp_path, arguments, environ)
    try:
        with openai.OpenAI(base_url=base_url, api_key=key, max_retries=0) as allowed:
            assert "country" in transcribe(allowed).text
        with openai.OpenAI(base_url=base_url, api_key="sk-wrong", max_retries=0) as refused:
            with pytest.raises(openai.AuthenticationError) as caught:
                transcribe(refused)
            assert caught.value.status_code == 401
            assert caught.value.body == {"message": "incorrect API key", "type": "invalid_request_error",
                                         "param": None, "code": "invalid_api_key"}
            with pytest.raises(openai.AuthenticationError):
                refused.models.list()
        request = urllib.request.Request(f"{base_url}/models")  # no Authorization header at all
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=10)
        assert caught.value.code == 401 and caught.value.headers["WWW-Authenticate"] == "Bearer"
        assert json.loads(caught.value.read())["error"]["message"].startswith("no API key given")
        root = base_url.removesuffix("/v1")
        for open_path in ("/health", "/docs"):
            with urllib.request.urlopen(root + open_path, timeout=10) as reply:
                assert reply.status == 200
        with urllib.request.urlopen(f"{root}/openapi.json", timeout=10) as reply:  # /docs can send the key
            description = json.loads(reply.read())
        assert description["components"]["securitySchemes"]["apiKey"] == {"type": "http", "scheme": "bearer"}
        assert description["paths"]["/v1/models"]["get"]["security"] == [{"apiKey": []}]
        assert "security" not in description["paths"]["/health"]["get"]
        # A Realtime WebSocket refused for its key reads why, as the 401 says it, then closes.
        for headers, message in (({"Authorization": "Bearer sk-wrong"}, "incorrect API key"),
                                 ({}, "no API key given: send it as the header `Authorization: Bearer <key>`")):
            event, closed = asyncio.run(refused_websocket(base_url, headers))
            assert event["type"] == "error", event
            assert event["error"]["message"] == message and event["error"]["code"] == "invalid_api_key", event
            assert closed == (1008, "invalid_api_key")
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0


def test_a_fault_of_the_server_is_a_500_that_blames_no_client(client, server):
    """The engine's fault hook raises a ValueError that is not a RequestError:
    the server's fault, so Triton says INTERNAL and the gateway 500."""
    with open(JFK, "rb") as audio, pytest.raises(openai.InternalServerError) as caught:
        client.audio.transcriptions.create(model="whisper-1", file=audio, prompt=FAULT_PROMPT)
    assert caught.value.status_code == 500
    body = caught.value.body
    assert body["type"] == "server_error" and body["code"] == "server_error"
    assert "internal error: InjectedFault: injected fault for the prompt" in body["message"]
    assert "Traceback" not in body["message"]


@pytest.mark.parametrize(
    "samples",
    [np.zeros(30 * 16_000), np.random.default_rng(0).standard_normal(30 * 16_000) * 0.1],
    ids=["silence", "white-noise"],
)
def test_thirty_seconds_without_speech_give_no_text(client, samples):
    import io

    import soundfile

    wav = io.BytesIO()
    soundfile.write(wav, samples.astype(np.float32), 16_000, format="WAV", subtype="FLOAT")
    result = client.audio.transcriptions.create(
        model="whisper-1", file=("quiet.wav", wav.getvalue()), response_format="verbose_json"
    )
    assert (result.text, result.segments, result.duration) == ("", [], 30.0)


def test_audio_that_cannot_be_decoded_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="not a decodable audio file"):
        client.audio.transcriptions.create(model="whisper-1", file=("notes.wav", b"certainly not audio"))


def post(url: str, body: bytes, content_type: str) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def multipart(fields: dict[str, bytes | str], boundary: str = "testboundary") -> tuple[bytes, str]:
    parts = []
    for name, value in fields.items():
        if isinstance(value, bytes):
            header = f'Content-Disposition: form-data; name="{name}"; filename="{name}.wav"\r\n\r\n'
            parts.append(f"--{boundary}\r\n{header}".encode() + value + b"\r\n")
        else:
            parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"model": "whisper-1"}, 400, "file"),
        ({"file": JFK.read_bytes()}, 400, "model"),
        ({"model": "whisper-1", "file": b""}, 400, "file"),
        ({"model": "whisper-1", "file": b"\0" * (GATEWAY_MAX_FILE_MB * 1024 * 1024 + 1)}, 413, "file"),
    ],
    ids=["no-file", "no-model", "empty-file", "too-large"],
)
def test_malformed_uploads(gateway, fields, status, param):
    body, content_type = multipart(fields)
    code, reply = post(f"{gateway}/audio/transcriptions", body, content_type)
    assert (code, reply["error"]["param"]) == (status, param)


def test_a_body_that_is_not_multipart_is_a_415(gateway):
    code, reply = post(f"{gateway}/audio/transcriptions", b'{"model": "whisper-1"}', "application/json")
    assert code == 415 and reply["error"]["code"] == "unsupported_media_type"


def test_unknown_paths_are_404s_in_openais_shape(gateway):
    code, reply = post(f"{gateway}/chat/completions", b"{}", "application/json")
    assert code == 404 and reply["error"]["type"] == "invalid_request_error"


def test_health_follows_triton(gateway):
    with urllib.request.urlopen(gateway.removesuffix("/v1") + "/health", timeout=10) as reply:
        assert reply.status == 200


# --- the form, without a server ------------------------------------------------------


def test_form_fields_become_triton_parameters():
    form = {"model": ["whisper-1"], "language": ["en"], "prompt": ["Names."], "temperature": ["0.4"],
            "response_format": ["verbose_json"], "timestamp_granularities[]": ["word", "segment", "word"]}
    request = parse_form(form, Task.TRANSCRIBE, GatewaySettings().model_ids)
    assert request.granularities == ("word", "segment")
    assert request.triton_parameters() == {
        "task": "transcribe", "response_format": "verbose_json", "timestamps": True, "temperature": 0.4,
        "word_timestamps": True, "language": "en", "prompt": "Names.",
    }
    translation = parse_form({"model": ["whisper-1"]}, Task.TRANSLATE, GatewaySettings().model_ids)
    assert translation.triton_parameters() == {
        "task": "translate", "response_format": "json", "timestamps": True, "temperature": 0.0,
        "word_timestamps": False,
    }


@pytest.mark.parametrize(
    ("form", "task", "field"),
    [
        ({"model": ["whisper-1"], "language": ["de"]}, Task.TRANSLATE, "language"),  # translations are into English
        ({"model": ["whisper-1"], "beam_width": ["5"]}, Task.TRANSCRIBE, "beam_width"),
        ({"model": ["whisper-1"], "timestamp_granularities": ["word"]}, Task.TRANSCRIBE, "timestamp_granularities"),
    ],
)
def test_unknown_form_fields_are_refused_by_name(form, task, field):
    with pytest.raises(ApiError) as caught:
        parse_form(form, task, ("whisper-1",))
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, field, "unknown_parameter")
    assert caught.value.message.startswith(f"unknown field {field!r}; this endpoint takes file, model")


def test_search_fields_become_triton_parameters():
    form = {"model": ["whisper-1"], "beam_size": ["5"], "patience": ["1.5"], "length_penalty": ["0.6"],
            "best_of": ["3"], "seed": ["42"]}
    for task in Task:
        parameters = parse_form(form, task, ("whisper-1",)).triton_parameters()
        assert {k: parameters[k] for k in SEARCH_FIELDS} == {"beam_size": 5, "best_of": 3, "patience": 1.5,
                                                             "length_penalty": 0.6, "seed": 42}
        assert isinstance(parameters["beam_size"], int) and isinstance(parameters["patience"], float)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("beam_size", "five", "beam_size must be an integer, got 'five'"),
        ("beam_size", "1.5", "beam_size must be an integer"),
        ("beam_size", "0", "beam_size must be an integer from 1 to 16"),
        ("best_of", "99", "best_of must be an integer from 1 to 16"),
        ("patience", "-1", "patience must be a number above 0"),
        ("length_penalty", "2", "length_penalty must be a number from 0 to 1"),
        ("seed", "-3", "seed must be an integer from 0 to 4294967295"),
        ("seed", "0.5", "seed must be an integer, got '0.5'"),
    ],
)
def test_bad_search_fields_are_refused_by_name(field, value, message):
    with pytest.raises(ApiError) as caught:
        parse_form({"model": ["whisper-1"], field: [value]}, Task.TRANSCRIBE, ("whisper-1",))
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, field, "invalid_value")
    assert caught.value.message.startswith(message)


@pytest.fixture(scope="module")
def library():
    from python_backend_lib.transcription.pipeline import Pipeline

    pipeline = Pipeline.load("default", device="cpu")
    yield pipeline
    pipeline.close()


def test_beam_search_through_the_gateway_is_the_librarys(client, library):
    """beam_size=5 over HTTP (the real server, tiny.en): the library's beam search
    result, which on this clip is not the greedy one."""
    from python_backend_lib.core.options import DecodingOptions

    served = transcribe(client, response_format="verbose_json", extra_body={"beam_size": 5})
    expected = library.transcribe(JFK.read_bytes(), DecodingOptions(timestamps=True, beam_size=5))
    greedy = library.transcribe(JFK.read_bytes(), DecodingOptions(timestamps=True))
    assert [s.tokens for s in served.segments] == [list(s.tokens) for s in expected.segments]
    assert served.text == expected.text != greedy.text
    with pytest.raises(openai.BadRequestError, match="beam_size must be an integer from 1 to 16"):
        transcribe(client, extra_body={"beam_size": 40})


def test_window_padding_reaches_the_model(client, library):
    """window_padding="transformers" over HTTP (the real server, tiny.en): the
    library's transcript with that option, which on this clip reads differently
    from the default padding (openai-whisper's); a value it does not name is a
    400 naming both."""
    from python_backend_lib.core.options import DecodingOptions, TranscribeOptions, WindowPadding

    clip = AUDIO_DIR / "cards_002.wav"
    served = transcribe(client, clip, extra_body={"window_padding": "transformers", "beam_size": 5})
    decoding = DecodingOptions(timestamps=True, beam_size=5)
    expected = library.transcribe(
        clip.read_bytes(), TranscribeOptions(decoding=decoding, window_padding=WindowPadding.TRANSFORMERS)
    )
    default = library.transcribe(clip.read_bytes(), TranscribeOptions(decoding=decoding))
    assert served.text == expected.text != default.text
    with pytest.raises(openai.BadRequestError, match="window_padding must be one of .'transformers', 'openai-whisper'."):
        transcribe(client, extra_body={"window_padding": "zeros"})
    request = parse_form({"model": ["whisper-1"], "window_padding": ["transformers"]}, Task.TRANSLATE, ("whisper-1",))
    assert request.triton_parameters()["window_padding"] == "transformers"


def test_words_alone_drop_the_segments():
    document = Document(text="Hi.", segments=(), duration=1.0, language="en", word_timestamps=True)
    request = AudioRequest(model="whisper-1", task=Task.TRANSCRIBE, response_format="verbose_json",
                           granularities=("word",))
    shaped = json.loads(request.shape(document.render("verbose_json")))
    assert "segments" not in shaped and shaped["words"] == []


@pytest.mark.parametrize("temperature", ["-0.1", "nan", "warm", "1.01"])
def test_temperature_must_be_from_zero_to_one(temperature):
    with pytest.raises(ApiError) as caught:
        parse_form({"model": ["whisper-1"], "temperature": [temperature]}, Task.TRANSCRIBE, ("whisper-1",))
    assert caught.value.status == 400 and caught.value.param == "temperature"
    assert isinstance(caught.value, RequestError)  # the client's mistake


@pytest.mark.parametrize(
    ("status", "http", "code"),
    [
        ("StatusCode.INVALID_ARGUMENT", 400, None),
        ("StatusCode.UNAVAILABLE", 503, "service_unavailable"),  # overloaded, or Triton not there
        ("StatusCode.DEADLINE_EXCEEDED", 504, "timeout"),
        ("StatusCode.INTERNAL", 500, "server_error"),
        (None, 500, "server_error"),
    ],
)
def test_triton_errors_map_to_http_statuses(status, http, code):
    from tritonclient.utils import InferenceServerException

    error = error_from_triton(InferenceServerException("the message", status=status))
    assert (error.status, error.code) == (http, code) and error.message.endswith("the message")
    assert error.body()["error"]["type"] == ("invalid_request_error" if http < 500 else "server_error")


@pytest.mark.parametrize(
    ("message", "http"),
    [
        ("in ensemble 'transcribe_stream', not a decodable audio file: no audio or video format FFmpeg reads", 400),
        ("in ensemble 'transcribe_stream', server overloaded: 32 requests in flight; retry later", 503),
        ("in ensemble 'transcribe_stream', internal error: RuntimeError: CUDA out of memory", 500),
    ],
)
def test_a_streamed_errors_status_comes_from_its_message(message, http):
    """gRPC's stream_infer carries an error's message without its status."""
    from tritonclient.utils import InferenceServerException

    error = error_from_triton(InferenceServerException(message), streamed=True)
    assert error.status == http and not error.message.startswith("in ensemble")


def test_whose_fault_decides_the_status():
    assert isinstance(InvalidRequest(404, "no such model"), RequestError)
    assert api_error(RequestError("audio is empty")).status == 400
    internal = api_error(ValueError("an invariant broke"))
    assert (internal.status, internal.kind) == (500, "server_error")
    assert internal.message == "internal error: ValueError: an invariant broke"


def test_the_app_answers_every_failure_in_openais_shape():
    """A real app: a RequestError raised anywhere is a 400, any other exception a
    500 whose body names no traceback (the test adds the two failing routes)."""
    from fastapi.testclient import TestClient

    app = create_app(GatewaySettings(triton_url="localhost:1"))

    @app.get("/client-mistake")
    async def client_mistake():
        raise RequestError("the request is wrong")

    @app.get("/server-bug")
    async def server_bug():
        raise ValueError("an invariant broke")

    with TestClient(app, raise_server_exceptions=False) as http:
        mistake, bug = http.get("/client-mistake"), http.get("/server-bug")
    assert mistake.status_code == 400 and mistake.json()["error"]["message"] == "the request is wrong"
    assert bug.status_code == 500
    assert bug.json()["error"] == {
        "message": "internal error: ValueError: an invariant broke", "type": "server_error", "param": None,
        "code": "server_error",
    }


# --- the gateway's own connection to Triton ---------------------------------------------


def start_gateway(triton_url: str, tmp_path, arguments=(), environ=None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = (tmp_path / "gateway.log").open("w")
    command = whisper_triton_command() + ["gateway", f"--triton-url={triton_url}", f"--port={port}", *arguments]
    environment = {key: value for key, value in os.environ.items() if key != API_KEY_ENV}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**environment, **(environ or {})})
    base_url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"{base_url.removesuffix('/v1')}/health", timeout=1):
                return process, base_url
        except urllib.error.HTTPError:  # up, but Triton is not ready (or not there): the tests say which
            return process, base_url
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)
    process.kill()
    pytest.fail(f"the gateway did not start:\n{(tmp_path / 'gateway.log').read_text()}")


@pytest.mark.parametrize(
    ("where", "cause"),
    [("nothing", "is it running? Start it with `whisper-triton serve`"), ("http", "it is likely Triton's HTTP port")],
)
def test_a_triton_it_cannot_reach_is_a_503_that_says_why(server, tmp_path, where, cause):
    triton_url = f"localhost:{free_port()}" if where == "nothing" else server.http_url
    process, base_url = start_gateway(triton_url, tmp_path)
    try:
        with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as unreachable, pytest.raises(
            openai.InternalServerError
        ) as caught:
            transcribe(unreachable)
        assert caught.value.status_code == 503
        message = caught.value.body["message"]
        assert message.startswith("cannot reach Triton: ") and cause in message and "\n" not in message
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0


@pytest.mark.parametrize("url", ["http://localhost:8001", "https://localhost:8001", "ftp://localhost:8001"])
def test_a_triton_url_of_another_protocol_is_refused_at_once(url):
    completed = subprocess.run(
        whisper_triton_command() + ["gateway", f"--triton-url={url}"], capture_output=True, text=True, timeout=60
    )
    assert completed.returncode == 2
    assert completed.stderr.startswith("whisper-triton gateway: --triton-url: ")
    assert len(completed.stderr.splitlines()) == 1 and "Traceback" not in completed.stderr


def test_a_grpc_scheme_is_accepted():
    assert GatewaySettings(triton_url="grpc://triton:8001/").triton.location == "triton:8001"
