"""Every config.pbtxt agrees with `tensor_names` and with the other models it feeds."""

from __future__ import annotations

import inspect
import json

import pytest
from pbtxt import REPOSITORY, load, one, parse_pbtxt

from python_backend_lib.contract import tensor_names as names
from python_backend_lib.serving import postprocessing_service, preprocessing_service, whisper_service
from python_backend_lib.serving.settings import CONFIG_PARAMETERS, ModelSettings

MAX_ADAPTER_LINES = 100

# model -> ({input: data type}, {output: data type})
DECODED = {
    names.TOKENS: "TYPE_INT32",
    names.WINDOWS: "TYPE_FP64",
    names.ALIGNMENT: "TYPE_FP64",
    names.LANGUAGE: "TYPE_INT32",
    names.LANGUAGE_PROBABILITY: "TYPE_FP64",
}
TRANSCRIPT = {names.TEXT: "TYPE_STRING", names.SEGMENTS: "TYPE_STRING", names.FORMATTED: "TYPE_STRING"}
VAD = {names.SPEECH_SPANS: "TYPE_INT64", names.RECORDING_SAMPLES: "TYPE_INT64"}  # vad_filter's, preprocessing's
PYTHON_MODELS = {
    names.PREPROCESSING_NAME: (
        {names.AUDIO: "TYPE_STRING"},
        {names.LOG_MEL: "TYPE_FP32", names.SAMPLES: "TYPE_INT64", names.SPEECH_SPANS: "TYPE_INT64",
         names.RECORDING_SAMPLES: "TYPE_INT64"},
    ),
    names.WHISPER_NAME: ({names.LOG_MEL: "TYPE_FP32", names.SAMPLES: "TYPE_INT64"}, DECODED),
    names.POSTPROCESSING_NAME: (
        {**DECODED, names.SAMPLES: "TYPE_INT64", names.SPEECH_SPANS: "TYPE_INT64", names.RECORDING_SAMPLES: "TYPE_INT64"},
        TRANSCRIPT,
    ),
    # Decoupled: every response repeats SAMPLES and vad_filter's tensors, as the ensemble hands
    # postprocessing only one response's tensors.
    names.WHISPER_STREAM_NAME: (
        {names.LOG_MEL: "TYPE_FP32", names.SAMPLES: "TYPE_INT64", **VAD},
        {**DECODED, names.SAMPLES: "TYPE_INT64", **VAD},
    ),
}
ENSEMBLE = ({names.AUDIO: "TYPE_STRING"}, TRANSCRIPT)
# Each ensemble's steps: the batch path and the streamed one, whose engine is decoupled.
ENSEMBLE_STEPS = {
    names.ENSEMBLE_NAME: [names.PREPROCESSING_NAME, names.WHISPER_NAME, names.POSTPROCESSING_NAME],
    names.STREAM_ENSEMBLE_NAME: [names.PREPROCESSING_NAME, names.WHISPER_STREAM_NAME, names.POSTPROCESSING_NAME],
}
DECOUPLED_MODELS = {names.STREAM_ENSEMBLE_NAME, names.WHISPER_STREAM_NAME}
# Every model reads the checkpoint: its log-mel's bins, its engine, its tokenizer.
CHECKPOINT_MODELS = [names.PREPROCESSING_NAME, names.WHISPER_NAME, names.POSTPROCESSING_NAME, names.WHISPER_STREAM_NAME]
# Where each model runs: preprocessing and whisper on every visible GPU (or on the CPU
# without one); postprocessing on the CPU, which is all it uses.
INSTANCE_KINDS = {
    names.PREPROCESSING_NAME: "KIND_AUTO",
    names.WHISPER_NAME: "KIND_AUTO",
    names.POSTPROCESSING_NAME: "KIND_CPU",
    names.WHISPER_STREAM_NAME: "KIND_AUTO",
}
SERVICES = {
    names.PREPROCESSING_NAME: preprocessing_service,
    names.WHISPER_NAME: whisper_service,
    names.POSTPROCESSING_NAME: postprocessing_service,
    names.WHISPER_STREAM_NAME: whisper_service,
}
TENSORS = [value for key, value in vars(names).items() if key.isupper() and not key.endswith("_NAME")]


