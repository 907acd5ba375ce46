"""The helpers that the Triton adapters share, checked without a server."""

from __future__ import annotations

import json
from concurrent.futures import CancelledError

import numpy as np
import pytest

from python_backend_lib.serving import (
    CHECKPOINT_ENV,
    CancellationProbe,
    Fault,
    ModelSettings,
    describe_failure,
    exact_seconds,
    single_row,
)


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


def test_failures_are_the_clients_only_when_they_are_value_errors():
    assert describe_failure(ValueError("audio is empty")) == ("audio is empty", Fault.CLIENT)
    assert describe_failure(CancelledError("request cancelled")) == ("cancelled: request cancelled", Fault.CANCELLED)
    message, fault = describe_failure(RuntimeError("CUDA out of memory"))
    assert message == "internal error: RuntimeError: CUDA out of memory" and fault is Fault.SERVER


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
