import json

import pytest

from python_backend_lib.options import DecodingOptions, Task
from python_backend_lib.parameters import InputFormat, RequestParameters, parse_request_parameters


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
            "input_format": "pcm_f32le",
            "sample_rate": 8000,
            "channels": 2,
        }
    )
    assert parse_request_parameters(raw) == RequestParameters(
        decoding=DecodingOptions(
            language="en",
            task=Task.TRANSLATE,
            timestamps=True,
            prompt="Kennedy.",
            max_new_tokens=100,
            temperature=0.5,
        ),
        input_format=InputFormat.PCM_F32LE,
        sample_rate=8000,
        channels=2,
    )


def test_integer_temperature_is_a_number():
    assert parse_request_parameters({"temperature": 1}).decoding.temperature == 1


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"beam_size": 5}, "unknown request parameter 'beam_size'"),
        ({"timestamps": "true"}, "'timestamps' must be bool, got str"),
        ({"timestamps": 1}, "'timestamps' must be bool, got int"),
        ({"max_new_tokens": True}, "'max_new_tokens' must be int, got bool"),
        ({"max_new_tokens": "10"}, "'max_new_tokens' must be int, got str"),
        ({"temperature": "0.5"}, "'temperature' must be int or float, got str"),
        ({"language": 1}, "'language' must be str"),
        ({"sample_rate": 16000.0}, "'sample_rate' must be int, got float"),
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
