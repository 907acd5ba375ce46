import json

import numpy as np
import pytest

from python_backend_lib.audio.decode import (
    MAX_CHANNELS,
    MAX_SAMPLE_RATE,
    MIN_SAMPLE_RATE,
    AudioError,
    pcm_to_waveform,
)
from python_backend_lib.contract.parameters import InputFormat, RequestParameters, parse_request_parameters
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.options import (
    DecodingOptions,
    LongFormMode,
    Task,
    TranscribeOptions,
    WindowPadding,
)
from python_backend_lib.text.formats import ResponseFormat


@pytest.mark.parametrize("raw", [None, "", "{}", {}])
def test_no_parameters_give_the_defaults(raw):
    assert parse_request_parameters(raw) == RequestParameters()


def test_every_documented_parameter_is_parsed():
    raw = json.dumps(
        {
            "language": "en",
            "task": "translate",
            "timestamps": True,
            "prompt": "Kennedy.",
            "max_new_tokens": 100,
            "temperature": 0.5,
            "min_new_tokens": 20,
            "beam_size": 5,
            "best_of": 3,
            "patience": 2,
            "length_penalty": 0.6,
            "seed": 7,
            "word_timestamps": True,
            "long_form": "batched",
            "condition_on_previous_text": False,
            "temperature_increment": 0,
            "compression_ratio_threshold": 2,
            "logprob_threshold": -0.5,
            "no_speech_threshold": 0.9,
            "window_padding": "transformers",
            "live": True,
            "response_format": "srt",
            "input_format": "pcm_f32le",
            "sample_rate": 8000,
            "channels": 2,
        }
    )
    assert parse_request_parameters(raw) == RequestParameters(
        transcription=TranscribeOptions(
            decoding=DecodingOptions(
                language="en",
                task=Task.TRANSLATE,
                timestamps=True,
                prompt="Kennedy.",
                max_new_tokens=100,
                min_new_tokens=20,
                temperature=0.5,
                beam_size=5,
                best_of=3,
                patience=2,
                length_penalty=0.6,
                seed=7,
            ),
            word_timestamps=True,
            mode=LongFormMode.BATCHED,
            condition_on_previous_text=False,
            temperature_increment=0,
            compression_ratio_threshold=2,
            logprob_threshold=-0.5,
            no_speech_threshold=0.9,
            window_padding=WindowPadding.TRANSFORMERS,
            live=True,
        ),
        response_format=ResponseFormat.SRT,
        input_format=InputFormat.PCM_F32LE,
        sample_rate=8000,
        channels=2,
    )


def test_integer_temperature_is_a_number():
    assert parse_request_parameters({"temperature": 1}).decoding.temperature == 1