def tensor_types(config: dict, field: str) -> dict[str, str]:
    return {one(t, "name"): one(t, "data_type") for t in config.get(field, [])}


# --- the tests -------------------------------------------------------------------


def test_parser_reads_nested_lists_and_comments():
    parsed = parse_pbtxt('a: 1 # note\nb [ { c: "x" }, { c: "y" } ]\nd { e: [ 1, -1 ] }')
    assert parsed == {"a": [1], "b": [{"c": ["x"]}, {"c": ["y"]}], "d": [{"e": [1, -1]}]}


def test_repository_holds_exactly_our_models():
    models = {path.parent.name for path in REPOSITORY.glob("*/config.pbtxt")}
    assert models == {*PYTHON_MODELS, *ENSEMBLE_STEPS}
    for model in models:
        assert one(load(model), "name") == model
        assert (REPOSITORY / model / "1").is_dir()


@pytest.mark.parametrize("model", list(PYTHON_MODELS))
def test_python_model_tensors_match_tensor_names(model):
    config = load(model)
    inputs, outputs = PYTHON_MODELS[model]
    assert one(config, "backend") == "python"
    assert tensor_types(config, "input") == inputs
    assert tensor_types(config, "output") == outputs


@pytest.mark.parametrize("model", list(PYTHON_MODELS))
def test_python_model_scheduling_is_spelled_out(model):
    config = load(model)
    assert one(config, "max_batch_size") == one(load(names.ENSEMBLE_NAME), "max_batch_size") > 0
    assert "dynamic_batching" in config
    assert [one(group, "kind") for group in config["instance_group"]] == [INSTANCE_KINDS[model]]
    assert all(one(tensor, "optional") in ("true", "false") for tensor in config["input"])
    # Requests are batched whatever their tensors' lengths: variable-length inputs are ragged.
    for tensor in config["input"]:
        if -1 in tensor["dims"]:
            assert one(tensor, "allow_ragged_batch") == "true", one(tensor, "name")


@pytest.mark.parametrize("model", list(PYTHON_MODELS))
def test_a_checkpoint_is_named_exactly_where_one_is_read(model):
    keys = [one(p, "key") for p in load(model).get("parameters", [])]
    assert (keys[:1] == ["checkpoint"]) == (model in CHECKPOINT_MODELS), keys


@pytest.mark.parametrize("model", list(PYTHON_MODELS))
def test_python_model_parameters_parse(model):
    """Every parameter is one `ModelSettings` knows, with a value it accepts."""
    config = load(model)
    parameters = {
        one(p, "key"): {"string_value": one(one(p, "value"), "string_value")} for p in config.get("parameters", [])
    }
    assert set(parameters) <= set(CONFIG_PARAMETERS)
    as_triton_gives_it = json.dumps({"name": model, "max_batch_size": one(config, "max_batch_size"), "parameters": parameters})
    settings = ModelSettings.from_triton(as_triton_gives_it, environ={})
    assert settings.checkpoint == "default"


@pytest.mark.parametrize("model", [m for m in PYTHON_MODELS if m != names.POSTPROCESSING_NAME])
def test_a_burst_is_refused_rather_than_queued_without_bound(model):
    (policy,) = one(load(model), "dynamic_batching")["default_queue_policy"]
    assert one(policy, "timeout_action") == "REJECT"
    assert 0 < one(policy, "max_queue_size") <= 1024


def test_postprocessing_never_refuses_what_whisper_decoded():
    """A refusal there throws a decoded request away, and the client's next request
    takes its place at once: with a bound of 1,024, four H200s' goodput fell from
    3,656 to 753 requests a second at 4,096 clients (docs/reliability.md). Bursts are
    refused where they enter, by preprocessing's and whisper's bounds."""
    batching = one(load(names.POSTPROCESSING_NAME), "dynamic_batching")
    policies = batching.get("default_queue_policy", [{}])
    assert all(policy.get("max_queue_size", [0]) == [0] for policy in policies), policies


