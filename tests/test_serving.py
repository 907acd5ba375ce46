"""The helpers that the Triton adapters share, checked without a server."""

from __future__ import annotations

import json
from concurrent.futures import CancelledError

import numpy as np
import pytest

from python_backend_lib.audio.decode import MAX_CHANNELS, AudioError, decode_audio, pcm_to_waveform
from python_backend_lib.core.errors import RequestError
from python_backend_lib.core.options import DecodingOptions, TranscribeOptions
from python_backend_lib.engine.scheduler import InjectedFault
from python_backend_lib.serving.inputs import CancellationProbe, check_log_mel, exact_seconds, single_row
from python_backend_lib.serving.parameters import parse_request_parameters
from python_backend_lib.serving.responses import Fault, describe_failure
from python_backend_lib.serving.settings import (
    CHECKPOINT_ENV,
    DEFAULT_MAX_AUDIO_SECONDS,
    FAULT_PROMPT_ENV,
    ModelSettings,
    load_pipeline,
)
from python_backend_lib.text.formats import Document


def triton_config(**fields) -> str:
    return json.dumps({"name": "whisper", "max_batch_size": 64, **fields})


def test_model_settings_default_to_the_packaged_checkpoint():
    settings = ModelSettings.from_triton(triton_config(), environ={})
    assert settings == ModelSettings(name="whisper", max_batch_size=64, checkpoint="default")


def test_model_settings_take_the_config_then_the_environment():
    config = triton_config(parameters={"checkpoint": {"string_value": "/models/base"}})
    assert ModelSettings.from_triton(config, environ={}).checkpoint == "/models/base"
    overridden = ModelSettings.from_triton(config, environ={CHECKPOINT_ENV: "/models/small"})
    assert overridden.checkpoint == "/models/small"


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (triton_config(max_batch_size=0), "max_batch_size must be at least 1"),
        (triton_config(parameters={"beam": {"string_value": "5"}}), "unknown config parameter"),
    ],
)
def test_model_settings_reject_a_config_they_cannot_serve(config, message):
    with pytest.raises(ValueError, match=message):
        ModelSettings.from_triton(config, environ={})


def test_single_row_takes_one_clip_and_names_the_tensor():
    assert single_row(np.zeros((1, 80, 3000)), "LOG_MEL").shape == (80, 3000)
    with pytest.raises(ValueError, match=r"LOG_MEL must hold exactly one clip .* \[2, 80, 3000\]"):
        single_row(np.zeros((2, 80, 3000)), "LOG_MEL")


def test_failures_are_the_clients_only_when_they_are_request_errors():
    assert describe_failure(RequestError("unknown request parameter 'beam'")) == (
        "unknown request parameter 'beam'", Fault.CLIENT
    )
    assert describe_failure(AudioError("audio is empty")) == ("audio is empty", Fault.CLIENT)
    assert describe_failure(CancelledError("request cancelled")) == ("cancelled: request cancelled", Fault.CANCELLED)
    failure = describe_failure(RuntimeError("CUDA out of memory"))
    assert failure.message == "internal error: RuntimeError: CUDA out of memory" and failure.fault is Fault.SERVER
    # A ValueError that is not a RequestError is a bug of ours, such as a broken invariant in the KV pool.
    failure = describe_failure(ValueError("slot 3 is already free"))
    assert failure == ("internal error: ValueError: slot 3 is already free", Fault.SERVER)
    # The engine's test fault hook raises one, so the served tests show the same through the server.
    assert issubclass(InjectedFault, ValueError) and not issubclass(InjectedFault, RequestError)
    assert describe_failure(InjectedFault("injected")).fault is Fault.SERVER


@pytest.mark.parametrize(
    ("make", "client_fault"),
    [
        (lambda: parse_request_parameters({"beam": 5}), True),
        (lambda: parse_request_parameters("not json"), True),
        (lambda: DecodingOptions(temperature=3.0), True),
        (lambda: TranscribeOptions(mode="parallel"), True),
        (lambda: decode_audio(b"not audio"), True),
        (lambda: pcm_to_waveform(b"\0" * 8, 16_000, channels=MAX_CHANNELS + 1), True),
        (lambda: check_log_mel(np.zeros((80, 3000)), -1.0, 80, 60.0), True),
        (lambda: Document.from_verbose_json("{}"), True),
        # The server's own setup: a bad limit, a bad config.pbtxt.
        (lambda: decode_audio(b"RIFF", max_seconds=0), False),
        (lambda: ModelSettings.from_triton(triton_config(max_batch_size=0), environ={}), False),
    ],
    ids=["parameter", "json", "options", "long-form mode", "audio", "channels", "log-mel", "transcript",
         "max-seconds", "config"],
)
def test_whose_fault_each_refusal_is(make, client_fault):
    with pytest.raises(ValueError) as caught:
        make()
    assert isinstance(caught.value, RequestError) == client_fault, caught.value
    assert (describe_failure(caught.value).fault is Fault.CLIENT) == client_fault