def test_defaults_are_openai_whispers():
    options = parse_request_parameters({}).transcription
    assert options.temperatures == (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert (options.compression_ratio_threshold, options.logprob_threshold, options.no_speech_threshold) == (
        2.4, -1.0, 0.6
    )
    assert options.mode is LongFormMode.SEQUENTIAL and options.condition_on_previous_text
    assert not options.word_timestamps
    assert options.window_padding is WindowPadding.OPENAI_WHISPER
    assert parse_request_parameters({"temperature_increment": 0}).transcription.temperatures == (0.0,)


@pytest.mark.parametrize("response_format", [f.value for f in ResponseFormat])
def test_every_format_decodes_with_timestamps_unless_told_otherwise(response_format):
    parsed = parse_request_parameters({"response_format": response_format})
    assert parsed.response_format is ResponseFormat(response_format)
    assert parsed.decoding.timestamps is True  # as openai-whisper
    told = parse_request_parameters({"response_format": response_format, "timestamps": False})
    assert told.decoding.timestamps is False


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"beam_width": 5}, "unknown request parameter 'beam_width'"),
        ({"beam_size": 5.0}, "'beam_size' must be int, got float"),
        ({"beam_size": 0}, "beam_size must be an integer from 1 to 16, got 0"),
        ({"best_of": True}, "'best_of' must be int, got bool"),
        ({"patience": "2"}, "'patience' must be int or float, got str"),
        ({"beam_size": 2, "patience": 0.1}, "leaves no candidate"),
        ({"length_penalty": -0.5}, "length_penalty must be a number from 0 to 1"),
        ({"timestamps": "true"}, "'timestamps' must be bool, got str"),
        ({"timestamps": 1}, "'timestamps' must be bool, got int"),
        ({"max_new_tokens": True}, "'max_new_tokens' must be int, got bool"),
        ({"max_new_tokens": "10"}, "'max_new_tokens' must be int, got str"),
        ({"temperature": "0.5"}, "'temperature' must be int or float, got str"),
        ({"language": 1}, "'language' must be str"),
        ({"sample_rate": 16000.0}, "'sample_rate' must be int, got float"),
        ({"word_timestamps": "yes"}, "'word_timestamps' must be bool, got str"),
        ({"condition_on_previous_text": 0}, "'condition_on_previous_text' must be bool, got int"),
        ({"min_new_tokens": 1.5}, "'min_new_tokens' must be int, got float"),
        ({"min_new_tokens": 500}, "min_new_tokens must be an integer from 0 to max_new_tokens"),
        ({"long_form": "parallel"}, "long_form must be one of"),
        ({"window_padding": "silence"}, "window_padding must be one of .'transformers', 'openai-whisper'., got 'silence'"),
        ({"live": "yes"}, "'live' must be bool, got str"),
        ({"temperature_increment": 2}, "temperature_increment must be from 0 to 1"),
        ({"temperature_increment": True}, "'temperature_increment' must be int or float, got bool"),
        ({"temperature_increment": 0.001}, "0.001 from temperature 0 tries 1,001 temperatures a window; at most 11"),
        ({"temperature_increment": 5e-324}, "tries over a million temperatures"),
        ({"temperature": 0.5, "temperature_increment": 0.04}, "at most 11 are allowed (an increment of at least 0.05"),
        ({"response_format": "diarized_json"}, "'response_format' must be one of"),
        ({"no_speech_threshold": 1.5}, "no_speech_threshold must be a number from 0 to 1, got 1.5"),
        ({"compression_ratio_threshold": -1}, "compression_ratio_threshold must be a number of at least 0"),
        ({"logprob_threshold": "-1"}, "'logprob_threshold' must be int or float, got str"),
        ({"logprob_threshold": True}, "'logprob_threshold' must be int or float, got bool"),
        ({"task": "summarise"}, "task must be one of"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer from 1"),
        ({"input_format": "mp3"}, "'input_format' must be one of"),
        ({"sample_rate": 16000}, "'sample_rate' applies only to input_format 'pcm_f32le'"),
        ({"channels": 2}, "'channels' applies only to input_format 'pcm_f32le'"),
        ({"input_format": "pcm_f32le"}, "'sample_rate' is required"),
        ({"input_format": "pcm_f32le", "sample_rate": 10}, "'sample_rate' must be from"),
        ({"input_format": "pcm_f32le", "sample_rate": 16000, "channels": 0}, "'channels' must be from"),
        ("not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_parameters_are_rejected_naming_the_problem(raw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_request_parameters(raw)


def test_parameters_are_frozen():
    parameters = parse_request_parameters("{}")
    with pytest.raises(AttributeError):
        parameters.channels = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("sample_rate", "channels", "accepted"),
    [
        (MIN_SAMPLE_RATE, 1, True),
        (MAX_SAMPLE_RATE, MAX_CHANNELS, True),
        (MIN_SAMPLE_RATE - 1, 1, False),
        (MAX_SAMPLE_RATE + 1, 1, False),
        (16_000, MAX_CHANNELS + 1, False),
    ],
)
def test_raw_pcm_bounds_are_the_decoders(sample_rate, channels, accepted):
    """One set of bounds: what the request parameters accept, the decoder decodes,
    and what they refuse, the decoder refuses too (for callers of the library)."""
    raw = {"input_format": "pcm_f32le", "sample_rate": sample_rate, "channels": channels}
    pcm = np.zeros(sample_rate * channels // 100, "<f4").tobytes()  # 10 ms of silence
    if accepted:
        parameters = parse_request_parameters(raw)
        assert (parameters.sample_rate, parameters.channels) == (sample_rate, channels)
        assert pcm_to_waveform(pcm, sample_rate, channels=channels).size > 0
    else:
        with pytest.raises(RequestError, match="must be from"):
            parse_request_parameters(raw)
        with pytest.raises(AudioError, match="outside|must be from"):
            pcm_to_waveform(pcm, sample_rate, channels=channels)
    assert MAX_CHANNELS == 32  # the bound chosen, and why, in audio/decode.py


def test_a_request_may_be_named_and_a_cancel_names_one():
    named = parse_request_parameters({"request_id": "0b6f4c1e-1d2a-4c1b-9a55-3e0b9d7c1a2f", "language": "en"})
    assert named.request_id == "0b6f4c1e-1d2a-4c1b-9a55-3e0b9d7c1a2f" and named.cancel is None
    assert parse_request_parameters({"cancel": "abc"}).cancel == "abc"
    for raw, message in (
        ({"request_id": "../etc"}, "'request_id' must be 1 to 128 letters"),
        ({"request_id": ".hidden"}, "'request_id' must be"),
        ({"request_id": "x" * 129}, "'request_id' must be"),
        ({"cancel": "a/b"}, "'cancel' must be"),
        ({"cancel": 7}, "'cancel' must be str"),
        ({"cancel": "abc", "language": "en"}, "makes a cancel request: send it alone"),
    ):
        with pytest.raises(RequestError, match=message):
            parse_request_parameters(raw)