def test_preprocessing_and_whisper_refuse_the_same_audio_length():
    def max_seconds(model: str) -> str:
        values = {one(p, "key"): one(one(p, "value"), "string_value") for p in load(model)["parameters"]}
        return values["max_audio_seconds"]

    assert max_seconds(names.PREPROCESSING_NAME) == max_seconds(names.WHISPER_NAME)
    assert max_seconds(names.WHISPER_STREAM_NAME) == max_seconds(names.WHISPER_NAME)


def test_only_the_streamed_path_is_decoupled():
    """HTTP and unary gRPC reach only non-decoupled models: `transcribe` and its steps stay so."""
    for model in [*PYTHON_MODELS, *ENSEMBLE_STEPS]:
        policy = load(model).get("model_transaction_policy", [{}])
        decoupled = one(policy[0], "decoupled") == "true" if policy[0] else False
        assert decoupled == (model in DECOUPLED_MODELS), model


def test_the_streamed_engine_runs_whispers_own_adapter():
    """One decoding code for both paths: whisper_stream's model.py is whisper's."""
    stream = REPOSITORY / names.WHISPER_STREAM_NAME / "1" / "model.py"
    assert stream.resolve() == (REPOSITORY / names.WHISPER_NAME / "1" / "model.py").resolve()


@pytest.mark.parametrize("model", list(PYTHON_MODELS))
def test_adapter_is_thin_and_takes_names_from_tensor_names(model):
    source = (REPOSITORY / model / "1" / "model.py").read_text()
    assert len(source.splitlines()) <= MAX_ADAPTER_LINES
    # Each adapter hands its requests to the serving layer, which reads the names.
    assert "tensor_names" in inspect.getsource(SERVICES[model])
    for tensor in TENSORS:
        assert f'"{tensor}"' not in source, f"{model}/1/model.py spells out {tensor!r}"


@pytest.mark.parametrize("ensemble", list(ENSEMBLE_STEPS))
def test_ensemble_interface(ensemble):
    config = load(ensemble)
    assert one(config, "platform") == "ensemble"
    assert (tensor_types(config, "input"), tensor_types(config, "output")) == ENSEMBLE


@pytest.mark.parametrize("ensemble", list(ENSEMBLE_STEPS))
def test_ensemble_steps_connect_every_tensor_once(ensemble):
    config = load(ensemble)
    steps = one(config, "ensemble_scheduling")["step"]
    assert [one(step, "model_name") for step in steps] == ENSEMBLE_STEPS[ensemble]
    # value in the ensemble -> its data type; the ensemble's inputs exist from the start
    available = dict(tensor_types(config, "input"))
    for step in steps:
        model = one(step, "model_name")
        inputs, outputs = PYTHON_MODELS[model]
        input_map = {one(m, "key"): one(m, "value") for m in step["input_map"]}
        output_map = {one(m, "key"): one(m, "value") for m in step["output_map"]}
        assert set(input_map) == set(inputs), f"{model}: every input mapped"
        assert set(output_map) == set(outputs), f"{model}: every output mapped"
        for tensor, value in input_map.items():
            assert value in available, f"{model} reads {value!r} before any step writes it"
            assert available[value] == inputs[tensor], f"{model}.{tensor}: data type"
        for tensor, value in output_map.items():
            assert value not in available, f"{value!r} written twice"
            available[value] = outputs[tensor]
    final = tensor_types(config, "output")
    assert {value: available[value] for value in final} == final


@pytest.mark.parametrize("ensemble", list(ENSEMBLE_STEPS))
def test_ensemble_intermediates_have_descriptive_names(ensemble):
    config = load(ensemble)
    public = set(tensor_types(config, "input")) | set(tensor_types(config, "output"))
    for step in one(config, "ensemble_scheduling")["step"]:
        for mapping in step["input_map"] + step["output_map"]:
            value = one(mapping, "value")
            assert value in public or (value.islower() and "_" in value), value
