"""The log-mel on a GPU is queued behind the engine's work, never waits for it.

The whisper model computes the log-mel of a whole `execute` call on the device
where the engine thread has decoder steps queued. A copy from pageable memory
(a waveform, or a small tensor of lengths) waits for all of them, which costs
`execute` milliseconds per call and serialises it behind the engine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from python_backend_lib.audio.features import features_for, features_for_many
from python_backend_lib.core.geometry import SAMPLE_RATE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda")
QUEUED_CYCLES = 2_000_000_000  # about a second of one kernel's spinning: far longer than the call


def _waveforms() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(int(seconds * SAMPLE_RATE)).astype(np.float32) * 0.1 for seconds in (1.5, 7, 30, 41)]


def test_the_log_mel_of_a_batch_does_not_wait_for_queued_device_work():
    waveforms = _waveforms()
    expected = features_for_many(waveforms, 80, CUDA)  # first use: filters and FFT plans are made here
    torch.cuda.synchronize()
    torch.cuda._sleep(QUEUED_CYCLES)
    queued_work = torch.cuda.Event()
    queued_work.record()
    got = features_for_many(waveforms, 80, CUDA)
    assert not queued_work.query(), "features_for_many waited for the device work queued before it"
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    # The batched pass equals each recording's own, here on the GPU as on the CPU.
    for waveform, item in zip(waveforms, got):
        assert torch.equal(item, features_for(waveform, 80, CUDA))


def test_the_captured_log_mel_equals_each_recordings_own_and_does_not_wait():
    """`FeatureGraphs`: calls of 1, 3 and 19 clips (a partly padded bucket, and more
    clips than the largest bucket), short and long, give `features_for`'s bits."""
    from python_backend_lib.engine.feature_graphs import FeatureGraphs

    graphs = FeatureGraphs(80, CUDA)
    graphs.capture()
    rng = np.random.default_rng(1)
    many = [rng.standard_normal(int(rng.uniform(0.3, 30) * SAMPLE_RATE)).astype(np.float32) * 0.1 for _ in range(19)]
    for waveforms in (_waveforms()[:1], _waveforms(), many):
        expected = [features_for(w, 80, CUDA) for w in waveforms]
        torch.cuda.synchronize()
        torch.cuda._sleep(QUEUED_CYCLES)
        queued_work = torch.cuda.Event()
        queued_work.record()
        got = graphs.features(waveforms)
        assert not queued_work.query(), "the captured log-mel waited for the device work queued before it"
        assert len(got) == len(waveforms)
        for a, b in zip(got, expected):
            assert a.shape == b.shape and torch.equal(a, b)