@pytest.mark.parametrize("samples", [1, 56_040, 852_267, 2**23 - 1])
def test_exact_seconds_recovers_the_sample_count_from_float32(samples):
    seconds = samples / 16_000
    assert exact_seconds(float(np.float32(seconds))) == seconds


def test_cancellation_probe_asks_at_most_once_per_interval():
    asked = []

    def is_cancelled():
        asked.append(True)
        return len(asked) >= 2

    probe = CancellationProbe(is_cancelled, interval_s=3600)
    assert [probe(), probe(), probe()] == [False, False, False]
    assert len(asked) == 1
    eager = CancellationProbe(is_cancelled, interval_s=0)
    assert eager() is True and eager() is True
    assert len(asked) == 2  # a cancelled request stays cancelled without asking again


def test_model_settings_parse_the_operating_limits():
    config = triton_config(
        parameters={
            "max_audio_seconds": {"string_value": "600"},
            "max_queued_requests": {"string_value": "0"},
            "kv_slots": {"string_value": "8"},
            "kv_memory_fraction": {"string_value": "auto"},
        }
    )
    settings = ModelSettings.from_triton(config, environ={})
    assert (settings.max_audio_seconds, settings.max_queued_requests, settings.kv_slots) == (600.0, 0, 8)
    assert settings.kv_memory_fraction is None
    assert settings.request_limit(slots=8) == 8  # no queue: only the slots
    default = ModelSettings.from_triton(triton_config(), environ={})
    assert default.max_audio_seconds == DEFAULT_MAX_AUDIO_SECONDS and default.request_limit(slots=16) == 32


@pytest.mark.parametrize(
    ("key", "value"),
    [("kv_slots", "0"), ("kv_slots", "1.5"), ("kv_memory_fraction", "1.2"), ("max_audio_seconds", "ten"),
     ("max_queued_requests", "-1")],
)  # fmt: skip
def test_model_settings_refuse_a_bad_limit_naming_it(key, value):
    config = triton_config(parameters={key: {"string_value": value}})
    with pytest.raises(ValueError, match=f"config parameter {key!r} must be 'auto' or .* got {value!r}"):
        ModelSettings.from_triton(config, environ={})


MEL = np.zeros((80, 3000), np.float32)


@pytest.mark.parametrize(
    ("log_mel", "seconds", "message"),
    [
        (np.zeros((128, 3000), np.float32), 1.0, r"LOG_MEL must be \[80, frames\] for this checkpoint, got \[128, 3000\]"),
        (np.zeros(3000, np.float32), 1.0, r"LOG_MEL must be \[80, frames\]"),
        (np.where(np.eye(80, 3000) > 0, np.nan, MEL), 1.0, "LOG_MEL contains NaN or infinite values"),
        (MEL, float("nan"), "AUDIO_SECONDS must be a finite duration"),
        (MEL, -1.0, "AUDIO_SECONDS must be a finite duration"),
        (np.zeros((80, 3000 + 100 * 700), np.float32), 700.0, "audio is 700.0 s long; the limit is 600 s"),
        (np.zeros((80, 9000), np.float32), 10.0, "LOG_MEL has 9000 frames, more than 10.00 s of audio"),
    ],
    ids=["mels", "rank", "nan", "nan-seconds", "negative-seconds", "too-long", "frames"],
)
def test_log_mel_sent_to_the_whisper_model_is_checked(log_mel, seconds, message):
    with pytest.raises(ValueError, match=message):
        check_log_mel(log_mel, seconds, n_mels=80, max_audio_seconds=600)


def test_log_mel_as_preprocessing_writes_it_passes():
    check_log_mel(MEL, 11.0, n_mels=80, max_audio_seconds=600)
    check_log_mel(np.zeros((80, 3000 + 5327), np.float32), 53.27, n_mels=80, max_audio_seconds=600)


def test_the_fault_hook_is_off_unless_its_variable_is_set():
    settings = ModelSettings.from_triton(triton_config(parameters={"checkpoint": {"string_value": "random:tiny"}}), environ={})
    assert load_pipeline(settings, environ={}).engine.options.fault_prompt is None
    hooked = load_pipeline(settings, environ={FAULT_PROMPT_ENV: "boom"})
    assert hooked.engine.options.fault_prompt == "boom"
