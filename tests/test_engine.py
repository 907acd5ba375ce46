"""The continuous-batching engine: requests join and leave a running batch
without changing each other's results."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError, Future

import pytest
import torch

from python_backend_lib import audio
from python_backend_lib.options import DecodingOptions
from python_backend_lib.pipeline import Pipeline

from reference import clips

SLOTS = 4


@pytest.fixture(scope="module")
def pipe():
    pipeline = Pipeline.load("default", device="cpu", slots=SLOTS)
    yield pipeline
    pipeline.close()


@pytest.fixture(scope="module")
def features(pipe):
    return [audio.window_features(audio.decode_audio(c.read())[: audio.N_SAMPLES], pipe.n_mels) for c in clips()[:6]]


def _submit(pipe, features, options, **kwargs) -> Future:
    future: Future = Future()

    def on_done(outcome):
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    pipe.engine.submit(features, options, on_done, **kwargs)
    return future


def test_requests_join_a_running_batch(pipe, features):
    solo = [_submit(pipe, f, DecodingOptions()).result().tokens for f in features]
    # A long forced decode keeps the batch running while the others join it,
    # more requests than slots, so some wait for a slot to free up.
    long = _submit(pipe, features[0], DecodingOptions(min_new_tokens=120, max_new_tokens=120))
    joined = [_submit(pipe, f, DecodingOptions()) for f in features]
    assert [f.result().tokens for f in joined] == solo
    assert len(long.result().tokens) == 120
    assert pipe.engine.batch.free_slots == SLOTS


def test_cancelled_request_frees_its_slot(pipe, features):
    steps = 0
    lock = threading.Lock()

    def cancel_after_a_few_steps() -> bool:
        nonlocal steps
        with lock:
            steps += 1
            return steps > 5

    cancelled = _submit(
        pipe, features[1], DecodingOptions(min_new_tokens=200, max_new_tokens=200), is_cancelled=cancel_after_a_few_steps
    )
    neighbour = _submit(pipe, features[2], DecodingOptions())
    with pytest.raises(CancelledError):
        cancelled.result(timeout=60)
    assert neighbour.result(timeout=60).finished
    assert pipe.engine.batch.free_slots == SLOTS


def test_bad_requests_are_refused_at_submit(pipe, features):
    with pytest.raises(ValueError, match="features must have shape"):
        pipe.engine.submit(torch.zeros(80, 100), DecodingOptions(), lambda _: None)
    with pytest.raises(ValueError, match="English-only"):
        pipe.engine.submit(features[0], DecodingOptions(language="de"), lambda _: None)


def test_a_failing_callback_does_not_stop_the_engine(pipe, features):
    def explode(_):
        raise RuntimeError("callback bug")

    pipe.engine.submit(features[3], DecodingOptions(max_new_tokens=3), explode)
    assert _submit(pipe, features[3], DecodingOptions(max_new_tokens=3)).result(timeout=60).tokens
